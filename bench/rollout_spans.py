#!/usr/bin/env python3
"""Seconds each host spent in a run's rollout plays, from the run's reports/<run>/timeline.json.

    python bench/rollout_spans.py reports/<run> [reports/<run> ...]

Prints a table: run, host, the span of its "Roll out vLLM" play (first segment's start to the last
one's end; a serving group's members side by side), the span of the segments the report callback
marks as the rollback, and the run's whole elapsed time (run.json). Used for docs/performance.md:
a serving group's rollout against a single host's for the same release change, and the time a
group takes to go back after a member failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins.plugin_utils.report import _mark_rollback  # noqa: E402  (the HTML report's own marking)


def spans(run_dir: Path) -> list[tuple[str, str, float, float, float]]:
    timeline = json.loads((run_dir / "timeline.json").read_text())
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    plays = {p["index"]: p["name"] for p in timeline.get("plays", [])}
    rows = []
    for host, segments in sorted(timeline.get("hosts", {}).items()):
        segs = [dict(s) for s in segments]
        _mark_rollback(segs)
        mine = [s for s in segs if plays.get(s["play"], "").startswith("Roll out vLLM")]
        if not mine:
            continue
        back = [s for s in mine if s.get("rollback")]
        rows.append((run_dir.name, host, max(s["end"] for s in mine) - min(s["start"] for s in mine),
                     (max(s["end"] for s in back) - min(s["start"] for s in back)) if back else 0.0,
                     float(run.get("elapsed_s") or 0)))
    return rows


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{'run':<44} {'host':<28} {'rollout s':>9} {'rollback s':>10} {'run s':>6}")
    for arg in argv:
        for run, host, total, back, elapsed in spans(Path(arg)):
            print(f"{run:<44} {host:<28} {total:9.1f} {back:10.1f} {elapsed:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
