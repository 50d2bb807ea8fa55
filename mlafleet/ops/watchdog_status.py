"""The engine-stall watchdog's last stall per host or group, for `mlafleet status`.

The watchdog (roles/vllm_watchdog) keeps its state in STATE_FILE on each serving host: the last
event of each kind, the restarts inside its period, whether it refuses restarts now. `mlafleet
status` reads it with the rest of a host's state, in the one script it runs on the host:

- REMOTE_SNIPPET: standard-library Python lines for that script (they expect `json` imported and
  the dict `out`, and set `out["watchdog"]`); place them before the script prints `out`.
- `last_stall(row)`: the summary of a host's row (the dict the script printed): None without a
  watchdog, else {"time", "action", "recovered", "restarts_in_period", "max_restarts",
  "exhausted", "stalled"}.
- `column(row, now)`: the table's LAST STALL cell for a host.
- `group_column(rows, now)`: the same for a serving group (its members' rows): the latest stall
  of any member (the head runs the watchdog; a member that runs one too counts).
"""

from __future__ import annotations

import time
from typing import Any

STATE_FILE = "/var/lib/mlafleet-vllm-watchdog/state.json"

REMOTE_SNIPPET = f'''
try:
    with open({STATE_FILE!r}) as f:
        wd = json.load(f)
    out["watchdog"] = {{k: wd.get(k) for k in ("updated", "last", "restarts", "restarts_exhausted", "stalled",
                                               "recovering_since", "counts", "settings")}}
except FileNotFoundError:
    out["watchdog"] = None
except (OSError, ValueError) as exc:
    out["watchdog"] = {{"error": "unreadable watchdog state (%s)" % exc}}
'''


def last_stall(row: dict[str, Any]) -> dict[str, Any] | None:
    """The last stall a host's watchdog saw, with what came of it (None: no watchdog state)."""
    wd = row.get("watchdog")
    if not isinstance(wd, dict) or "error" in wd:
        return None
    last = wd.get("last") or {}
    stall = last.get("stall")
    settings = wd.get("settings") or {}
    summary: dict[str, Any] = {
        "time": None, "action": None, "recovered": None,
        "restarts_in_period": len(wd.get("restarts") or []), "max_restarts": settings.get("max_restarts"),
        "exhausted": bool(wd.get("restarts_exhausted")), "stalled": wd.get("stalled")}
    if stall:
        summary.update(time=stall.get("time"), action=stall.get("action"))
        after = [e for e in (last.get("recovered"), last.get("not_recovered"), last.get("resumed"))
                 if e and e.get("time", 0) >= stall.get("time", 0)]
        if after:
            first = min(after, key=lambda e: e.get("time", 0))
            summary["recovered"] = {"recovered": f"recovered in {first.get('after_s')} s", "not_recovered": "NOT recovered",
                                    "resumed": "resumed by itself"}[first["event"]]
    return summary


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def column(row: dict[str, Any], now: float | None = None) -> str:
    """e.g. "none", "2h ago: restarted, recovered in 95.0 s (1/3 in 1h)", "5m ago: REFUSED (3/3 in 1h)";
    led by "DOWN 3m ago" while the server it watches stopped answering and has not come back."""
    wd = row.get("watchdog")
    if isinstance(wd, dict) and "error" in wd:
        return wd["error"]
    summary = last_stall(row)
    if summary is None:
        return "no watchdog"
    down = down_since(row)
    if down is not None:
        return f"DOWN {_age((time.time() if now is None else now) - down)} ago; " + _stall_text(summary, now)
    return _stall_text(summary, now)


def _stall_text(summary: dict[str, Any], now: float | None) -> str:
    bound = f"{summary['restarts_in_period']}/{summary['max_restarts']} restarts in the period"
    if summary["time"] is None:
        return "none" + (f" ({bound})" if summary["restarts_in_period"] else "")
    now = time.time() if now is None else now
    action = {"restart": "restarted", "refused": "NOT restarted: restart limit reached",
              "held": "held: a rollout holds the host",
              "group": "NOT restarted: a serving group restarts whole"}.get(summary["action"], str(summary["action"]))
    text = f"{_age(now - summary['time'])} ago: {action}"
    if summary["recovered"]:
        text += f", {summary['recovered']}"
    elif summary["stalled"]:
        text += ", STILL STALLED"
    return f"{text} ({bound})"


def down_since(row: dict[str, Any]) -> float | None:
    """When the watchdog last saw the server stop answering, if it has not answered since."""
    wd = row.get("watchdog")
    last = (wd.get("last") or {}) if isinstance(wd, dict) else {}
    down, up = last.get("down"), last.get("up")
    if down and not down.get("held") and (not up or up.get("time", 0) < down.get("time", 0)):
        return down.get("time")
    return None


def group_column(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """A serving group's cell: a member whose server is down, else the one whose stall is the latest, named."""
    down = [r for r in rows if down_since(r) is not None]
    if down:
        return f"{down[0].get('host', '?')}: {column(down[0], now)}"
    stalled = [(s["time"], r) for r in rows if (s := last_stall(r)) and s["time"] is not None]
    if stalled:
        _, row = max(stalled, key=lambda item: item[0])
        return f"{row.get('host', '?')}: {column(row, now)}"
    watched = [r for r in rows if last_stall(r) is not None]
    return "none" if watched else "no watchdog"
