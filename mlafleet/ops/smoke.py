"""Read the smoke test's per-host JSON reports (reports/<run>/<host>.json) and summarise them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def summarize(run_dir: Path) -> list[str]:
    """One line per host report in `run_dir`; raises FileNotFoundError when there is none.

    A run's directory also holds files that are not host reports (run.json, timeline.json,
    perf/, index.html): they are skipped. A host whose batch was rolled back has a report
    without a smoke test of the new release: its line names the cause and where it went back to.
    """
    lines = []
    for path in sorted(Path(run_dir).glob("*.json")):
        r = json.loads(path.read_text())
        if not isinstance(r, dict) or "host" not in r:
            continue  # run.json, timeline.json: the run's, not a host's
        if "completion" not in r:
            back = r.get("rolled_back_to")
            lines.append(f"{r['host']}: release {r.get('release', '?')}: no smoke test passed: {r.get('cause', '?')}"
                         + (f"; rolled back to {back}" if back and str(back).lower() != "none" else "")
                         + (f"; rollback failed: {r['rollback_error']}" if r.get("rollback_error") else ""))
            continue
        comp, chat = r["completion"], r["chat"]
        backend = r.get("attention_backend") or r.get("attention_backend_log") or "not logged"
        if r.get("attention_backend_expected"):
            backend += f" (expected {r['attention_backend_expected']})"
        lines.append(f"{r['host']}: release {r.get('release', '?')}: {comp['prompt']!r} -> {comp['text']!r} "
                     f"({comp['tokens']} tokens, {comp['latency_ms']} ms); chat -> {chat['text']!r} "
                     f"({chat['tokens']} tokens, {chat['latency_ms']} ms); /health {r['health_ms']} ms; "
                     f"attention backend: {backend}")
    if not lines:
        raise FileNotFoundError(f"no smoke reports in {run_dir}")
    return lines


def _cmd(args: argparse.Namespace) -> int:
    try:
        print("\n".join(summarize(Path(args.run_dir))))
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as err:
        print(f"mlafleet smoke-report: {err}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("smoke-report", help="summarise a run's smoke-test reports")
    p.add_argument("run_dir", help="a run's report directory, e.g. reports/demo")
    p.set_defaults(func=_cmd)
