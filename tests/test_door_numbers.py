"""bench/door_numbers.py (issue 45's numbers) on a run's files written here: the report callback's
door events for two steps and a load whose requests start before, during and after a backend's
time out of the door."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_drain_times_per_step_and_the_load_split_by_whether_a_backend_was_out(tmp_path: Path):
    t = 1_800_000_000.0
    for step, events in (("canary", [{"host": "h1", "event": "drain", "start": t + 10, "end": t + 12},
                                     {"host": "h1", "event": "ready", "start": t + 40, "end": t + 44, "up": True}]),
                         ("rerun", [])):
        (tmp_path / f"run-{step}").mkdir()
        (tmp_path / f"run-{step}" / "timeline.json").write_text(json.dumps({"door": {"events": events}}))
    requests = [{"start": 5.0, "status": "ok", "ttft": 0.1}, {"start": 20.0, "status": "ok", "ttft": 0.9},
                {"start": 30.0, "status": "truncated", "ttft": 0.5}, {"start": 60.0, "status": "ok", "ttft": 0.2}]
    (tmp_path / "run-load.json").write_text(json.dumps(
        {"started_at": t, "requests": requests, "seconds": 70.0, "ok_per_s": 0.043, "rate": 0.25, "max_tokens": 48}))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "door_numbers.py"), str(tmp_path / "run")],
                          capture_output=True, text=True, check=True)
    lines = [line.split() for line in done.stdout.splitlines() if line.strip()]
    assert ["canary", "h1", "2.0", "28.0", "4.0"] in lines
    # two requests started while h1 was out (t+10 to t+44), one of them cut
    assert ["steady", "2", "2", "0", "0", "0.200", "0.200"] in lines  # nearest rank: the upper of two
    assert ["a", "backend", "out", "2", "1", "0", "1", "0.900", "0.900"] in lines
    assert "ok requests per second over the load's 70 s: 0.043 (offered 0.25/s, 48 tokens each)" in done.stdout
