"""Seconds a lab host's vLLM server takes from start to /health 200, with extra arguments.

    docker cp bench/lab_server_start.py <container>:/tmp/ &&
    docker exec <container> python3 /tmp/lab_server_start.py LABEL [VLLM_ARG ...]

Runs inside a lab container (its release's venv and server environment,
/opt/mlafleet/current/server/vllm.env; stop the vllm unit first), on port 8011, with the lab's
server arguments plus the given ones; prints the seconds to /health 200 and vLLM's own engine
init line, then stops the server. EXTRA_ENV="K=V ..." adds environment. Used for
docs/performance.md (issue 38: where a lab server's start goes).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

LAB_ARGS = ["--model=/opt/mlafleet/models/tiny-llama", "--served-model-name=tiny-llama", "--dtype=float32",
            "--enforce-eager", "--distributed-executor-backend=uni", "--max-model-len=1024",
            "--host=127.0.0.1", "--port=8011"]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    with open("/opt/mlafleet/current/server/vllm.env", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value
    for pair in os.environ.get("EXTRA_ENV", "").split():
        key, value = pair.split("=", 1)
        env[key] = value
    return env


def main() -> int:
    label, extra = sys.argv[1], sys.argv[2:]
    log_path = f"/tmp/lab-server-start-{label}.log"
    started = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        server = subprocess.Popen(["/opt/mlafleet/current/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                                   *LAB_ARGS, *extra], env=environment(), stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                print(f"{label}: the server exited ({server.returncode}); see {log_path}")
                return 1
            try:
                urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        print(f"{label}: ready in {time.time() - started:.1f} s")
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                if "init engine" in line:
                    print("   ", line.strip()[-100:])
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
