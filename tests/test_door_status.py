"""`mlafleet status` on a front door (mlafleet/ops/door_status.py): the status script's door part
run against a real HAProxy (Debian 12's 2.6, configured by the front_door role as
tests/test_front_door_role.py does) in front of two STAND-IN vLLM servers (real HTTP servers; no
GPU here): each backend server's status, administrative state, sessions and weight as HAProxy
counts them, in the JSON and in the table; a door whose socket cannot be read is named."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from test_front_door_role import Door, door, stream  # noqa: F401 - the fixture

from mlafleet.ops import door_status, status


def door_part(socket_path: Path) -> dict:
    """What the status script's door part reports on a host whose door socket is `socket_path`."""
    script = "import json, os, sys\nout = {}\n" + door_status.REMOTE_SNIPPET + "\nprint(json.dumps(out))\n"
    done = subprocess.run(["python3", "-c", script, "/opt/mlafleet", "8000", "/run/vllm/release", "/x/.lock",
                           str(socket_path)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["door"]


def test_the_door_shows_each_backend_as_haproxy_counts_it(door: Door, tmp_path: Path):  # noqa: F811
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    door.start()
    assert door.ask("set server vllm/b1 state drain").strip() == ""
    carried = threading.Thread(target=stream, args=(door.port, 40))  # 4 s, on b2: b1 drains
    carried.start()
    deadline = time.monotonic() + 5
    while door.b2.running == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    view = door_part(door.socket)
    carried.join(30)
    servers = {s["name"]: s for s in view["servers"]}
    assert view["socket"] == str(door.socket) and view["backend"] == "vllm"
    assert set(servers) == {"b1", "b2"}
    assert servers["b1"]["status"] == "DRAIN" and servers["b1"]["admin"] == "drain" and servers["b1"]["scur"] == 0
    assert servers["b2"]["status"].startswith("UP") and servers["b2"]["admin"] == "ready" and servers["b2"]["scur"] == 1
    assert servers["b2"]["address"] == f"127.0.0.1:{door.b2.port}"
    rows = [{"host": "door-01", "reachable": True, "door": view}]
    table = status.format_table(rows)
    block = table.split("Front door door-01 (")[1]
    assert block.startswith(f"{door.socket}, backend vllm):")
    lines = block.splitlines()
    assert lines[1].split() == ["SERVER", "STATUS", "ADMIN", "SESSIONS", "WEIGHT", "CHECK"]
    assert lines[2].split()[:4] == ["b1", "DRAIN", "drain", "0"] and lines[3].split()[:4][2:] == ["ready", "1"]
    assert door_status.door_errors(rows) == []


def test_a_host_without_a_door_has_none_and_an_unreadable_door_is_named(tmp_path: Path):
    assert door_part(tmp_path / "no-such.sock") is None
    plain = tmp_path / "admin.sock"
    plain.write_text("not a socket")
    view = door_part(plain)
    assert view["error"].startswith(f"cannot read HAProxy's runtime API on {plain}: ")
    rows = [{"host": "door-01", "reachable": True, "door": view}, {"host": "lab1", "reachable": True, "door": None}]
    assert door_status.door_errors(rows) == ["door-01"]
    assert f"Front door door-01 ({plain}, backend vllm): cannot read HAProxy's runtime API" in door_status.section(rows)
    assert door_status.section([{"host": "lab1", "door": None}]) == ""
