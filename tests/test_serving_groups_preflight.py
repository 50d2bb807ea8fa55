"""Preflight's serving-group checks (roles/preflight/tasks/group.yml) in real ansible-runner plan runs
on the controller itself: every "host" is a local connection, the cluster network is the loopback
interface, and the probe opens real TCP connections on 127.0.0.1 (a listener of its own on the
head, or whatever already holds the port)."""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from pathlib import Path

import yaml

from mlafleet.ops import runner

LOCKS = Path(__file__).resolve().parent.parent / "requirements" / "releases"

PLAY = """
- hosts: all
  gather_facts: false
  roles:
    - role: preflight
  post_tasks:
    - name: Keep what preflight worked out, for the test
      ansible.builtin.copy:
        dest: "{{ facts_dir }}/{{ inventory_hostname }}.json"
        content: "{{ {'member': preflight_serving_member, 'groups': preflight_serving_groups} | to_json }}"
        mode: "0644"
      check_mode: false
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local(**hostvars) -> dict:
    return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **hostvars}


def group(name: str, port: int, members: list[str], **more) -> dict:
    return {"hosts": {m: local() for m in members},
            "vars": {"mlafleet_serving_group": name, "mlafleet_serving_group_master_addr": "127.0.0.1",
                     "mlafleet_serving_group_master_port": port, "mlafleet_serving_group_tensor_parallel": len(members),
                     **more}}


def plan(tmp_path: Path, children: dict, limit: str | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """One plan run of the preflight role over the inventory; (host -> report row, host -> facts)."""
    inv = tmp_path / "inventory.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"solo": local()}, "children": children}}))
    (tmp_path / "play.yml").write_text(PLAY)
    facts = tmp_path / "facts"
    facts.mkdir(exist_ok=True)
    extravars = {"preflight_require_gpu": False, "preflight_min_free_gb": 0, "preflight_data_dir": str(tmp_path),
                 "preflight_shm_path": str(tmp_path), "preflight_min_shm_mib": 0, "preflight_group_probe_seconds": 3,
                 "facts_dir": str(facts)}
    report = runner.run_playbook("plan", [inv], extravars=extravars, limit=limit, run="sg", out=io.StringIO(),
                                 playbook=str(tmp_path / "play.yml"), runner_root=tmp_path / "runner",
                                 report_root=tmp_path / "reports")
    return ({h["host"]: h for h in report["hosts"]},
            {p.stem: json.loads(p.read_text()) for p in facts.glob("*.json")})


def test_groups_that_reach_their_head_pass_and_a_worker_that_cannot_is_refused(tmp_path: Path) -> None:
    """Three groups of two local hosts beside a single host, in one run:
    duo: nothing holds its port, so the head's probe listens and its worker connects;
    busy: a server (the test's own) already listens on its port, as when the group serves now:
          the worker connects to it;
    blocked: its port is taken on 127.0.0.1 by a socket that accepts nothing: the worker's
          connection is refused and preflight refuses the group, naming the member, the head,
          the address, the port and the interface."""
    ports = {name: free_port() for name in ("duo", "busy", "blocked", "ray")}
    serving = socket.create_server(("127.0.0.1", ports["busy"]))
    accepted: list[str] = []

    def accept() -> None:
        conn, peer = serving.accept()
        accepted.append(peer[0])
        conn.close()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    held = socket.socket()
    held.bind(("127.0.0.1", ports["blocked"]))  # bound, never listening: connections are refused
    try:
        rows, facts = plan(tmp_path, {
            "duo": group("duo", ports["duo"], ["duo-1", "duo-2"]),
            "busy": group("busy", ports["busy"], ["busy-1", "busy-2"]),
            "blocked": group("blocked", ports["blocked"], ["blocked-1", "blocked-2"]),
            # launch ray: the 0.32.0 line's lock pins Ray, the 0.20.2 line's does not
            "ray": group("ray", free_port(), ["ray-1", "ray-2"], mlafleet_serving_group_launch="ray",
                         mlafleet_serving_group_ray_port=ports["ray"], preflight_lock_file=str(LOCKS / "vllm-0.32.0.txt")),
            "rayold": group("rayold", free_port(), ["rayold-1", "rayold-2"], mlafleet_serving_group_launch="ray",
                            preflight_lock_file=str(LOCKS / "vllm-0.20.2.txt")),
        })
    finally:
        held.close()
        serving.close()
    for name in ("solo", "duo-1", "duo-2", "busy-1", "busy-2", "blocked-1", "ray-1", "ray-2"):
        assert rows[name]["status"] == "ok", (name, rows[name]["cause"])
    assert rows["blocked-2"]["status"] == "failed"
    assert (f"member blocked-2 cannot reach the head blocked-1 at 127.0.0.1:{ports['blocked']} "
            f"(from 127.0.0.1 over lo): Connection refused, tried for 3 s") in rows["blocked-2"]["cause"]

    for name in ("rayold-1", "rayold-2"):
        assert ("serving group rayold: launch ray runs Ray from the release, and its lock file vllm-0.20.2.txt pins "
                "no ray (ray==<version>): pin Ray in the release line's lock, or launch native") in rows[name]["cause"]
    # a Ray group's worker proves the master port and the Ray port
    assert sorted(facts["ray-2"]["member"]["probe"]["reached"]) == sorted([facts["ray-2"]["member"]["master_port"], ports["ray"]])

    assert facts["solo"]["member"] == {}
    head, worker = facts["duo-1"]["member"], facts["duo-2"]["member"]
    assert (head["role"], head["rank"], worker["role"], worker["rank"]) == ("head", 0, "worker", 1)
    for view in (head, worker):
        assert (view["host_ip"], view["ifname"], view["master_ip"]) == ("127.0.0.1", "lo", "127.0.0.1")
        assert (view["nnodes"], view["tensor"], view["pipeline"], view["master_port"]) == (2, 2, 1, ports["duo"])
    # the head's own listener saw the worker; the busy head left the port to its server
    assert head["probe"]["ports"] == {str(ports["duo"]): ["127.0.0.1"]}
    assert worker["probe"] == {"problems": [], "reached": [ports["duo"]]}
    assert facts["busy-1"]["member"]["probe"]["ports"][str(ports["busy"])].startswith("in use")
    acceptor.join(5)
    assert accepted == ["127.0.0.1"]
    assert sorted(facts["solo"]["groups"]) == ["blocked", "busy", "duo", "ray", "rayold"]
    assert facts["solo"]["groups"]["duo"]["members"] == ["duo-1", "duo-2"]


def test_a_limit_that_cuts_a_group_and_members_that_disagree_are_refused_before_anything_changes(tmp_path: Path) -> None:
    children = {
        "trio": group("trio", free_port(), ["trio-1", "trio-2", "trio-3"]),
        "pair": group("pair", free_port(), ["pair-1", "pair-2"]),
    }
    children["pair"]["hosts"]["pair-2"]["vllm_server_args"] = ["--max-model-len=4096"]
    rows, _ = plan(tmp_path, children, limit="solo,trio-1,trio-3,pair")
    assert rows["solo"]["status"] == "ok", rows["solo"]["cause"]
    for name in ("trio-1", "trio-3"):
        assert rows[name]["status"] == "failed"
        assert ("serving group trio: this play leaves out trio-2 (of trio-1, trio-2, trio-3): a --limit must take "
                "a serving group whole (e.g. --limit trio)") in rows[name]["cause"]
    for name in ("pair-1", "pair-2"):
        assert ("serving group pair: vllm_server_args is ['--max-model-len=4096'] on pair-2 but [] on the head "
                "pair-1: every member runs the same server command") in rows[name]["cause"]
