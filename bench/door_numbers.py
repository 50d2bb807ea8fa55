#!/usr/bin/env python3
"""What clients saw through the front door across a rollout, from a lab run's files.

    python bench/door_numbers.py reports/<run> [--load reports/<run>-load.json]

<run> is the prefix of a molecule lines run (reports/<run>-<step>/timeline.json for each step,
reports/<run>-load.json written by `mlafleet loadgen --json`). Prints two tables:

- per step and backend, the seconds it spent draining at the door, out of it (stopped, restarted,
  smoke-tested, gated) and waiting until the door saw it UP again (the report callback's
  `door.events`, as the HTML report draws them);
- the load: sent, ok, failed, truncated, ok requests per second, and TTFT p50/p99 of the ok
  requests split by when they started: while every backend was in the door ("steady") and while
  one was draining or out ("a backend out"), with the load's own start time (`started_at`) and
  each request's offset from it.

Used for docs/performance.md (issue 45's numbers).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlafleet.ops.loadgen import percentile  # noqa: E402  (the load generator's own percentile)
from plugins.plugin_utils.report import _door_spans  # noqa: E402  (the HTML report's own spans)


def door_windows(prefix: Path) -> tuple[list[tuple[str, str, dict[str, float]]], list[tuple[float, float]]]:
    """[(step, host, {drain, down, ready seconds})] and the absolute [start, end] of every time a
    backend was out of the door (its drain's start to its ready's end)."""
    rows, out = [], []
    for timeline_path in sorted(prefix.parent.glob(prefix.name + "-*/timeline.json")):
        step = timeline_path.parent.name[len(prefix.name) + 1:]
        timeline = json.loads(timeline_path.read_text())
        events = (timeline.get("door") or {}).get("events") or []
        for host in sorted({e["host"] for e in events}):
            spans = _door_spans(host, events, 0.0)
            seconds = {kind: sum(s["t1"] - s["t0"] for s in spans if s["kind"] == kind)
                       for kind in ("drain", "down", "ready")}
            rows.append((step, host, seconds))
            if spans:
                out.append((spans[0]["t0"], spans[-1]["t1"]))
    return rows, out


def load_table(load: dict, out: list[tuple[float, float]]) -> list[tuple[str, ...]]:
    requests = load.get("requests") or []
    t0 = load.get("started_at")

    def during(r: dict) -> bool:
        at = (t0 or 0) + r["start"]
        return t0 is not None and any(a <= at <= b for a, b in out)

    table = [("requests", "sent", "ok", "failed", "truncated", "TTFT p50 s", "TTFT p99 s")]
    for name, picked in (("all", requests), ("steady", [r for r in requests if not during(r)]),
                         ("a backend out", [r for r in requests if during(r)])):
        ok = [r for r in picked if r["status"] == "ok"]
        ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
        fmt = (lambda v: "-" if v is None else f"{v:.3f}")
        table.append((name, str(len(picked)), str(len(ok)), str(sum(r["status"] == "failed" for r in picked)),
                      str(sum(r["status"] == "truncated" for r in picked)), fmt(percentile(ttft, 0.5)),
                      fmt(percentile(ttft, 0.99))))
    return table


def show(table: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path, help="reports/<run> (the lines run's id, without a step)")
    parser.add_argument("--load", type=Path, help="the load's JSON (default reports/<run>-load.json)")
    args = parser.parse_args(argv)
    rows, out = door_windows(args.prefix)
    print(show([("step", "backend", "draining s", "out s", "back to UP s")]
               + [(step, host, f"{s['drain']:.1f}", f"{s['down']:.1f}", f"{s['ready']:.1f}")
                  for step, host, s in rows]))
    load_path = args.load or args.prefix.parent / (args.prefix.name + "-load.json")
    if load_path.exists():
        load = json.loads(load_path.read_text())
        print()
        print(show(load_table(load, out)))
        print(f"\nok requests per second over the load's {load['seconds']:.0f} s: {load['ok_per_s']:.3f} "
              f"(offered {load['rate']}/s, {load['max_tokens']} tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
