"""HAProxy's runtime API as the front door reads it (roles/front_door, docs/front-door.md): one
command per connection on its UNIX socket, `show stat` answered as CSV (a `# ` header line). Used by
the mlafleet_front_door module on the door host and, sent as source, by `mlafleet status`'s probe
of a door (mlafleet/ops/door_status.py): standard library only, no names from outside these
functions."""

from __future__ import annotations

import csv
import io
import socket


def ask(path: str, command: str, timeout: float = 10.0) -> str:
    """One runtime API command, its whole answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def admin_of(status: str) -> str:
    """The administrative state a `show stat` status shows (drain and maint win over health; a
    drained server that is DOWN shows only DOWN: admin_states has the state HAProxy keeps)."""
    if status.startswith("MAINT"):
        return "maint"
    if status.startswith("DRAIN"):
        return "drain"
    return "ready"


def servers_of(text: str, backend: str) -> list[dict]:
    """The servers of `backend` in a `show stat` answer."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError(text.strip() or "no answer")
    rows = csv.DictReader(io.StringIO("\n".join([lines[0][2:]] + lines[1:])))
    out = []
    for row in rows:
        if row.get("pxname") != backend or row.get("svname") in ("FRONTEND", "BACKEND"):
            continue
        status = row.get("status") or ""
        out.append({"name": row["svname"], "status": status, "admin": admin_of(status),
                    "scur": int(row.get("scur") or 0), "stot": int(row.get("stot") or 0),
                    "weight": int(row.get("weight") or 0),
                    "check_status": row.get("check_status") or "", "address": row.get("addr") or ""})
    return out


def admin_states(text: str) -> dict:
    """Each server's administrative state, maint, drain or ready, from a `show servers state
    <backend>` answer: its srv_admin_state bits (0x01 forced, 0x02 inherited, 0x04 configured,
    0x20 resolver, 0x40 health-check maintenance; 0x08 forced, 0x10 inherited drain)."""
    names, out = None, {}
    for line in text.splitlines():
        if line.startswith("# "):
            names = line[2:].split()
            continue
        row = dict(zip(names or [], line.split()))
        if not row.get("srv_name") or not row.get("srv_admin_state", "").isdigit():
            continue
        bits = int(row["srv_admin_state"])
        out[row["srv_name"]] = "maint" if bits & 0x67 else "drain" if bits & 0x18 else "ready"
    return out


def read_servers(path: str, backend: str) -> list:
    """The servers of `backend` as `show stat` counts them, each with the administrative state
    HAProxy keeps for it (`show servers state`: also while a drained server is DOWN)."""
    servers = servers_of(ask(path, "show stat"), backend)
    admin = admin_states(ask(path, "show servers state " + backend))
    for server in servers:
        server["admin"] = admin.get(server["name"], server["admin"])
    return servers
