"""The front door role (roles/front_door, docs/front-door.md) for real: haproxy.cfg rendered by the
role's own tasks through ansible-playbook (connection local), checked by the real `haproxy -c`
(Debian 12's HAProxy 2.6: scripts/install-debs haproxy, in the Makefile's TEST_DEBS), then a real
HAProxy (a foreground process on 127.0.0.1 high ports, its runtime API socket in a scratch
directory) in front of two STAND-IN vLLM servers (tests/door_support.py: real HTTP servers; no GPU
here). Drain and ready run through the role's task files, as a rollout calls them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from door_support import StandInVllm

from ansible_collections.mlafleet.fleet.plugins.module_utils import haproxy_runtime

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

PLAY = """
- hosts: {hosts}
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: front_door
        tasks_from: {entry}
    - ansible.builtin.copy:
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}.json"
        content: "{{{{ {{'drain': front_door_drain | default(none), 'ready': front_door_ready | default(none),
                      'view': front_door_view | default(none), 'healthy': front_door_healthy | default(none)}} | to_json }}}}"
        mode: "0644"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Door:
    """Two stand-in servers, the inventory a rollout would have, and the door's scratch directory."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.b1 = StandInVllm("b1", tokens=30, token_delay=0.1)
        self.b2 = StandInVllm("b2", tokens=30, token_delay=0.1)
        self.port, self.prom = free_port(), free_port()
        self.hook = tmp / "hook.sh"
        self.hook.write_text(f'#!/bin/sh\necho "$@" >> {tmp / "hooks.log"}\n')
        self.hook.chmod(0o755)
        self.proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.tmp / "admin.sock"

    def inventory(self, extra_doors: dict | None = None, **extra) -> Path:
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inv = {"all": {
            "vars": {"front_door_config_dir": str(self.tmp), "front_door_socket": str(self.socket),
                     "front_door_port": self.port, "front_door_address": "127.0.0.1",
                     "front_door_prometheus_bind": f"127.0.0.1:{self.prom}", "front_door_log": "stdout format raw",
                     "front_door_health_interval": 0.3, "front_door_completion_interval": 0.5,
                     "front_door_completion_timeout": 2, "front_door_drain_poll": 0.2,
                     "front_door_hooks": {"before_drain": f"{self.hook} before_drain",
                                          "after_ready": f"{self.hook} after_ready"}, **extra},
            "hosts": {"b1": {**local, "vllm_server_host": "127.0.0.1", "vllm_server_port": self.b1.port},
                      "b2": {**local, "vllm_server_host": "127.0.0.1", "vllm_server_port": self.b2.port}},
            "children": {"mlafleet_front_door": {"hosts": {"door": local, **(extra_doors or {})}}}}}
        path = self.tmp / "inventory.yml"
        path.write_text(yaml.safe_dump(inv))
        return path

    def play(self, hosts: str, entry: str, extra_doors: dict | None = None,
             **extra) -> tuple[subprocess.CompletedProcess, dict]:
        play = self.tmp / f"{entry}.yml"
        play.write_text(PLAY.format(hosts=hosts, entry=entry))
        out = self.tmp / "out"
        out.mkdir(exist_ok=True)
        # the report callback (ansible.cfg) records each play as a run named after its entry point
        env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
               "MLAFLEET_REPORT_ROOT": str(self.tmp / "reports")}
        done = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(self.inventory(extra_doors, **extra)), str(play),
                               "-e", json.dumps({"out": str(out), "mlafleet_run": entry})],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False)
        results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
        for p in out.glob("*.json"):
            p.unlink()
        return done, results

    def start(self) -> None:
        log = open(self.tmp / "haproxy.log", "w")
        self.proc = subprocess.Popen(["haproxy", "-f", str(self.tmp / "haproxy.cfg")], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.socket.exists() and all(s["status"].startswith("UP") for s in self.servers()):
                return
            time.sleep(0.1)
        raise AssertionError((self.tmp / "haproxy.log").read_text())

    def ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.socket))
            sock.sendall(command.encode() + b"\n")
            return b"".join(iter(lambda: sock.recv(65536), b"")).decode()

    def servers(self) -> list[dict]:
        return haproxy_runtime.servers_of(self.ask("show stat"), "vllm")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.b1.stop()
        self.b2.stop()


def stream(port: int, tokens: int = 30) -> int:
    """One streamed completion through the door; the HTTP status."""
    body = json.dumps({"model": "model", "prompt": "Hi", "max_tokens": tokens, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture()
def door(tmp_path: Path):
    d = Door(tmp_path)
    yield d
    d.stop()


def test_the_config_passes_haproxy_c_and_a_bad_one_never_replaces_it(door):
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    cfg = (door.tmp / "haproxy.cfg").read_text()
    check = subprocess.run(["haproxy", "-c", "-f", str(door.tmp / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # every serving host is a backend of both the serving and the checking backend, leastconn
    assert f"server b1 127.0.0.1:{door.b1.port}" in cfg and f"server b2 127.0.0.1:{door.b2.port}" in cfg
    assert "balance leastconn" in cfg and "http-check send meth POST uri /v1/completions" in cfg
    # in the inventory's order, every run (a set's order changed with the hash seed: a no-op re-run
    # rewrote the file and reloaded the door)
    assert cfg.index("server b1 ") < cfg.index("server b2 ")
    assert "stats socket {} mode 600 level admin".format(door.socket) in cfg
    # a port clash (the exporter on the public port) is refused before anything is written
    done, _ = door.play("door", "config", front_door_prometheus_bind=f"127.0.0.1:{door.port}")
    assert done.returncode != 0 and f"its port must not be the public port {door.port}" in done.stdout
    # a server twice: HAProxy's own check refuses it, in its words, and the file stays the good one
    twice = [{"name": "b1", "address": "127.0.0.1", "port": door.b1.port, "group": "", "members": ["b1"]}] * 2
    done, _ = door.play("door", "config", front_door_backends=twice)
    assert done.returncode != 0 and "another server named 'b1' was already defined" in done.stdout, done.stdout[-2000:]
    assert (door.tmp / "haproxy.cfg").read_text() == cfg


def test_drain_waits_for_the_running_stream_routes_around_it_and_ready_takes_it_back(door):
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    door.start()
    # a 12 s stream through the door: whichever server carries it is drained (long enough that the
    # drain play, slower on a loaded machine, sets the door to drain while it still runs)
    first = threading.Thread(target=stream, args=(door.port, 120))
    first.start()
    deadline = time.monotonic() + 5
    while door.b1.running + door.b2.running == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    busy, other = (door.b1, door.b2) if door.b1.running else (door.b2, door.b1)
    started = time.monotonic()
    drain = {}
    runner = threading.Thread(target=lambda: drain.update(zip(("done", "out"), door.play(busy.name, "drain"))))
    runner.start()
    deadline = time.monotonic() + 15
    while [s["status"] for s in door.servers() if s["name"] == busy.name] != ["DRAIN"] and time.monotonic() < deadline:
        time.sleep(0.05)
    # set to drain at the door while its stream runs; new requests go to the other server
    assert [s["status"] for s in door.servers() if s["name"] == busy.name] == ["DRAIN"] and busy.running == 1
    before = busy.streams
    assert [stream(door.port, 3) for _ in range(4)] == [200] * 4
    assert busy.streams == before
    runner.join(60)
    first.join(10)
    assert drain["done"].returncode == 0, drain["done"].stdout[-3000:]
    result = drain["out"][busy.name]["drain"]
    # it waited for the running stream (12 s from its start), and nothing runs now
    assert result["idle"] is True and result["timed_out"] is False and result["running"] == 0
    assert float(result["seconds"]) >= 1.0 and time.monotonic() - started >= 4
    assert (door.tmp / "hooks.log").read_text() == f"before_drain 127.0.0.1 {busy.port}\n"
    # the report callback recorded the drain (its span) and the door's session counts (the HTML
    # report draws them: tests/test_report.py)
    recorded = json.loads((door.tmp / "reports" / "drain" / "timeline.json").read_text())["door"]
    (event,) = recorded["events"]
    assert (event["host"], event["event"]) == (busy.name, "drain")
    assert abs(event["end"] - event["start"] - float(result["seconds"])) < 0.01
    assert recorded["samples"] and recorded["samples"][-1][1] >= 5  # the 6 s stream and the 4 short ones

    done, out = door.play(busy.name, "ready")
    assert done.returncode == 0, done.stdout[-3000:]
    assert out[busy.name]["ready"]["up"] is True
    assert [e["event"] for e in json.loads((door.tmp / "reports" / "ready" / "timeline.json").read_text())
            ["door"]["events"]] == ["ready"]
    assert [s["status"] for s in door.servers() if s["name"] == busy.name] == ["UP"]
    before = busy.streams
    threads = [threading.Thread(target=stream, args=(door.port, 10)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert busy.streams > before  # leastconn sends it traffic again
    assert (door.tmp / "hooks.log").read_text().splitlines()[-1] == f"after_ready 127.0.0.1 {busy.port}"


def test_a_server_that_answers_health_but_generates_nothing_is_taken_out_by_the_completion_check(door):
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    door.start()
    door.b2.generates = False  # /health still 200
    deadline = time.monotonic() + 10
    while [s["weight"] for s in door.servers() if s["name"] == "b2"] != [0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {s["name"]: (s["status"], s["weight"]) for s in door.servers()} == {"b1": ("UP", 1), "b2": ("UP", 0)}
    before = door.b1.streams
    assert [stream(door.port, 2) for _ in range(6)] == [200] * 6
    assert door.b1.streams - before == 6
    # the doors' view: b2 does not count as healthy for mlafleet_min_serving
    done, out = door.play("door", "view")
    assert done.returncode == 0, done.stdout[-3000:]
    assert out["door"]["healthy"] == ["b1"]
    assert [s["weight"] for s in out["door"]["view"]["door"] if s["name"] == "b2"] == [0]
    door.b2.generates = True  # its completions pass again: its weight comes back
    deadline = time.monotonic() + 10
    while [s["weight"] for s in door.servers() if s["name"] == "b2"] != [1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [s["weight"] for s in door.servers() if s["name"] == "b2"] == [1]


def test_a_plan_that_leaves_nothing_serving_and_a_door_that_cannot_be_reached_are_refused(door):
    """The rollout's check before anything changes (tasks_from: check, as playbooks/rollout.yml runs it)."""
    done, _ = door.play("door", "config")
    assert done.returncode == 0, done.stdout[-3000:]
    door.start()
    # both in one batch: nothing would serve; one at a time (the canary's plan): one serves throughout
    done, _ = door.play("b1", "check", front_door_plan={"hosts": ["b1", "b2"], "serial": [2]})
    assert done.returncode != 0
    assert ("front door: batch 1 (b1, b2) takes b1, b2 out of the front door; 0 healthy backends would serve "
            "(none), fewer than mlafleet_min_serving 1") in " ".join(done.stdout.split()), done.stdout[-2000:]
    done, _ = door.play("b1", "check", front_door_plan={"hosts": ["b1", "b2"], "serial": [1, 1]})
    assert done.returncode == 0, done.stdout[-3000:]
    done, _ = door.play("b1", "check", front_door_plan={"hosts": ["b1", "b2"], "serial": [1, 1]},
                        mlafleet_min_serving=2)
    assert done.returncode != 0 and "fewer than mlafleet_min_serving 2" in done.stdout, done.stdout[-2000:]
    # a second door nobody answers on: the check fails on it, named, and no backend was touched
    dead = {"door-b": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": free_port(),
                       "ansible_ssh_common_args": "-o ConnectTimeout=3 -o StrictHostKeyChecking=no"}}
    done, _ = door.play("b1", "check", extra_doors=dead, front_door_plan={"hosts": ["b1", "b2"], "serial": [1, 1]})
    assert done.returncode != 0 and "door-b" in done.stdout and "UNREACHABLE" in done.stdout, done.stdout[-2000:]
    assert [(s["name"], s["admin"]) for s in door.servers()] == [("b1", "ready"), ("b2", "ready")]


def test_a_backend_that_refuses_connections_before_its_checks_fail_costs_no_request(door):
    # checks every 30 s: the door still counts b2 UP after its server is gone; each request it sends
    # there is refused at connect and tried again on b1 (retries, option redispatch)
    done, _ = door.play("door", "config", front_door_health_interval=30)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "option redispatch 1" in (door.tmp / "haproxy.cfg").read_text()
    door.start()
    door.b2.stop()
    assert all(s["status"].startswith("UP") for s in door.servers())  # "UP 1/2": going down, still UP
    before = door.b1.streams
    assert [stream(door.port, 2) for _ in range(6)] == [200] * 6
    assert door.b1.streams - before == 6
