"""The front door's view for `mlafleet status` (roles/front_door, docs/front-door.md).

On a host whose HAProxy runtime socket exists (a door: `front_door_socket`, default
/run/haproxy/admin.sock), the status script also asks HAProxy `show stat` and reports each server
of the `vllm` backend: its status (UP, DOWN, DRAIN, MAINT, ...), the administrative state mlafleet
sets (ready, drain, maint), the sessions it carries now, its weight (0 while the door's completion
check fails) and the last health check. The reading and parsing are the door module's own
(plugins/module_utils/haproxy_runtime.py: `ask`, `admin_of`, `servers_of`, `admin_states`,
`read_servers`), sent as their source,
so they exist once.

- REMOTE_SNIPPET: appended to status's remote script (its `out`; the socket path is argv[5]).
- section(rows): the lines `mlafleet status` prints under its table, one block a door.
"""

from __future__ import annotations

import inspect
from typing import Any

from ansible_collections.mlafleet.fleet.plugins.module_utils import haproxy_runtime

SOCKET = "/run/haproxy/admin.sock"
BACKEND = "vllm"
# The inventory group of the door hosts (front_door_group's default).
DOOR_GROUP = "mlafleet_front_door"

REMOTE_SNIPPET = "\nimport csv, io, socket\n" + "".join(
    inspect.getsource(f) for f in (haproxy_runtime.ask, haproxy_runtime.admin_of, haproxy_runtime.servers_of,
                                   haproxy_runtime.admin_states, haproxy_runtime.read_servers)) + f'''
door_socket = sys.argv[5] if len(sys.argv) > 5 else {SOCKET!r}
if os.path.exists(door_socket):
    try:
        out["door"] = {{"socket": door_socket, "backend": {BACKEND!r},
                       "servers": read_servers(door_socket, {BACKEND!r})}}
    except (OSError, ValueError) as exc:
        out["door"] = {{"socket": door_socket, "error": "cannot read HAProxy's runtime API on %s: %s" % (door_socket, exc)}}
else:
    out["door"] = None
'''


def section(rows: list[dict[str, Any]]) -> str:
    """Each door's backends as HAProxy sees them now ("" when no host is a door)."""
    blocks = []
    for row in rows:
        door = row.get("door")
        if not door:
            continue
        title = f"Front door {row['host']} ({door.get('socket')}, backend {door.get('backend', BACKEND)}):"
        if "error" in door:
            blocks.append(f"{title} {door['error']}")
            continue
        table = [("SERVER", "STATUS", "ADMIN", "SESSIONS", "WEIGHT", "CHECK")]
        table += [(s["name"], s["status"], s["admin"], str(s["scur"]), str(s["weight"]), s["check_status"] or "-")
                  for s in door.get("servers") or []]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        blocks.append(title + "\n" + "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                                                for r in table))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def door_errors(rows: list[dict[str, Any]]) -> list[str]:
    """Doors whose runtime API could not be read."""
    return [row["host"] for row in rows if isinstance(row.get("door"), dict) and "error" in row["door"]]
