"""The rollout report a person looks at: reports/<run>/index.html, rendered from the run's JSON.

Sources, all in the run's report directory (whichever exist): `run.json` (mlafleet's runner: per
host status and cause), `timeline.json` (the mlafleet_report callback: what ran when on every
host, per play and serial batch), `<host>.json` (the smoke test's report, or the rollback record
of a failed batch) and `perf/<host>.json` (the perf gate's verdict with every repeat). One
self-contained HTML file: inline CSS, plots as inline SVG, no script, no network (its Content
Security Policy forbids any), written 0600 like the rest of the run's directory. `mlafleet report
reports/<run>` renders it again.

An interrupted run (Ctrl-C) shows each host as run.json names it: ok, interrupted at a step with
what it still serves, not reached; its timeline ends where the run was cut.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from .report_dir import write_private

TEMPLATE = Path(__file__).resolve().parent / "templates" / "report.html.j2"
STATUS_COLORS = {"ok": "#3a9a4a", "changed": "#2f6fba", "failed": "#c62828", "unreachable": "#7b1fa2",
                 "rollback": "#e07b00"}
# A backend's time out of the front door: draining, down (restart, smoke test, gate), back to UP.
DOOR_COLORS = {"drain": "#f9a825", "down": "#616161", "ready": "#00897b"}
VERDICT_CLASSES = {"passed": "ok", "baseline": "info", "accepted": "warn", "failed": "bad"}
# Roles whose run on a host marks the start of its batch's rollback (playbooks/rollout.yml).
ROLLBACK_ROLE = "vllm_rollback"


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        return {"error": f"unreadable {path.name}: {exc}"}


def load(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, gathered from the run directory's JSON files."""
    run_dir = Path(run_dir)
    run = _read(run_dir / "run.json")
    timeline = _read(run_dir / "timeline.json") or {}
    names: set[str] = set()
    if run:
        names.update(h["host"] for h in run.get("hosts", []))
    names.update(timeline.get("hosts", {}))
    names.update(timeline.get("stats", {}))
    reports = {p.stem: _read(p) for p in run_dir.glob("*.json") if p.name not in ("run.json", "timeline.json")}
    perf = {p.stem: _read(p) for p in (run_dir / "perf").glob("*.json")}
    names.update(reports)
    names.update(perf)
    if not names:
        raise FileNotFoundError(f"{run_dir} holds no run.json, timeline.json or host reports")
    run_hosts = {h["host"]: h for h in (run or {}).get("hosts", [])}
    plays = timeline.get("plays", [])
    start = timeline.get("started") or min((s["start"] for segs in timeline.get("hosts", {}).values()
                                             for s in segs), default=0)
    group_of = {m: g for g, members in (timeline.get("groups") or {}).items() for m in members}
    hosts = []
    for name in sorted(names):
        segments = [dict(s) for s in timeline.get("hosts", {}).get(name, [])]
        _mark_rollback(segments)
        for s in segments:
            s["t0"], s["t1"] = s["start"] - start, s["end"] - start
            s["play_name"] = plays[s["play"]]["name"] if s["play"] < len(plays) else "?"
            s["batch"] = plays[s["play"]]["batch"] if s["play"] < len(plays) else 0
        report = reports.get(name) or {}
        status, cause = _status(name, run_hosts.get(name), timeline, segments, plays, report)
        batch = _batch(name, plays)
        hosts.append({
            "host": name, "status": status, "cause": cause, "report": report, "perf": perf.get(name),
            "segments": segments, "batch": batch, "group": group_of.get(name) or report.get("serving_group"),
            "release": report.get("rolled_back_to") or (report.get("release") if report.get("ok") else None),
            "rolled_back_to": report.get("rolled_back_to"),
            "changed": (run_hosts.get(name) or {}).get("changed", []),
            "door": _door_spans(name, (timeline.get("door") or {}).get("events") or [], start),
        })
    ended = timeline.get("ended") or max((s["t1"] + start for h in hosts for s in h["segments"]), default=start)
    for play in plays:  # a run cut short (Ctrl-C) never closed its last play
        if play.get("end") is None and play.get("hosts"):
            play["end"] = max(ended, play["start"])
    failed = [h["host"] for h in hosts if h["status"] in ("failed", "unreachable")]
    summary = {
        "command": (run or {}).get("command") or "ansible-playbook",
        "playbook": (run or {}).get("playbook") or timeline.get("playbook", ""),
        "run": (run or {}).get("run") or timeline.get("run") or run_dir.name,
        "release": timeline.get("release") or ((run or {}).get("extravars") or {}).get("mlafleet_release"),
        "check": bool((run or {}).get("check")),
        "exit": _exit_text(run),
        "status": (run or {}).get("status") or ("failed" if failed else "successful"),
        "interrupted_hosts": [h["host"] for h in hosts if h["status"] == "interrupted"],
        "left": ((run or {}).get("interrupted") or {}).get("left") or [],
        "elapsed_s": (run or {}).get("elapsed_s", round(ended - start) if start else None),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)) if start else None,
        "failed_hosts": failed,
    }
    return {"summary": summary, "hosts": hosts, "plays": plays, "duration": max(ended - start, 1e-3),
            "start": start, "run_dir": str(run_dir), "has_run_json": run is not None,
            "door_rate": _door_rate((timeline.get("door") or {}).get("samples") or [], start)}


def _door_spans(name: str, events: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    """A backend's time out of the front door (roles/front_door), in seconds from the run's start:
    draining (no new requests; running ones finish), down (stopped, restarted, smoke-tested and
    gated) and the wait until the door saw it UP again; an open span ends where the next begins."""
    spans, drained = [], None
    for e in sorted((e for e in events if e.get("host") == name), key=lambda e: e["end"]):
        if e["event"] == "drain":
            spans.append({"kind": "drain", "t0": e["start"] - start, "t1": e["end"] - start,
                          "note": "drain ran out of time" if e.get("timed_out") else "drained"})
            drained = e["end"] - start
        elif e["event"] == "ready":
            if drained is not None:
                spans.append({"kind": "down", "t0": drained, "t1": e["start"] - start, "note": "out of the door"})
            spans.append({"kind": "ready", "t0": e["start"] - start, "t1": e["end"] - start,
                          "note": "UP at the door" if e.get("up") else "not UP at the door in time"})
            drained = None
    return spans


def _door_rate(samples: list[list[float]], start: float) -> list[dict[str, float]]:
    """Sessions per second the door(s) took between two readings (the rollout reads them at each
    check, drain and ready): [{t0, t1, rate}] in seconds from the run's start."""
    points = sorted((t - start, n) for t, n in samples)
    return [{"t0": a[0], "t1": b[0], "rate": (b[1] - a[1]) / (b[0] - a[0])}
            for a, b in zip(points, points[1:]) if b[0] - a[0] >= 1 and b[1] >= a[1]]


def _exit_text(run: dict[str, Any] | None) -> str | None:
    """The exit status as the CLI returned it, with ansible-playbook's return code named as such.

    run.json's `rc` is the CLI's exit status and `playbook_rc` ansible-playbook's; a run.json of
    an older mlafleet has only `rc`, which was ansible-playbook's, and is named so.
    """
    if not run or run.get("rc") is None:
        return None
    if "playbook_rc" not in run:
        return f"ansible-playbook rc {run['rc']}"
    text = f"exit status {run['rc']}"
    if run.get("interrupted"):
        return text + f" (interrupted by {run['interrupted'].get('signal', '?')}; ansible-playbook canceled)"
    if run["playbook_rc"] is not None and run["playbook_rc"] != run["rc"]:
        text += f" (ansible-playbook rc {run['playbook_rc']})"
    return text


def _mark_rollback(segments: list[dict[str, Any]]) -> None:
    """Segments from a host's first vllm_rollback run to the end of that play are the rollback."""
    rollback_play = None
    for s in segments:
        if s["role"] == ROLLBACK_ROLE:
            rollback_play = s["play"]
        s["rollback"] = rollback_play is not None and s["play"] == rollback_play


def _batch(name: str, plays: list[dict[str, Any]]) -> str:
    """'<play> batch N' for the last serial play the host ran in."""
    mine = [p for p in plays if name in p.get("hosts", [])]
    if not mine:
        return ""
    last = mine[-1]
    batches = sum(1 for p in plays if p["name"] == last["name"])
    return f"{last['name']}, batch {last['batch']} of {batches}" if batches > 1 else last["name"]


def _status(name: str, run_host: dict[str, Any] | None, timeline: dict[str, Any], segments: list[dict[str, Any]],
            plays: list[dict[str, Any]], report: dict[str, Any]) -> tuple[str, str]:
    """The runner's status and cause when there is a run.json, else from the callback's record."""
    if run_host:
        return run_host.get("status", "?"), run_host.get("cause", "")
    stats = timeline.get("stats", {}).get(name, {})
    failures = [f for s in segments for f in s["failures"]]
    if stats.get("unreachable"):
        status = "unreachable"
    elif stats.get("failures"):
        status = "failed"
    elif plays and not any(name in p.get("hosts", []) for p in plays if p["name"] == plays[-1]["name"]):
        status = "not reached"
    else:
        status = "ok"
    cause = ""
    if status != "ok":
        if report.get("ok") is False and report.get("cause"):
            cause = report["cause"] + (f" (rolled back to {report['rolled_back_to']})"
                                       if report.get("rolled_back_to") else "")
        elif failures:
            cause = f"{failures[0]['task']}: {failures[0]['msg']}"
    return status, cause


# --- plots (inline SVG) -------------------------------------------------------------------

def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def timeline_svg(data: dict[str, Any], width: int = 1100) -> Markup:
    """Gantt chart: one row per host (grouped by batch), one bar per role run, plays as bands; a
    serving group's members sit together under a frame named by the group."""
    first_batch: dict[str, int] = {}  # a group sits at its first batch (a group is whole in one batch)
    for h in data["hosts"]:
        if h.get("group"):
            first_batch[h["group"]] = min(first_batch.get(h["group"], h["batch"]), h["batch"])
    hosts = sorted(data["hosts"], key=lambda h: (first_batch.get(h.get("group"), h["batch"]),
                                                 h.get("group") or h["host"], h["host"]))
    rate = data.get("door_rate") or []
    strip = 46 if rate else 0  # the door's request rate, above the hosts
    label_w, row_h, top = 230, 26, 34 + strip
    plot_w = width - label_w - 10
    height = top + row_h * len(hosts) + 28
    scale = plot_w / data["duration"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="rollout timeline" class="timeline">']
    for i, play in enumerate(data["plays"]):
        if play.get("end") is None or not play.get("hosts"):
            continue
        x0 = label_w + (play["start"] - data["start"]) * scale
        x1 = label_w + (play["end"] - data["start"]) * scale
        shade = "#f3f3f3" if i % 2 else "#e8eef5"
        title = f"{play['name']} (batch {play['batch']}): {', '.join(play['hosts'])}"
        out.append(f'<rect x="{x0:.1f}" y="{top - 8}" width="{max(x1 - x0, 0.5):.1f}" '
                   f'height="{row_h * len(hosts) + 8}" fill="{shade}"><title>{escape(title)}</title></rect>')
        if x1 - x0 > 70:
            text = play["name"] if play["batch"] == 1 else f"{play['name']} #{play['batch']}"
            out.append(f'<text x="{x0 + 3:.1f}" y="{top - 12}" class="play">{escape(text[:int((x1 - x0) / 6)])}</text>')
    if rate:
        peak = max(r["rate"] for r in rate) or 1.0
        base_y = top - 14
        out.append(f'<text x="4" y="{base_y - 12}" class="host">front door, sessions/s</text>'
                   f'<text x="{label_w - 4}" y="{base_y - strip + 24}" class="tick" text-anchor="end">'
                   f'{_num(peak, 2)}</text>')
        for r in rate:
            x0, x1 = label_w + r["t0"] * scale, label_w + r["t1"] * scale
            h = (strip - 20) * r["rate"] / peak
            out.append(f'<rect x="{x0:.1f}" y="{base_y - h:.1f}" width="{max(x1 - x0, 0.5):.1f}" height="{h:.1f}" '
                       f'class="door-rate" fill="#90a4ae"><title>{escape(_num(r["rate"], 2))} sessions/s at the door, '
                       f'+{r["t0"]:.0f} s to +{r["t1"]:.0f} s</title></rect>')
    row = 0
    while row < len(hosts):  # a serving group's rows: one frame, the group's name, its members indented
        group = hosts[row].get("group")
        size = 1
        while group and row + size < len(hosts) and hosts[row + size].get("group") == group:
            size += 1
        if group:
            y = top + row * row_h
            members = ", ".join(h["host"] for h in hosts[row:row + size])
            out.append(f'<rect x="1" y="{y + 1}" width="{width - 2}" height="{row_h * size - 2}" fill="none" '
                       f'class="group" data-group="{escape(group)}" stroke="#5c6bc0" stroke-dasharray="4 2">'
                       f'<title>{escape(f"serving group {group}: {members}")}</title></rect>'
                       f'<text x="4" y="{y + 11}" class="group">group {escape(group)}</text>')
        row += size
    for row, host in enumerate(hosts):
        y = top + row * row_h
        indent = 16 if host.get("group") else 4
        out.append(f'<text x="{indent}" y="{y + row_h * 0.62 + (4 if host.get("group") else 0):.1f}" '
                   f'class="host">{escape(host["host"])}</text>')
        for s in host["segments"]:
            x = label_w + s["t0"] * scale
            w = max((s["t1"] - s["t0"]) * scale, 1.5)
            color = STATUS_COLORS["rollback"] if s["rollback"] and s["status"] in ("ok", "changed") \
                else STATUS_COLORS.get(s["status"], "#888")
            tip = (f"{s['role'] or s['first_task']} ({s['play_name']}, batch {s['batch']}): "
                   f"+{s['t0']:.1f} s for {s['t1'] - s['t0']:.1f} s, {s['tasks']} tasks, {s['changed']} changed"
                   + ("; rollback" if s["rollback"] else "")
                   + "".join(f"; FAILED {f['task']}: {f['msg'][:300]}" for f in s["failures"]))
            out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="{color}" '
                       f'class="seg {s["status"]}"><title>{escape(tip)}</title></rect>')
        for d in host.get("door") or []:  # out of the front door: a band under the host's bars
            x, w = label_w + d["t0"] * scale, max((d["t1"] - d["t0"]) * scale, 1.5)
            out.append(f'<rect x="{x:.1f}" y="{y + row_h - 5}" width="{w:.1f}" height="4" fill="{DOOR_COLORS[d["kind"]]}" '
                       f'class="door-{d["kind"]}"><title>{escape(d["kind"])}: +{d["t0"]:.1f} s for '
                       f'{d["t1"] - d["t0"]:.1f} s ({escape(d["note"])})</title></rect>')
    axis_y = top + row_h * len(hosts) + 4
    out.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" stroke="#666"/>')
    step = _tick_step(data["duration"])
    t = 0.0
    while t <= data["duration"] + 1e-9:
        x = label_w + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#666"/>'
                   f'<text x="{x:.1f}" y="{axis_y + 16}" class="tick">{_clock(t)}</text>')
        t += step
    out.append("</svg>")
    return Markup("".join(out))


def _tick_step(duration: float) -> float:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if duration / step <= 12:
            return float(step)
    return 7200.0


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def metric_svg(metric: dict[str, Any], release: str, baseline_release: str | None) -> Markup:
    """One metric: every repeat as a dot, the median as a bar, the threshold's limit dashed."""
    w, h, pad_l, pad_b, pad_t = 214, 150, 46, 30, 10
    cur = metric["current"] or {}
    base = metric["baseline"] or {}
    columns = [(baseline_release or "baseline", base), (release or "new", cur)] if base else [(release or "new", cur)]
    values = [v for _, c in columns for v in (c.get("values") or [])]
    limit = None
    if base.get("median") and metric.get("threshold_pct") is not None:
        factor = 1 - metric["threshold_pct"] / 100 if metric["better"] == "higher" else 1 + metric["threshold_pct"] / 100
        limit = base["median"] * factor
    top_value = max(values + ([limit] if limit else []) or [1.0]) * 1.12 or 1.0
    plot_h = h - pad_b - pad_t
    col_w = (w - pad_l - 6) / len(columns)

    def y(v: float) -> float:
        return pad_t + plot_h * (1 - v / top_value)

    cls = "regressed" if metric["regressed"] else ""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'class="metric {cls}" role="img" aria-label="{escape(metric["label"])}">',
           f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{h - pad_b}" stroke="#999"/>',
           f'<line x1="{pad_l}" y1="{h - pad_b}" x2="{w - 4}" y2="{h - pad_b}" stroke="#999"/>',
           f'<text x="{pad_l - 4}" y="{pad_t + 8}" class="axis" text-anchor="end">{_num(top_value, 2)}</text>',
           f'<text x="{pad_l - 4}" y="{h - pad_b}" class="axis" text-anchor="end">0</text>']
    for i, (label, col) in enumerate(columns):
        cx = pad_l + col_w * (i + 0.5)
        color = "#777" if (base and i == 0) else ("#c62828" if metric["regressed"] else "#2f6fba")
        if col.get("median") is not None:
            out.append(f'<line x1="{cx - col_w * 0.3:.1f}" y1="{y(col["median"]):.1f}" x2="{cx + col_w * 0.3:.1f}" '
                       f'y2="{y(col["median"]):.1f}" stroke="{color}" stroke-width="3">'
                       f'<title>median {escape(_num(col["median"]))} {escape(metric["unit"])}</title></line>')
        n = len(col.get("values") or [])
        for j, v in enumerate(col.get("values") or []):
            dx = (j - (n - 1) / 2) * 7
            out.append(f'<circle cx="{cx + dx:.1f}" cy="{y(v):.1f}" r="3.2" fill="{color}" fill-opacity="0.7">'
                       f'<title>run {j + 1}: {escape(_num(v))} {escape(metric["unit"])}</title></circle>')
        out.append(f'<text x="{cx:.1f}" y="{h - pad_b + 13}" class="axis" text-anchor="middle">'
                   f'{escape(label[:24])}</text>')
    if limit is not None:
        out.append(f'<line x1="{pad_l}" y1="{y(limit):.1f}" x2="{w - 4}" y2="{y(limit):.1f}" stroke="#c62828" '
                   f'stroke-dasharray="4 3"><title>limit {escape(_num(limit))} {escape(metric["unit"])} '
                   f'({metric["threshold_pct"]:g}% of the baseline)</title></line>')
    out.append(f'<text x="{pad_l}" y="{h - 3}" class="axis">{escape(metric["unit"])}</text></svg>')
    return Markup("".join(out))


# --- rendering ----------------------------------------------------------------------------

def render_html(data: dict[str, Any]) -> str:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(loader=FileSystemLoader(str(TEMPLATE.parent)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _num
    env.filters["clock"] = _clock
    env.globals.update(metric_svg=metric_svg, colors=STATUS_COLORS, verdict_class=VERDICT_CLASSES)
    return env.get_template(TEMPLATE.name).render(data=data, timeline=timeline_svg(data),
                                                   generated=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))


def render(run_dir: Path) -> Path:
    """Write <run_dir>/index.html from the JSON in it; returns its path."""
    run_dir = Path(run_dir)
    html = render_html(load(run_dir))
    out = run_dir / "index.html"
    write_private(out, html)
    return out


def render_quietly(run_dir: Path) -> str:
    """render(), for the end of a run: the path, or why there is no report (never raises)."""
    try:
        return str(render(run_dir))
    except Exception as exc:  # a report must never turn a finished run into a crash  # noqa: BLE001
        return f"not written ({type(exc).__name__}: {exc})"


def _cmd(args: argparse.Namespace) -> int:
    try:
        print(render(Path(args.run_dir)))
    except (FileNotFoundError, KeyError, TypeError) as err:
        print(f"mlafleet report: {err}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="render a run's HTML report (reports/<run>/index.html) from its JSON")
    p.add_argument("run_dir", help="a run's report directory, e.g. reports/<run>")
    p.set_defaults(func=_cmd)
