"""`mlafleet status` on a front door (mlafleet/ops/door_status.py): the status script's door part
run against a real HAProxy (Debian 12's 2.6, configured by the front_door role as
tests/test_front_door_role.py does) in front of two STAND-IN vLLM servers (real HTTP servers; no
GPU here): each backend server's status, administrative state, sessions and weight as HAProxy
counts them, in the JSON and in the table; a door whose socket cannot be read is named."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

from test_front_door_role import Door, door, stream  # noqa: F401 - the fixture

from ansible_collections.mlafleet.fleet.plugins.module_utils import haproxy_runtime
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


def test_door_hosts_are_known_from_the_inventory_and_listed_under_the_table_only(tmp_path: Path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    lab1: {ansible_host: 10.0.0.1}\n  children:\n"
                   "    mlafleet_front_door:\n      hosts:\n        door-01: {ansible_host: 10.0.0.9}\n")
    targets = {t.name: t for t in status.inventory_targets([inv])}
    assert (targets["lab1"].front_door, targets["door-01"].front_door) == (False, True)
    # a door group of another name (front_door_group, as the role reads it); a directory of its own
    # (Ansible's group_vars plugin remembers what it found per directory)
    other = tmp_path / "other"
    (other / "group_vars").mkdir(parents=True)
    (other / "group_vars" / "all.yml").write_text("front_door_group: edge\n")
    (other / "hosts.yml").write_text(inv.read_text().replace("mlafleet_front_door", "edge"))
    assert [t.name for t in status.inventory_targets([other / "hosts.yml"]) if t.front_door] == ["door-01"]
    servers = [{"name": "lab1", "status": "UP", "admin": "ready", "scur": 0, "weight": 1, "check_status": "L7OK"}]
    rows = [{"host": "lab1", "reachable": True, "current": "r1", "health": 200, "door": None},
            {"host": "door-01", "reachable": True, "front_door": True, "current": None,
             "door": {"socket": "/run/haproxy/admin.sock", "backend": "vllm", "servers": servers}}]
    table = status.format_table(rows)
    main, _, doors = table.partition("Front door ")
    assert [line.split()[0] for line in main.strip().splitlines()[1:]] == ["lab1"]
    assert doors.startswith("door-01 (/run/haproxy/admin.sock, backend vllm):") and "L7OK" in doors
    # a door that cannot be reached stays in the table, with its error
    rows[1] = {"host": "door-01", "reachable": False, "front_door": True, "error": "NoValidConnectionsError: refused"}
    table = status.format_table(rows)
    assert [line.split()[0] for line in table.strip().splitlines()[1:]] == ["lab1", "door-01"]
    assert "NoValidConnectionsError: refused" in table


def test_a_drained_backend_that_is_down_is_read_as_drained_and_ready_sets_it_back(door: Door):  # noqa: F811
    """A drained server whose health checks fail shows only DOWN in `show stat`: the door's view and
    the module read the administrative state HAProxy keeps (`show servers state`), so `ready` sets it
    back. (Read from the status, it looked ready already: a rollout's ready that came before the
    door's checks saw the restarted server waited its 120 s for UP and left it drained.)"""
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    door.start()
    assert door.ask("set server vllm/b1 state drain").strip() == ""
    door.b1.stop()
    deadline = time.monotonic() + 10
    while not door.servers()[0]["status"].startswith("DOWN") and time.monotonic() < deadline:
        time.sleep(0.1)
    b1 = {s["name"]: s for s in door_part(door.socket)["servers"]}["b1"]
    assert b1["status"].startswith("DOWN") and b1["admin"] == "drain"
    done, results = door.play("b1", "ready", front_door_ready_timeout=1)
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"Set it ready at every door.*\*+\nchanged: \[b1 -> door\]", done.stdout), done.stdout[-3000:]
    assert results["b1"]["ready"]["up"] is False  # still down: nothing answers
    assert haproxy_runtime.admin_states(door.ask("show servers state vllm")) == {"b1": "ready", "b2": "ready"}
