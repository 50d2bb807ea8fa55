"""The last stall per host or group for `mlafleet status` (mlafleet/ops/watchdog_status.py), read
from state files the watchdog program itself writes, by the snippet `mlafleet status` runs on hosts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

from mlafleet.ops import watchdog_status

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mlafleet_vllm_watchdog_s",
                                               REPO / "roles/vllm_watchdog/files/mlafleet_vllm_watchdog.py")
wd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = wd
_spec.loader.exec_module(wd)

NOW = 1_800_000_000.0
CFG = wd.Settings(max_restarts=3, restart_period_s=3600)


def state_file(tmp: Path, events: list[dict], stalled: str | None = None, restarts: tuple = ()) -> Path:
    """A state file as the watchdog writes it (its own Record and status_document)."""
    record = wd.Record()
    for event in events:
        record.add(event)
    doc = wd.status_document(record, wd.State(restarts=restarts, stalled=stalled), CFG, NOW)
    path = tmp / "state.json"
    path.write_text(json.dumps(doc))
    return path


def remote(path: Path | None) -> dict:
    """What the status script's snippet reports on a host whose state file is `path`."""
    snippet = watchdog_status.REMOTE_SNIPPET.replace(watchdog_status.STATE_FILE, str(path or "/nonexistent/state.json"))
    script = "import json\nout = {}\n" + snippet + "\nprint(json.dumps(out))\n"
    done = subprocess.run(["python3", "-c", script], capture_output=True, text=True, check=True)
    return {"host": "h1", **json.loads(done.stdout)}


def test_the_state_file_path_is_the_roles():
    role_vars = yaml.safe_load((REPO / "roles/vllm_watchdog/vars/main.yml").read_text())
    assert watchdog_status.STATE_FILE == role_vars["__vllm_watchdog_state_dir"] + "/state.json"


def test_no_watchdog_and_no_stall():
    assert watchdog_status.column(remote(None), NOW) == "no watchdog"


def test_a_stall_restarted_and_recovered(tmp_path):
    row = remote(state_file(tmp_path, [
        {"event": "started", "time": NOW - 9000},
        {"event": "stall", "action": "restart", "time": NOW - 7200},
        {"event": "restart", "rc": 0, "time": NOW - 7190},
        {"event": "recovered", "after_s": 95.0, "time": NOW - 7100}], restarts=(NOW - 7200,)))
    assert watchdog_status.last_stall(row)["action"] == "restart"
    # the restart is 2 h old: outside the 1 h period, the bound counts none
    assert watchdog_status.column(row, NOW) == "2h ago: restarted, recovered in 95.0 s (0/3 restarts in the period)"


def test_a_refused_stall_is_loud(tmp_path):
    row = remote(state_file(tmp_path, [
        {"event": "stall", "action": "restart", "time": NOW - 1000},
        {"event": "recovered", "after_s": 60.0, "time": NOW - 900},
        {"event": "stall", "action": "refused", "time": NOW - 300}],
        stalled="refused", restarts=(NOW - 3000, NOW - 2000, NOW - 1000)))
    summary = watchdog_status.last_stall(row)
    assert summary["exhausted"] is True and summary["recovered"] is None
    assert watchdog_status.column(row, NOW) == (
        "5m ago: NOT restarted: restart limit reached, STILL STALLED (3/3 restarts in the period)")


def test_a_group_shows_its_latest_stall_and_names_the_member(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    head = {**remote(state_file(tmp_path / "a", [{"event": "stall", "action": "restart", "time": NOW - 60},
                                                 {"event": "not_recovered", "after_s": 1800, "time": NOW - 30}])),
            "host": "head"}
    other = {**remote(state_file(tmp_path / "b", [{"event": "stall", "action": "held", "time": NOW - 4000},
                                                  {"event": "resumed", "time": NOW - 3900}])), "host": "worker"}
    worker = {"host": "worker2", **remote(None)}
    assert watchdog_status.group_column([worker, other, head], NOW) == (
        "head: 1m ago: restarted, NOT recovered (0/3 restarts in the period)")
    assert watchdog_status.group_column([worker], NOW) == "no watchdog"
    assert watchdog_status.column(other, NOW) == "1h ago: held: a rollout holds the host, resumed by itself (0/3 restarts in the period)"


def test_a_head_whose_server_stopped_answering_shows_down_until_it_answers_again(tmp_path):
    (tmp_path / "a").mkdir()
    events = [{"event": "stall", "action": "group", "group": "fleet", "time": NOW - 600},
              {"event": "down", "held": False, "group": "fleet", "time": NOW - 120}]
    head = {**remote(state_file(tmp_path / "a", events)), "host": "head"}
    assert watchdog_status.column(head, NOW) == (
        "DOWN 2m ago; 10m ago: NOT restarted: a serving group restarts whole (0/3 restarts in the period)")
    worker = {"host": "worker", **remote(None)}
    assert watchdog_status.group_column([worker, head], NOW).startswith("head: DOWN 2m ago; ")
    # back up, or a rollout's own stop (held): no longer down
    (tmp_path / "b").mkdir()
    up = {**remote(state_file(tmp_path / "b", events + [{"event": "up", "after_s": 60, "time": NOW - 60}])), "host": "head"}
    assert not watchdog_status.column(up, NOW).startswith("DOWN")
    (tmp_path / "c").mkdir()
    held = {**remote(state_file(tmp_path / "c", [{"event": "down", "held": True, "time": NOW - 60}])), "host": "head"}
    assert watchdog_status.column(held, NOW) == "none"


def test_an_unreadable_state_file_is_said(tmp_path):
    bad = tmp_path / "state.json"
    bad.write_text("{not json")
    assert watchdog_status.column(remote(bad), NOW).startswith("unreadable watchdog state (")
