"""`mlafleet loadgen` (mlafleet/ops/loadgen.py) against a real HTTP server on 127.0.0.1 (the
STAND-IN vLLM of tests/door_support.py) that refuses every 4th completion (503) and cuts every 3rd
stream it serves (no finish_reason, then [DONE], as vLLM's cut streams end): the counts must match,
and a cut stream never counts as ok."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from door_support import StandInVllm

from mlafleet.ops import loadgen


def test_counts_ok_refused_and_cut_streams_as_they_happened():
    server = StandInVllm(tokens=5, token_delay=0.01, cut_every=3, refuse_every=4)
    try:
        result = loadgen.run(f"http://127.0.0.1:{server.port}/v1/completions", rate=20, duration=0.6, max_tokens=5)
    finally:
        server.stop()
    # 12 requests: numbers 4, 8, 12 refused; of the 9 streams served the 3rd, 6th and 9th were cut
    assert (result["sent"], result["ok"], result["failed"], result["truncated"]) == (12, 6, 3, 3)
    assert sorted(r["error"] for r in result["requests"] if r["status"] == "failed") == ["HTTP 503"] * 3
    assert all(r["chunks"] == 2 for r in result["requests"] if r["status"] == "truncated")
    assert all(r["chunks"] == 5 and r["ttft"] is not None for r in result["requests"] if r["status"] == "ok")
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"] < 5


def test_the_command_prints_the_table_writes_json_and_fails_when_anything_was_lost(tmp_path: Path):
    with socket.socket() as sock:  # a port nothing listens on: every request refused
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-m", "mlafleet.cli", "loadgen", f"http://127.0.0.1:{closed}",
                           "--rate", "10", "--duration", "0.3", "--json", str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    head, row = done.stdout.split("\n")[:2]
    assert head.split() == ["sent", "ok", "failed", "truncated", "TTFT", "p50", "s", "TTFT", "p99", "s", "ok", "req/s"]
    assert row.split()[:4] == ["3", "0", "3", "0"]
    data = json.loads(out.read_text())
    assert (data["sent"], data["failed"]) == (3, 3) and "Connection refused" in data["requests"][0]["error"]
    server = StandInVllm(tokens=3, token_delay=0.0)
    try:
        done = subprocess.run([sys.executable, "-m", "mlafleet.cli", "loadgen", f"http://127.0.0.1:{server.port}",
                               "--rate", "10", "--duration", "0.3", "--max-tokens", "3"],
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        server.stop()
    assert done.returncode == 0 and done.stdout.split("\n")[1].split()[:4] == ["3", "3", "0", "0"], done.stdout


def test_arrivals_stop_once_the_until_file_exists(tmp_path: Path):
    stop = tmp_path / "stop"
    server = StandInVllm(tokens=3, token_delay=0.0)
    timer = threading.Timer(0.5, stop.touch)
    try:
        timer.start()
        result = loadgen.run(f"http://127.0.0.1:{server.port}/v1/completions", rate=10, duration=60, max_tokens=3,
                             until=str(stop))
    finally:
        timer.cancel()
        server.stop()
    # about 5 arrivals in the half second, not 600; each of them ran to its end
    assert 3 <= result["sent"] <= 8 and result["ok"] == result["sent"], result["sent"]
    assert result["seconds"] < 5
    assert abs(result["started_at"] - (time.time() - result["seconds"])) < 5  # where its request starts count from
