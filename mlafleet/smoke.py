"""Read the smoke test's per-host JSON reports (reports/<run>/<host>.json) and summarise them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def summarize(run_dir: Path) -> list[str]:
    """One line per host report in `run_dir`; raises FileNotFoundError when there is none."""
    reports = sorted(Path(run_dir).glob("*.json"))
    if not reports:
        raise FileNotFoundError(f"no smoke reports in {run_dir}")
    lines = []
    for path in reports:
        r = json.loads(path.read_text())
        comp, chat = r["completion"], r["chat"]
        backend = r.get("attention_backend_log") or "not logged (CPU build)"
        lines.append(f"{r['host']}: release {r.get('release', '?')}: {comp['prompt']!r} -> {comp['text']!r} "
                     f"({comp['tokens']} tokens, {comp['latency_ms']} ms); chat -> {chat['text']!r} "
                     f"({chat['tokens']} tokens, {chat['latency_ms']} ms); /health {r['health_ms']} ms; "
                     f"attention backend: {backend}")
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
