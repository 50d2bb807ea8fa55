#!/usr/bin/python3
"""Fault injection for the engine-stall watchdog on a lab host (molecule/default/tasks/watchdog.yml)
and for the restart after engine death (tasks/drain.yml).

    watchdog-fault.py stall   --base URL --env FILE [--requests N] [--max-tokens M]
    watchdog-fault.py resume
    watchdog-fault.py kill
    watchdog-fault.py prefill --base URL --env FILE --longer-than SECONDS

stall: starts N long completions in a detached process, waits until vLLM's /metrics reports
requests running, then SIGSTOPs vllm.service's engine-core process (VLLM::EngineCore): the API
server stays up. Prints JSON: the stopped pid, when (epoch seconds), /health's status and the
running requests and generated tokens /metrics shows a moment later.
resume: SIGCONTs every stopped engine-core process of vllm.service (--unit).
kill: SIGKILLs vllm.service's engine-core process (the API server stays, then exits by itself).
prefill: sends one burst of 1000-token prompts with max_tokens 1, sized so that the last request
waits longer than --longer-than seconds for its first (only) token: a prefill-heavy load whose
requests take longer than the watchdog's window. Prints JSON: the burst size and latencies.
Standard library only; the API key comes from the server's environment file (VLLM_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

UNIT = "vllm.service"
TITLE = "VLLM::EngineCore"


def api_key(env_file: str) -> str:
    try:
        with open(env_file, encoding="utf-8") as handle:
            for line in handle:
                key, sep, value = line.strip().partition("=")
                if sep and key == "VLLM_API_KEY":
                    return value
    except OSError:
        pass
    return ""


def request(base: str, path: str, body: dict | None = None, key: str = "", timeout: float = 600) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, data=data, headers=headers),
                                    timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(base: str, name: str) -> float:
    _, text = request(base, "/metrics", timeout=10)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name + "{"))


def engine_cores(unit: str, state: str | None = None) -> list[int]:
    """The unit's engine-core processes (by their process title and cgroup)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
                cgroup = f.read()
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                proc_state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if title.startswith(TITLE) and unit in cgroup and (state is None or proc_state == state):
            found.append(int(pid))
    return found


def load(base: str, key: str, requests: int, max_tokens: int) -> None:
    """The long completions, each in a thread (run in the detached child)."""
    body = {"model": os.environ["FAULT_MODEL"], "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    threads = [threading.Thread(target=request, args=(base, "/v1/completions", body, key), daemon=True)
               for _ in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def stall(args: argparse.Namespace) -> dict:
    key = api_key(args.env)
    _, models = request(args.base, "/v1/models", key=key, timeout=30)
    env = {**os.environ, "FAULT_MODEL": json.loads(models)["data"][0]["id"]}
    subprocess.Popen([sys.executable, __file__, "load", "--base", args.base, "--env", args.env,
                      "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)],
                     env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while metric(args.base, "vllm:num_requests_running") <= 0:
        if time.monotonic() > deadline:
            raise SystemExit("no request ever ran")
        time.sleep(0.02)
    pids = engine_cores(args.unit)
    if len(pids) != 1:
        raise SystemExit(f"expected one {TITLE} process in {args.unit}, found {pids}")
    os.kill(pids[0], signal.SIGSTOP)
    stopped_at = time.time()
    time.sleep(2)
    health, _ = request(args.base, "/health", timeout=10)
    # Outputs the engine sent before it stopped may still be counted by a loaded API server for a
    # few seconds: read the counter until two reads 2 s apart agree (at most 30 s), then report.
    deadline = time.monotonic() + 30
    before = metric(args.base, "vllm:generation_tokens_total")
    while True:
        time.sleep(2)
        later = metric(args.base, "vllm:generation_tokens_total")
        if later == before or time.monotonic() > deadline:
            break
        before = later
    return {"engine_pid": pids[0], "stopped_at": stopped_at, "health": health,
            "running": metric(args.base, "vllm:num_requests_running"),
            "generation_tokens": before, "generation_tokens_later": later}


def resume(args: argparse.Namespace) -> dict:
    pids = engine_cores(args.unit, "T")
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    return {"resumed": pids}


def kill(args: argparse.Namespace) -> dict:
    pids = engine_cores(args.unit)
    if not pids:
        raise SystemExit(f"no {TITLE} process in {args.unit}")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return {"killed": pids}


def prefill(args: argparse.Namespace) -> dict:
    key = api_key(args.env)
    _, models = request(args.base, "/v1/models", key=key, timeout=30)
    model = json.loads(models)["data"][0]["id"]

    def body(i: int) -> dict:  # 1000 distinct token ids (no prefix-cache hits between requests)
        return {"model": model, "prompt": [(i * 7 + k) % 500 + 4 for k in range(1000)], "max_tokens": 1,
                "temperature": 0}

    one = []
    for i in range(5):  # one prefill, measured alone
        start = time.monotonic()
        status, _ = request(args.base, "/v1/completions", body(i), key)
        assert status == 200, status
        one.append(time.monotonic() - start)
    size = min(4000, int(2 * args.longer_than / min(one)) + 1)
    latencies: list[float] = [0.0] * size

    def send(i: int) -> None:
        start = time.monotonic()
        status, _ = request(args.base, "/v1/completions", body(100 + i), key)
        latencies[i] = time.monotonic() - start if status == 200 else -1.0

    threads = [threading.Thread(target=send, args=(i,)) for i in range(size)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"burst": size, "one_prefill_s": round(min(one), 3), "total_s": round(time.monotonic() - start, 1),
            "longest_s": round(max(latencies), 1), "failed": sum(1 for v in latencies if v < 0)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["stall", "resume", "kill", "prefill", "load"])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--unit", default=UNIT, help="the server's systemd unit (its cgroup names it)")
    parser.add_argument("--env", default="/opt/mlafleet/current/server/vllm.env")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--longer-than", type=float, default=10.0)
    args = parser.parse_args()
    if args.command == "load":
        load(args.base, api_key(args.env), args.requests, args.max_tokens)
        return 0
    print(json.dumps({"stall": stall, "resume": resume, "kill": kill, "prefill": prefill}[args.command](args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
