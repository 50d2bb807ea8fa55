"""mlafleet's engine-stall watchdog for vLLM: an engine that stopped generating while /health says 200.

    <release>/venv/bin/python -I mlafleet_vllm_watchdog.py --config /etc/mlafleet/vllm-watchdog.json

Runs under systemd beside vllm.service (the vllm_watchdog role), with the release's own Python:
prometheus_client, which every vLLM release venv carries, parses vLLM's /metrics and writes the
watchdog's own metrics for node_exporter's textfile collector. Nothing else outside the standard
library.

What counts as a stall. vLLM's engine core publishes its scheduler's state after every step it
takes (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`), and
the API server counts what the steps produced (`vllm:generation_tokens_total`,
`vllm:prompt_tokens_total`, `vllm:request_success_total`, `vllm:num_preemptions_total`). A wedged
engine takes no step, so every one of these stands still while /health keeps answering 200. A
stall is: requests running (`num_requests_running` > 0) and none of these values moved for
`window_s` seconds.

Why a slow prefill does not trip it. A long prompt is prefilled in chunks of at most
max_num_batched_tokens, one chunk an engine step; vLLM counts the prompt's tokens and emits its
first generated token only after the last chunk, so `generation_tokens` (and `prompt_tokens`)
stand still for the whole prefill. But every chunk allocates KV-cache blocks, so
`kv_cache_usage_perc` moves after every step, and requests admitted from the waiting queue move
the running and waiting gauges. A prefill moves them; a stall moves nothing. What no metric can
tell apart is ONE engine step longer than the window (a step publishes nothing until it ends):
the window must exceed the longest single step (a prefill chunk, a first-use kernel compilation),
hence the default of 180 s (docs/sm12x.md).

On a stall it records an event (the journal, at priority crit, and the state file), restarts the
server (`restart_command`), at most `max_restarts` times in `restart_period_s` (then it refuses,
loudly, until the oldest restart leaves the period), and records the recovery: the first
completion that returns a token after the restart. While `hold_file` exists (a rollout holds the
host: mlafleet's rollout lock) a stall is recorded but not acted on. An optional probe (a
1-token completion every `probe_interval_s` of idleness) covers servers that get no traffic.

The decision is a pure function (`decide`: state and observation in, decision out); `run` is the
loop around it: scrape, decide, act, write the state file and the textfile metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# vLLM's series (the sample names as prometheus_client parses them), summed over their labels
# (model_name, engine index, finished_reason). Both release lines (0.20.2, 0.32.0) export them.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION = "vllm:generation_tokens_total"
SIGNALS = {
    "running": RUNNING,
    "waiting": WAITING,
    "generation_tokens": GENERATION,
    "prompt_tokens": "vllm:prompt_tokens_total",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "finished_requests": "vllm:request_success_total",
    "preemptions": "vllm:num_preemptions_total",
}
REQUIRED = ("running", "generation_tokens")
EVENTS_KEPT = 50
PROBE_PROMPT = "Hello"


# -- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The watchdog's configuration (the JSON file the role writes; defaults documented there)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str = "model"
    api_key_file: str = ""  # an environment file holding VLLM_API_KEY=... ("" or absent: no key)
    window_s: float = 180.0
    interval_s: float = 10.0
    max_restarts: int = 3
    restart_period_s: float = 3600.0
    restart_command: tuple[str, ...] = ("systemctl", "restart", "vllm.service")
    restart_timeout_s: float = 600.0
    recovery_timeout_s: float = 1800.0
    probe_interval_s: float = 0.0  # 0: idle servers are not probed
    probe_timeout_s: float = 180.0
    scrape_timeout_s: float = 10.0
    state_file: str = "/var/lib/mlafleet-vllm-watchdog/state.json"
    textfile: str = ""  # node_exporter textfile collector file ("" for none)
    hold_file: str = ""  # while it exists, stalls are recorded, not acted on ("" for none)
    release_link: str = ""  # exit (systemd restarts us) when this symlink's target changes
    journal_socket: str = "/run/systemd/journal/socket"
    group: str = ""  # the serving group this server heads ("" for a single host): never restarted alone

    @classmethod
    def load(cls, path: str) -> Settings:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SystemExit(f"{path}: unknown settings {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "restart_command" in raw:
            raw["restart_command"] = tuple(raw["restart_command"])
        settings = cls(**raw)
        problems = [f"{name} must be > 0" for name in ("window_s", "interval_s", "restart_period_s",
                                                        "restart_timeout_s", "recovery_timeout_s",
                                                        "probe_timeout_s", "scrape_timeout_s")
                    if float(getattr(settings, name)) <= 0]
        if settings.max_restarts < 0 or settings.probe_interval_s < 0:
            problems.append("max_restarts and probe_interval_s must be >= 0")
        if settings.interval_s >= settings.window_s:
            problems.append(f"interval_s ({settings.interval_s}) must be shorter than window_s ({settings.window_s})")
        if not settings.restart_command:
            problems.append("restart_command is empty")
        if problems:
            raise SystemExit(f"{path}: " + "; ".join(problems))
        return settings


# -- reading vLLM's metrics ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """vLLM's engine-driven values at one scrape (each summed over its labels)."""

    running: float
    waiting: float
    generation_tokens: float
    prompt_tokens: float = 0.0
    kv_cache_usage: float = 0.0
    finished_requests: float = 0.0
    preemptions: float = 0.0

    def values(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in SIGNALS)


class NotVllmMetrics(ValueError):
    """The text has no vLLM engine series (another server, or vLLM with --disable-log-stats)."""


def parse_metrics(text: str) -> Sample:
    """A Sample from Prometheus exposition text, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {series: name for name, series in SIGNALS.items()}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = wanted.get(sample.name)
            if name is not None:
                sums[name] = sums.get(name, 0.0) + float(sample.value)
    missing = [SIGNALS[name] for name in REQUIRED if name not in sums]
    if missing:
        raise NotVllmMetrics(f"no {', '.join(missing)} in the metrics (vLLM started with --disable-log-stats?)")
    return Sample(**{name: sums.get(name, 0.0) for name in SIGNALS})


# -- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """What one tick saw. `mono` times windows, `wall` the restart history (it outlives restarts)."""

    mono: float
    wall: float
    sample: Sample | None = None  # None: /metrics did not answer (server down or starting)
    held: bool = False  # hold_file exists (a rollout holds the host)
    probe: str | None = None  # None: no probe this tick; "ok"; "stalled: ..."; "error: ..."


@dataclass(frozen=True)
class State:
    last: Sample | None = None  # the previous sample
    progress_at: float | None = None  # mono time the engine was last seen to move (or the baseline)
    probe_at: float | None = None  # mono time of the last probe
    restarts: tuple[float, ...] = ()  # wall times of the restarts still inside restart_period_s
    stalled: str | None = None  # inside a stall episode: the action taken ("held", "refused")
    recovering_since: float | None = None  # mono time of a restart whose recovery is awaited
    recovering_wall: float | None = None
    down_since: float | None = None  # mono time a server that answered stopped answering



@dataclass(frozen=True)
class Decision:
    state: State
    action: str = "none"  # "none", "probe", "restart"
    events: tuple[dict[str, Any], ...] = ()


def progressed(before: Sample, now: Sample) -> bool:
    """Whether the engine took a step between two samples: any engine-driven value moved
    (counters going back mean the server restarted: a new baseline, so progress too)."""
    return before.values() != now.values()


def recent_restarts(restarts: tuple[float, ...], wall: float, period: float) -> tuple[float, ...]:
    return tuple(t for t in restarts if wall - t < period)


def group_restart(cfg: Settings) -> str:
    """How an operator restarts a serving group as a whole (docs/multi-host.md)."""
    return f"mlafleet rollout -l {cfg.group} -e vllm_server_force_restart=true"


def _stall(state: State, obs: Observation, cfg: Settings, reason: str) -> Decision:
    """A stall seen now: restart within the bound, or record why not (once per episode)."""
    sample = obs.sample
    restarts = recent_restarts(state.restarts, obs.wall, cfg.restart_period_s)
    facts: dict[str, Any] = {"reason": reason, "restarts_in_period": len(restarts),
                             "max_restarts": cfg.max_restarts, "period_s": cfg.restart_period_s}
    if sample is not None:
        facts.update(running=sample.running, waiting=sample.waiting, generation_tokens=sample.generation_tokens)
    if state.progress_at is not None:
        facts["still_for_s"] = round(obs.mono - state.progress_at, 1)
    if obs.held:
        action = "held"
        facts["why"] = "a rollout holds this host (hold_file exists): not restarting"
    elif cfg.group:
        # A head restarted alone hangs: its workers cannot join a new head (docs/multi-host.md).
        action = "group"
        facts["group"] = cfg.group
        facts["why"] = (f"this server heads serving group {cfg.group}, which restarts only as a whole: "
                        f"not restarting the head alone; restart the group: {group_restart(cfg)}")
    elif len(restarts) >= cfg.max_restarts:
        action = "refused"
        facts["why"] = (f"{len(restarts)} restarts in the last {cfg.restart_period_s:.0f} s, the most allowed: "
                        "not restarting; the server needs an operator")
    else:
        new = replace(state, last=None, progress_at=None, stalled=None, restarts=restarts + (obs.wall,),
                      recovering_since=obs.mono, recovering_wall=obs.wall, probe_at=obs.mono)
        return Decision(new, "restart", ({"event": "stall", "action": "restart", **facts},))
    new = replace(state, restarts=restarts, stalled=action)
    if state.stalled == action:  # the same episode, already recorded
        return Decision(new)
    return Decision(new, events=({"event": "stall", "action": action, **facts},))


def decide(state: State, obs: Observation, cfg: Settings) -> Decision:
    """The watchdog's decision for one tick. Pure: no I/O, no clock.

    The loop calls it once per tick; when it answers "probe", the loop sends the probe and calls
    it again with the probe's result in `obs.probe` (a probe is never asked for twice a tick).
    """
    # After a restart: wait for the server, then for a completion that returns a token.
    if state.recovering_since is not None:
        waited = obs.mono - state.recovering_since
        if obs.probe == "ok":
            new = replace(state, recovering_since=None, recovering_wall=None, last=obs.sample,
                          progress_at=obs.mono, probe_at=obs.mono)
            return Decision(new, events=({"event": "recovered", "after_s": round(waited, 1)},))
        if waited >= cfg.recovery_timeout_s:
            new = replace(state, recovering_since=None, recovering_wall=None, last=obs.sample,
                          progress_at=obs.mono)
            return Decision(new, events=({"event": "not_recovered", "after_s": round(waited, 1),
                                          "last_probe": obs.probe,
                                          "why": "no completion returned a token within recovery_timeout_s"},))
        if obs.sample is not None and obs.probe is None:
            return Decision(state, "probe")
        return Decision(state)

    sample = obs.sample
    if sample is None:  # the server does not answer: down or starting, not a stall
        down = replace(state, last=None, progress_at=None)
        if state.last is None or state.down_since is not None:  # starting, or already recorded
            return Decision(down)
        # It answered, now it does not: stopped, or died (a group's head exits after its worker died).
        event: dict[str, Any] = {"event": "down", "why": "the server stopped answering /metrics", "held": obs.held}
        if cfg.group:
            event.update(group=cfg.group, hint=f"a serving group restarts whole: {group_restart(cfg)}")
        return Decision(replace(down, down_since=obs.mono), events=(event,))
    events: tuple[dict[str, Any], ...] = ()
    if state.down_since is not None:  # answering again (restarted)
        events = ({"event": "up", "after_s": round(obs.mono - state.down_since, 1)},)
        state = replace(state, down_since=None)
    moved = state.last is None or progressed(state.last, sample)
    if moved:
        progress_at = obs.mono
        if state.stalled is not None:
            events += ({"event": "resumed", "after": state.stalled,
                       "why": "the engine moved again without a restart by the watchdog"},)
        state = replace(state, last=sample, progress_at=progress_at, stalled=None)
    else:
        state = replace(state, last=sample)
    assert state.progress_at is not None

    # Requests running and nothing moved for the window: a stall.
    if sample.running > 0 and obs.mono - state.progress_at >= cfg.window_s:
        decision = _stall(state, obs, cfg, "metrics")
        return replace(decision, events=events + decision.events)

    # An idle server, probed when asked for: a 1-token completion.
    idle = sample.running == 0 and sample.waiting == 0
    if idle and cfg.probe_interval_s > 0:
        last = max(state.progress_at, state.probe_at if state.probe_at is not None else state.progress_at)
        due = obs.mono - last >= cfg.probe_interval_s
        if obs.probe is None and due:
            return Decision(state, "probe", events)
        if obs.probe is not None and due:  # the answer to the probe asked for above
            state = replace(state, probe_at=obs.mono)
            if obs.probe.startswith("stalled"):
                decision = _stall(state, obs, cfg, f"probe {obs.probe}")
                return replace(decision, events=events + decision.events)
            if obs.probe.startswith("error"):
                events += ({"event": "probe_error", "why": obs.probe,
                            "note": "the probe itself is refused (API key, model name): no restart"},)
    return Decision(state, "none", events)


# -- acting --------------------------------------------------------------------------------------


def read_api_key(path: str) -> str:
    """VLLM_API_KEY from an environment file (the release's vllm.env), "" when none."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                key, sep, value = line.strip().partition("=")
                if sep and key == "VLLM_API_KEY":
                    return value.strip().strip('"').strip("'")
    except OSError:
        return ""
    return ""


def scrape(cfg: Settings) -> Sample:
    with urllib.request.urlopen(cfg.base_url + "/metrics", timeout=cfg.scrape_timeout_s) as resp:
        return parse_metrics(resp.read().decode("utf-8", errors="replace"))


def probe(cfg: Settings) -> str:
    """A 1-token completion: "ok"; "stalled: ..." (no answer, a server error, no token); or
    "error: ..." (the request itself refused: 4xx, so restarting would not help)."""
    body = json.dumps({"model": cfg.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    key = read_api_key(cfg.api_key_file)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(cfg.base_url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=cfg.probe_timeout_s) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        kind = "error" if 400 <= exc.code < 500 else "stalled"
        return f"{kind}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # timeouts, refused connections, broken answers
        return f"stalled: {type(exc).__name__}: {exc}"
    tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
    return "ok" if tokens and tokens >= 1 else f"stalled: no token in the answer ({str(answer)[:200]})"


PRIORITY = {"stall": 2, "not_recovered": 2, "probe_error": 3, "restart": 4, "recovered": 5, "resumed": 5,
            "started": 6, "metrics": 4, "down": 2, "up": 5}


def message(event: dict[str, Any]) -> str:
    name = event["event"]
    if name == "stall":
        head = {"restart": "engine stall: restarting the server",
                "refused": "engine stall: NOT restarting, the restart limit is reached",
                "held": "engine stall: NOT restarting, a rollout holds this host",
                "group": "engine stall: NOT restarting the head of a serving group alone"}[event["action"]]
    else:
        head = {"recovered": "server recovered after the restart", "not_recovered": "server did NOT recover",
                "restart": "restart command finished", "resumed": "engine moved again",
                "probe_error": "probe refused", "started": "watchdog started",
                "metrics": "metrics problem", "down": "server stopped answering",
                "up": "server answers again"}.get(name, name)
    details = {k: v for k, v in event.items() if k not in ("event", "time")}
    return f"{head} {json.dumps(details, sort_keys=True)}"


def journal(cfg: Settings, event: dict[str, Any]) -> None:
    """The event to the journal: native protocol with MLAFLEET_EVENT=<name> (so `journalctl
    MLAFLEET_EVENT=stall` finds stalls), or stdout with a syslog priority prefix without it."""
    text = message(event)
    # a stall left alone because the restart limit is reached is the loudest: alert (1)
    priority = 1 if event.get("action") == "refused" else PRIORITY.get(event["event"], 5)
    if event["event"] == "down" and event.get("held"):
        priority = 5  # a rollout holds the host: its own stop

    if cfg.journal_socket and os.path.exists(cfg.journal_socket):
        fields = {"MESSAGE": text, "PRIORITY": str(priority), "SYSLOG_IDENTIFIER": "mlafleet-vllm-watchdog",
                  "MLAFLEET_EVENT": event["event"], "MLAFLEET_EVENT_JSON": json.dumps(event, sort_keys=True)}
        payload = "".join(f"{k}={v.replace(chr(10), ' ')}\n" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(payload, cfg.journal_socket)
            return
        except OSError:
            pass
    print(f"<{priority}>{text}", flush=True)


def atomic_write(path: str, text: str, mode: int) -> None:
    directory = os.path.dirname(path) or "."
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Record:
    """What the state file keeps across restarts of the watchdog: restarts, counts, last events."""

    restarts: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, dict[str, Any]] = field(default_factory=dict)  # event name -> the last one

    @classmethod
    def load(cls, path: str) -> Record:
        try:
            with open(path, encoding="utf-8") as handle:
                raw = json.load(handle)
        except (OSError, ValueError):
            return cls()
        return cls(restarts=[float(t) for t in raw.get("restarts", [])], counts=dict(raw.get("counts", {})),
                   events=list(raw.get("events", []))[-EVENTS_KEPT:], last=dict(raw.get("last", {})))

    def add(self, event: dict[str, Any]) -> None:
        self.counts[event["event"]] = self.counts.get(event["event"], 0) + 1
        if event["event"] == "stall":
            key = f"stall_{event['action']}"
            self.counts[key] = self.counts.get(key, 0) + 1
        self.events = (self.events + [event])[-EVENTS_KEPT:]
        self.last[event["event"]] = event


def status_document(record: Record, state: State, cfg: Settings, wall: float, note: str = "") -> dict[str, Any]:
    """The state file's content (read by `mlafleet status` through mlafleet/ops/watchdog_status.py)."""
    in_period = recent_restarts(state.restarts, wall, cfg.restart_period_s)
    return {
        "updated": wall,
        "settings": {"window_s": cfg.window_s, "max_restarts": cfg.max_restarts,
                     "restart_period_s": cfg.restart_period_s, "probe_interval_s": cfg.probe_interval_s},
        "restarts": list(in_period),
        "restarts_exhausted": len(in_period) >= cfg.max_restarts,
        "stalled": state.stalled,
        "recovering_since": state.recovering_wall,
        "counts": record.counts,
        "last": record.last,
        "events": record.events,
        "note": note,
    }


def write_textfile(path: str, doc: dict[str, Any]) -> None:
    """The watchdog's state for node_exporter's textfile collector, written by prometheus_client."""
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    counts, last = doc["counts"], doc["last"]

    class Collector:
        def collect(self):  # noqa: ANN202 - prometheus_client's protocol
            def counter(name: str, text: str, value: float):
                return CounterMetricFamily(f"mlafleet_vllm_watchdog_{name}", text, value=value)

            def gauge(name: str, text: str, value: float):
                return GaugeMetricFamily(f"mlafleet_vllm_watchdog_{name}", text, value=value)

            yield gauge("updated_timestamp_seconds", "When the watchdog last wrote this file.", doc["updated"])
            stalls = CounterMetricFamily("mlafleet_vllm_watchdog_stalls", "Engine stalls seen, by what was done.",
                                         labels=["action"])
            for action in ("restart", "refused", "held"):
                stalls.add_metric([action], counts.get(f"stall_{action}", 0))
            yield stalls
            yield counter("recoveries", "Restarts after which a completion returned a token.",
                          counts.get("recovered", 0))
            yield counter("failed_recoveries", "Restarts after which no completion returned a token in time.",
                          counts.get("not_recovered", 0))
            yield counter("probe_errors", "Probes the server refused (4xx).", counts.get("probe_error", 0))
            yield gauge("restarts_in_period", "Restarts within the restart period (the bound counts these).",
                        len(doc["restarts"]))
            yield gauge("max_restarts", "Restarts allowed within the restart period.", doc["settings"]["max_restarts"])
            yield gauge("restarts_exhausted", "1 while the restart limit is reached: a stall is not restarted.",
                        1 if doc["restarts_exhausted"] else 0)
            yield gauge("stalled", "1 while a stall is seen and not acted on (limit reached, or held).",
                        1 if doc["stalled"] else 0)
            yield gauge("recovering", "1 while a restart's recovery is awaited.", 1 if doc["recovering_since"] else 0)
            for name, event, text in (("last_stall_timestamp_seconds", "stall", "When the last stall was seen."),
                                      ("last_recovery_timestamp_seconds", "recovered", "When the last recovery was seen.")):
                yield gauge(name, text, float(last.get(event, {}).get("time", 0)))
            yield gauge("last_recovery_seconds", "Seconds from the last restart to its first token.",
                        float(last.get("recovered", {}).get("after_s", 0)))

    registry = CollectorRegistry()
    registry.register(Collector())
    write_to_textfile(path, registry)


class Watchdog:
    """The loop: one tick per interval_s."""

    def __init__(self, cfg: Settings):
        self.cfg = cfg
        self.record = Record.load(cfg.state_file)
        self.state = State(restarts=tuple(self.record.restarts))
        self.release = os.path.realpath(cfg.release_link) if cfg.release_link else ""
        self.note = ""

    def emit(self, events: tuple[dict[str, Any], ...] | list[dict[str, Any]], wall: float) -> None:
        for event in events:
            event = {"time": round(wall, 3), **event}
            self.record.add(event)
            journal(self.cfg, event)

    def save(self, wall: float) -> None:
        self.record.restarts = list(recent_restarts(self.state.restarts, wall, self.cfg.restart_period_s))
        doc = status_document(self.record, self.state, self.cfg, wall, self.note)
        atomic_write(self.cfg.state_file, json.dumps(doc, indent=1, sort_keys=True) + "\n", 0o644)
        if self.cfg.textfile:
            write_textfile(self.cfg.textfile, doc)

    def observe(self) -> Observation:
        mono, wall = time.monotonic(), time.time()
        held = bool(self.cfg.hold_file) and os.path.exists(self.cfg.hold_file)
        try:
            sample = scrape(self.cfg)
            if self.note:
                self.note = ""
        except NotVllmMetrics as exc:
            if self.note != str(exc):
                self.note = str(exc)
                self.emit([{"event": "metrics", "why": self.note}], wall)
            sample = None
        except (OSError, ValueError):
            sample = None
        return Observation(mono=mono, wall=wall, sample=sample, held=held)

    def tick(self) -> None:
        obs = self.observe()
        decision = decide(self.state, obs, self.cfg)
        if decision.action == "probe":
            self.emit(decision.events, obs.wall)
            obs = replace(obs, probe=probe(self.cfg), mono=time.monotonic(), wall=time.time())
            decision = decide(decision.state, obs, self.cfg)
        self.state = decision.state
        self.emit(decision.events, obs.wall)
        if decision.action == "restart":
            self.save(obs.wall)  # the stall is on disk before the restart begins
            self.emit([self.restart()], time.time())
        self.save(time.time())

    def restart(self) -> dict[str, Any]:
        start = time.monotonic()
        try:
            done = subprocess.run(list(self.cfg.restart_command), capture_output=True, text=True,
                                  timeout=self.cfg.restart_timeout_s, check=False)
            result = {"rc": done.returncode, "output": (done.stdout + done.stderr).strip()[-500:]}
        except (OSError, subprocess.TimeoutExpired) as exc:
            result = {"rc": None, "output": f"{type(exc).__name__}: {exc}"[:500]}
        return {"event": "restart", "command": list(self.cfg.restart_command),
                "took_s": round(time.monotonic() - start, 1), **result}

    def release_switched(self) -> bool:
        return bool(self.release) and os.path.realpath(self.cfg.release_link) != self.release

    def run(self, ticks: int | None = None) -> int:
        self.emit([{"event": "started", "window_s": self.cfg.window_s, "max_restarts": self.cfg.max_restarts,
                    "restart_period_s": self.cfg.restart_period_s, "probe_interval_s": self.cfg.probe_interval_s,
                    "python": sys.executable}], time.time())
        self.save(time.time())
        done = 0
        while ticks is None or done < ticks:
            started = time.monotonic()
            self.tick()
            done += 1
            if self.release_switched():
                # The release (and with it this Python) changed: exit, systemd starts us on the new one.
                print(f"<5>release switched to {os.path.realpath(self.cfg.release_link)}: exiting to restart on it",
                      flush=True)
                return 0
            time.sleep(max(0.0, self.cfg.interval_s - (time.monotonic() - started)))
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the JSON settings file")
    parser.add_argument("--ticks", type=int, default=None, help="stop after this many ticks (tests)")
    args = parser.parse_args(argv)
    return Watchdog(Settings.load(args.config)).run(args.ticks)


if __name__ == "__main__":
    sys.exit(main())
