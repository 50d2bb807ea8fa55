"""The engine-stall watchdog's decision (roles/vllm_watchdog/files/mlafleet_vllm_watchdog.py),
driven tick by tick and over every combination of its inputs.

`decide` is pure (state and observation in, decision out), so these tests feed it sequences of
samples shaped like vLLM's /metrics: a decode that moves the generation counter, a chunked
prefill that moves only the KV-cache usage, a wedged engine that moves nothing. The loop around it
(scraping a real HTTP server, running a real restart command, the state and textfile outputs) is
tested in tests/test_watchdog_loop_vllm.py with the release venvs' Python.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mlafleet_vllm_watchdog",
                                               REPO / "roles/vllm_watchdog/files/mlafleet_vllm_watchdog.py")
wd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = wd
_spec.loader.exec_module(wd)

CFG = wd.Settings(window_s=60, interval_s=10, max_restarts=2, restart_period_s=3600, recovery_timeout_s=600)
WALL0 = 1_800_000_000.0


def sample(running=1, waiting=0, gen=100.0, prompt=50.0, kv=0.1, finished=3.0, preempt=0.0) -> "wd.Sample":
    return wd.Sample(running=running, waiting=waiting, generation_tokens=gen, prompt_tokens=prompt,
                     kv_cache_usage=kv, finished_requests=finished, preemptions=preempt)


class Driver:
    """Feeds `decide` one observation per tick (interval_s apart), as the loop does."""

    def __init__(self, cfg=CFG, state=None):
        self.cfg, self.state, self.t = cfg, state or wd.State(), 0.0
        self.events: list[dict] = []
        self.actions: list[tuple[float, str]] = []

    def tick(self, s, held=False, probe=None, dt=None):
        self.t += self.cfg.interval_s if dt is None else dt
        obs = wd.Observation(mono=self.t, wall=WALL0 + self.t, sample=s, held=held)
        d = wd.decide(self.state, obs, self.cfg)
        self.events += d.events
        if d.action == "probe":
            assert probe is not None, f"t={self.t}: a probe was asked for and the test gave no answer"
            d = wd.decide(d.state, replace(obs, probe=probe), self.cfg)
            self.events += d.events
            assert d.action != "probe", "a probe is never asked for twice in a tick"
        self.state = d.state
        if d.action != "none":
            self.actions.append((self.t, d.action))
        return d

    def names(self):
        return [(e["event"], e.get("action")) for e in self.events]


def test_a_decode_that_moves_is_never_a_stall():
    drv = Driver()
    for i in range(200):
        drv.tick(sample(running=4, gen=100 + 7 * i))
    assert drv.actions == [] and drv.events == []


def test_a_wedged_engine_is_restarted_once_the_window_has_passed():
    drv = Driver()
    drv.tick(sample(gen=100))  # baseline at t=10
    frozen = sample(gen=120)
    drv.tick(frozen)  # the last movement, t=20
    for _ in range(5):  # t=30..70: 50 s still, less than the 60 s window
        assert drv.tick(frozen).action == "none"
    d = drv.tick(frozen)  # t=80: 60 s still
    assert d.action == "restart"
    (event,) = d.events
    assert event["event"] == "stall" and event["action"] == "restart" and event["reason"] == "metrics"
    assert event["still_for_s"] == 60 and event["running"] == 1 and event["generation_tokens"] == 120
    assert d.state.recovering_since == 80 and d.state.restarts == (WALL0 + 80,)


@pytest.mark.parametrize("moving", ["kv", "prompt", "waiting", "running", "finished", "preempt"])
def test_a_long_prefill_moves_something_else_and_is_not_a_stall(moving):
    """Chunked prefill: the generation counter stands still for many windows, but every engine step
    moves another engine-driven value (KV blocks allocated per chunk above all)."""
    drv = Driver()
    for i in range(100):  # 1000 s, about 17 windows, without one generated token
        values = {"kv": 0.1 + i / 1000, "prompt": 50.0 + 512 * (i // 3), "waiting": 5 - i % 2,
                  "running": 1 + i % 2, "finished": 3.0 + i, "preempt": float(i)}
        drv.tick(sample(gen=100, **{moving: values[moving]}))
    assert drv.actions == [] and drv.events == []


def test_an_idle_server_is_not_a_stall_and_is_not_probed_by_default():
    drv = Driver()
    for _ in range(500):
        drv.tick(sample(running=0, gen=100))
    assert drv.actions == [] and drv.events == []


def test_the_optional_probe_covers_an_idle_server():
    cfg = replace(CFG, probe_interval_s=300)
    drv = Driver(cfg)
    idle = sample(running=0, gen=100)
    for _ in range(29):  # t=10..290: less than 300 s idle (counted from the baseline at t=10)
        drv.tick(idle)
    assert drv.actions == []
    drv.tick(idle, probe="ok")  # t=300: not yet (290 s since the baseline)
    drv.tick(idle, probe="ok")  # t=310: 300 s idle, probed, answered
    assert drv.actions == [] and drv.state.probe_at == 310
    for _ in range(29):
        drv.tick(idle)  # no probe before the next interval
    drv.tick(idle, probe="error: HTTP 401")  # t=610: refused by the server: recorded, no restart
    assert drv.names() == [("probe_error", None)] and drv.actions == []
    for _ in range(29):
        drv.tick(idle)
    d = drv.tick(idle, probe="stalled: TimeoutError: timed out")  # t=910: no token: a stall
    assert d.action == "restart" and d.events[-1]["reason"] == "probe stalled: TimeoutError: timed out"


def test_a_probe_answered_with_movement_resets_the_idle_clock():
    cfg = replace(CFG, probe_interval_s=100)
    drv = Driver(cfg)
    drv.tick(sample(running=0, gen=100))
    for i in range(50):  # traffic: the generation counter moves while nothing is running at the scrape
        drv.tick(sample(running=0, gen=101 + i))
    assert drv.actions == []


def test_the_restart_bound_refuses_the_third_stall_in_an_hour_once_and_loudly():
    drv = Driver()
    for n in range(2):
        drv.tick(sample(gen=0))
        for _ in range(6):
            d = drv.tick(sample(gen=0))
        assert d.action == "restart"
        drv.tick(sample(running=0, gen=0), probe="ok")  # recovered
        assert drv.events[-1]["event"] == "recovered"
    drv.tick(sample(gen=5))
    for _ in range(6):
        d = drv.tick(sample(gen=5))
    assert d.action == "none" and d.events[-1]["action"] == "refused"
    assert "2 restarts in the last 3600 s" in d.events[-1]["why"]
    for _ in range(100):  # the same episode: recorded once, no restart
        assert drv.tick(sample(gen=5)).action == "none"
    assert [n for n in drv.names() if n[0] == "stall"] == [("stall", "restart")] * 2 + [("stall", "refused")]
    # an hour after the first restart the bound allows one again: the stall that persists is restarted
    first = drv.state.restarts[0] - WALL0
    drv.tick(sample(gen=5), dt=first + CFG.restart_period_s - drv.t)
    assert drv.actions[-1][1] == "restart" and drv.events[-1]["action"] == "restart"


def test_a_refused_stall_that_moves_again_is_recorded_as_resumed():
    drv = Driver(replace(CFG, max_restarts=0))
    for _ in range(8):
        drv.tick(sample(gen=1))
    drv.tick(sample(gen=2))
    assert drv.names() == [("stall", "refused"), ("resumed", None)] and drv.state.stalled is None


def test_a_rollout_holding_the_host_is_not_fought():
    drv = Driver()
    for _ in range(10):
        drv.tick(sample(gen=1), held=True)
    assert drv.actions == [] and drv.names() == [("stall", "held")]
    assert "a rollout holds this host" in drv.events[0]["why"]
    d = drv.tick(sample(gen=1))  # the lock is gone and the engine still stands: restart
    assert d.action == "restart"


def test_recovery_waits_for_a_token_then_records_how_long_it_took():
    drv = Driver()
    for _ in range(7):
        drv.tick(sample(gen=1))
    assert drv.actions == [(70, "restart")]
    for _ in range(5):
        assert drv.tick(None).action == "none"  # the server is starting: /metrics does not answer
    drv.tick(sample(running=0, gen=0), probe="stalled: HTTPError 503")  # up, but no token yet
    d = drv.tick(sample(running=0, gen=0), probe="ok")
    assert d.events == ({"event": "recovered", "after_s": 70.0},) and d.state.recovering_since is None
    for _ in range(20):  # watching again, from a fresh baseline
        assert drv.tick(sample(running=0, gen=1)).action == "none"


def test_a_server_that_does_not_recover_is_recorded_and_watched_again():
    drv = Driver()
    for _ in range(7):
        drv.tick(sample(gen=1))
    for _ in range(60):  # 600 s: the recovery timeout
        drv.tick(None)
    assert drv.events[-1]["event"] == "not_recovered" and drv.events[-1]["after_s"] == 600
    assert drv.state.recovering_since is None


def test_an_unreachable_server_resets_the_baseline():
    drv = Driver()
    for _ in range(4):
        drv.tick(sample(gen=1))
    drv.tick(None)  # restarted by someone else, or down
    for _ in range(5):  # 50 s from the new baseline: not yet a stall
        assert drv.tick(sample(gen=1)).action == "none"


def test_a_server_that_stops_answering_is_recorded_down_once_and_up_when_it_answers_again():
    drv = Driver()
    for _ in range(3):
        drv.tick(None)  # starting: never answered yet, nothing to record
    assert drv.events == []
    drv.tick(sample(running=0, gen=5))
    for _ in range(4):  # it served, then stopped answering: one "down", not one a tick
        drv.tick(None)
    assert drv.names() == [("down", None)] and drv.events[0]["held"] is False and "group" not in drv.events[0]
    drv.tick(sample(running=0, gen=0))  # back (restarted by someone): "up", after 40 s
    assert drv.names()[-1] == ("up", None) and drv.events[-1]["after_s"] == 40
    assert drv.actions == [] and drv.state.down_since is None


def test_a_serving_groups_head_is_never_restarted_alone_and_names_the_groups_restart(capsys):
    """A head restarted alone hangs (its workers cannot join a new head): a stall on a group's head
    is recorded with the command that restarts the group as a whole; a head that died (its worker
    died: the head exits at the next request) is recorded down with the same command."""
    cfg = replace(CFG, group="fleet", journal_socket="")
    drv = Driver(cfg)
    drv.tick(sample(gen=100))
    frozen = sample(gen=120)
    for _ in range(20):  # 200 s still with a request running: three windows
        drv.tick(frozen)
    assert drv.actions == []
    assert drv.names() == [("stall", "group")]
    event = drv.events[0]
    assert event["group"] == "fleet" and "mlafleet rollout -l fleet -e vllm_server_force_restart=true" in event["why"]
    drv.tick(None)
    assert drv.names()[-1] == ("down", None)
    assert drv.events[-1]["hint"] == "a serving group restarts whole: mlafleet rollout -l fleet -e vllm_server_force_restart=true"
    wd.journal(cfg, drv.events[-1])
    wd.journal(cfg, {**drv.events[-1], "held": True})  # a rollout's own stop: a notice, not critical
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("<2>server stopped answering") and out[1].startswith("<5>server stopped answering")


def test_counters_that_go_back_are_a_new_server_not_a_stall():
    drv = Driver()
    for _ in range(5):
        drv.tick(sample(gen=1000))
    for _ in range(5):
        assert drv.tick(sample(gen=3)).action == "none"


# -- every combination of the inputs ---------------------------------------------------------------

SAMPLES = {"down": None, "idle": sample(running=0, gen=10), "busy-still": sample(running=2, gen=10),
           "busy-moved": sample(running=2, gen=11), "waiting-only": sample(running=0, waiting=3, gen=10)}
STATES = {
    "fresh": wd.State(),
    "watching": wd.State(last=sample(running=2, gen=10), progress_at=0.0),
    "watching-idle": wd.State(last=sample(running=0, gen=10), progress_at=0.0, probe_at=0.0),
    "refused": wd.State(last=sample(running=2, gen=10), progress_at=0.0, stalled="refused"),
    "held": wd.State(last=sample(running=2, gen=10), progress_at=0.0, stalled="held"),
    "recovering": wd.State(recovering_since=0.0, recovering_wall=WALL0),
}


@pytest.mark.parametrize("state_name,sample_name,elapsed,held,probe,restarts,probe_interval", list(itertools.product(
    STATES, SAMPLES, [5.0, 60.0, 700.0], [False, True], [None, "ok", "stalled: x", "error: HTTP 401"],
    [0, 1, 2], [0.0, 30.0])))
def test_invariants_over_every_combination(state_name, sample_name, elapsed, held, probe, restarts, probe_interval):
    cfg = replace(CFG, probe_interval_s=probe_interval)
    history = tuple(WALL0 + elapsed - 100.0 * (i + 1) for i in range(restarts))  # all inside the period
    state = replace(STATES[state_name], restarts=history)
    s = SAMPLES[sample_name]
    obs = wd.Observation(mono=elapsed, wall=WALL0 + elapsed, sample=s, held=held, probe=probe)
    d = wd.decide(state, obs, cfg)
    names = [(e["event"], e.get("action")) for e in d.events]
    # a restart only for a stall, never while held, never past the bound, and it is recorded
    if d.action == "restart":
        assert not held and restarts < cfg.max_restarts and state.recovering_since is None
        assert names[-1] == ("stall", "restart")
        assert d.state.recovering_since == elapsed and len(d.state.restarts) == restarts + 1
        stalled_by_metrics = (s is not None and s.running > 0 and state_name != "fresh"
                              and s.values() == state.last.values() and elapsed >= cfg.window_s)
        stalled_by_probe = probe is not None and probe.startswith("stalled") and probe_interval > 0
        assert stalled_by_metrics or stalled_by_probe
    # a serving group's head is never restarted alone, whatever else holds
    assert wd.decide(state, obs, replace(cfg, group="g")).action != "restart"
    # a probe is asked for only when none was answered this tick
    if d.action == "probe":
        assert probe is None and s is not None
    # at most one stall event a tick, and a repeated held/refused episode is not recorded again
    assert sum(1 for n in names if n[0] == "stall") <= 1
    if state.stalled and ("stall", state.stalled) in names:
        pytest.fail(f"the {state.stalled} episode was recorded twice")
    # the restart history never grows without a restart, and keeps only the period's
    if d.action != "restart":
        assert len(d.state.restarts) <= restarts
    # the engine moving ends any episode
    if s is not None and state.last is not None and s.values() != state.last.values() \
            and state.recovering_since is None:
        assert d.action != "restart" and d.state.stalled is None
    # while recovering: only a token ends it, or the timeout
    if state_name == "recovering":
        assert d.action in ("none", "probe")
        ended = d.state.recovering_since is None
        assert ended == (probe == "ok" or elapsed >= cfg.recovery_timeout_s)


def test_settings_refuse_what_cannot_work(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"window_s": 10, "interval_s": 10, "restart_command": [], "windw_s": 3}')
    with pytest.raises(SystemExit, match="unknown settings windw_s"):
        wd.Settings.load(str(path))
    path.write_text('{"window_s": 10, "interval_s": 10, "restart_command": []}')
    with pytest.raises(SystemExit) as exc:
        wd.Settings.load(str(path))
    assert "interval_s (10) must be shorter than window_s (10)" in str(exc.value)
    assert "restart_command is empty" in str(exc.value)


def test_the_api_key_is_read_from_the_release_environment_file(tmp_path):
    env = tmp_path / "vllm.env"
    env.write_text("# comment\nHF_HUB_OFFLINE=1\nVLLM_API_KEY=k-123\nOTHER=x\n")
    assert wd.read_api_key(str(env)) == "k-123"
    assert wd.read_api_key(str(tmp_path / "absent")) == "" and wd.read_api_key("") == ""
