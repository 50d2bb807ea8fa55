"""How much the perf gate's medians move when nothing changed: the noise its thresholds must clear.

    python bench/perf_gate_noise.py --port 22231 [--sets 8] [--restart-every 2] [--out noise.json]

Runs the perf gate's own client (installed on the host by the perf_gate role) over SSH against
a host's running vLLM server `--sets` times, each a full gate measurement (`--repeats` runs of
the workload, medians), restarting vllm.service before every `--restart-every`-th set (a new
release always comes with a restart). Every ordered pair of sets (i as the baseline, j as the
new release) gives the worsening the gate would see for each metric although nothing changed;
the report prints, per metric, the within-set spread and the largest and 90th-percentile
worsening over all pairs, and the machine's load average at each set. With `--slow-arg
--max-num-seqs=1` it then restarts the server with that argument added to the current release's server command and measures what a
real regression looks like against the same sets. The workload defaults to the lab's
(files/lab/group_vars/all.yml).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from mlafleet.ops.perfgate import METRICS, normalize_workload, summarize  # noqa: E402

CLIENT = "/usr/local/sbin/mlafleet-perf-bench"
# The server command of the current release (roles/vllm_server keeps it inside the release).
SERVE = "/opt/mlafleet/current/server/serve"


def ssh(args: argparse.Namespace, command: str, timeout: float = 900) -> str:
    cmd = ["ssh", "-p", str(args.port), "-i", args.key, "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{args.host}", command]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise SystemExit(f"ssh {command!r} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    return out.stdout


def restart(args: argparse.Namespace) -> float:
    t0 = time.monotonic()
    ssh(args, "systemctl restart vllm.service && /usr/local/sbin/mlafleet-vllm-wait-ready --timeout=900")
    return time.monotonic() - t0


def measure(args: argparse.Namespace, workload: dict) -> dict:
    load = ssh(args, "cut -d' ' -f1-3 /proc/loadavg").strip()
    out = ssh(args, f"{CLIENT} --base-url=http://127.0.0.1:8000 --model={shlex.quote(args.model)} "
                    f"--workload={shlex.quote(json.dumps(workload))} --repeats={args.repeats}")
    result = json.loads(out)
    result["summary"] = summarize(result["runs"])
    result["loadavg"] = load
    return result


def worsening(base: dict, new: dict, name: str) -> float | None:
    b, n = base["summary"][name]["median"], new["summary"][name]["median"]
    if not b or n is None:
        return None
    change = (n - b) / b * 100
    return -change if METRICS[name][2] == "higher" else change


def pct(values: list[float], q: float) -> float:
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def report(sets: list[dict], slow: list[dict]) -> str:
    lines = ["| metric | medians over the sets | spread within a set (max) | worsening, any pair: p90 / max |"
             + (" slowed server vs every set: min worsening |" if slow else ""),
             "| --- | --- | --- | --- |" + (" --- |" if slow else "")]
    for name, (label, unit, _) in METRICS.items():
        medians = [s["summary"][name]["median"] for s in sets]
        spreads = [s["summary"][name]["spread_pct"] or 0 for s in sets]
        pairs = [w for a, b in itertools.permutations(sets, 2) if (w := worsening(a, b, name)) is not None]
        row = (f"| {label} | {min(medians):.4g}-{max(medians):.4g} {unit} | {max(spreads):.1f}% | "
               f"{pct(pairs, 90):+.1f}% / {max(pairs):+.1f}% |")
        if slow:
            worst = [w for s in slow for b in sets if (w := worsening(b, s, name)) is not None]
            row += f" {min(worst):+.1f}% |"
        lines.append(row)
    loads = ", ".join(s["loadavg"].split()[0] for s in sets)
    lines.append(f"\n{len(sets)} sets of {sets[0]['repeats']} runs; 1-minute load average at each set: {loads}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the host's SSH port")
    parser.add_argument("--key", default=str(REPO / ".lab" / "ssh" / "id_ed25519"))
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--workload", help="JSON (default: perf_gate_workload of files/lab/group_vars/all.yml)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--restart-every", type=int, default=2, help="restart the server before every Nth set (0: never)")
    parser.add_argument("--slow-arg", default="", help="a server argument that slows it, e.g. --max-num-seqs=1")
    parser.add_argument("--slow-sets", type=int, default=2)
    parser.add_argument("--out", help="write every measurement here (JSON)")
    args = parser.parse_args()
    lab = yaml.safe_load((REPO / "files" / "lab" / "group_vars" / "all.yml").read_text())
    workload = normalize_workload(json.loads(args.workload) if args.workload else lab["perf_gate_workload"])
    print(f"workload {workload}, {args.repeats} runs per set", flush=True)
    ssh(args, "/usr/local/sbin/mlafleet-vllm-wait-ready --timeout=900")  # e.g. still restarting
    sets, slow = [], []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for i in range(args.sets):
        if args.restart_every and i and i % args.restart_every == 0:
            print(f"  restart: ready after {restart(args):.0f} s", flush=True)
        sets.append(measure(args, workload))
        s = sets[-1]["summary"]
        print(f"set {i + 1}: {s['output_throughput']['median']:.1f} tok/s, TTFT p99 {s['ttft_p99_ms']['median']:.1f} ms, "
              f"ITL p99 {s['itl_p99_ms']['median']:.1f} ms (load {sets[-1]['loadavg']})", flush=True)
    if args.slow_arg:
        serve = ssh(args, f"cat {SERVE}")
        try:
            ssh(args, f"sed -i 's|--port=|{args.slow_arg} --port=|' {SERVE} && grep -q -- {shlex.quote(args.slow_arg)} {SERVE}")
            print(f"  restart with {args.slow_arg}: ready after {restart(args):.0f} s", flush=True)
            for _ in range(args.slow_sets):
                slow.append(measure(args, workload))
                s = slow[-1]["summary"]
                print(f"slowed: {s['output_throughput']['median']:.1f} tok/s, TTFT p99 {s['ttft_p99_ms']['median']:.1f} ms, "
                      f"ITL p99 {s['itl_p99_ms']['median']:.1f} ms", flush=True)
        finally:
            subprocess.run(["ssh", "-p", str(args.port), "-i", args.key, "-o", "StrictHostKeyChecking=no",
                            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{args.host}",
                            f"cat > {SERVE} && systemctl restart vllm.service"
                            " && /usr/local/sbin/mlafleet-vllm-wait-ready --timeout=900"],
                           input=serve, text=True, check=False)
    text = report(sets, slow)
    print(f"\nmeasured {started}\n{text}")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": workload, "started": started, "sets": sets, "slow": slow},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
