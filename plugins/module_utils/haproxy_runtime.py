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
    """The administrative state a `show stat` status shows (drain and maint win over health)."""
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
