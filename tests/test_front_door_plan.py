"""The front door's plan (plugins/filter/front_door.py): which servers are backends (single hosts
and serving groups' heads, never a group's other members), Ansible's batches, and the refusal of
a batch that would leave fewer than mlafleet_min_serving healthy backends. Plain data in and out;
the role renders these backends through Ansible's real hostvars in test_front_door_role.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("front_door", REPO / "plugins" / "filter" / "front_door.py")
fd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fd)

GROUPS = {"pro": ["pro-01", "pro-02"], "all": ["a", "b", "pro-01", "pro-02", "door"]}
HOSTVARS = {
    "a": {"vllm_server_host": "0.0.0.0", "ansible_host": "10.0.0.5"},
    "b": {"vllm_server_host": "10.0.1.6", "vllm_server_port": 8100, "ansible_host": "192.168.0.6"},
    # inventory only (no preflight in this run): the group's first host is its head
    "pro-01": {"mlafleet_serving_group": "pro", "vllm_server_host": "0.0.0.0"},
    "pro-02": {"mlafleet_serving_group": "pro", "vllm_server_host": "0.0.0.0"},
}


def test_backends_are_single_hosts_and_group_heads_with_the_address_the_door_reaches():
    backends = fd.front_door_backends(HOSTVARS, ["a", "b", "pro-01", "pro-02"], GROUPS)
    assert backends == [
        {"name": "a", "address": "10.0.0.5", "port": 8000, "group": "", "members": ["a"]},
        {"name": "b", "address": "10.0.1.6", "port": 8100, "group": "", "members": ["b"]},
        {"name": "pro-01", "address": "pro-01", "port": 8000, "group": "pro", "members": ["pro-01", "pro-02"]}]


def test_a_member_that_is_not_its_head_is_never_a_backend_whoever_is_named_head():
    hostvars = {**HOSTVARS, "pro-01": {**HOSTVARS["pro-01"], "mlafleet_serving_group_head": "pro-02"},
                "pro-02": {**HOSTVARS["pro-02"], "mlafleet_serving_group_head": "pro-02",
                           "front_door_backend_address": "10.9.9.2"}}
    assert [(b["name"], b["address"]) for b in fd.front_door_backends(hostvars, ["pro-01", "pro-02"], GROUPS)] == [
        ("pro-02", "10.9.9.2")]
    # preflight's view, when the run has it, decides (is_head false: not a backend)
    view = {"group": "pro", "head": "pro-02", "members": ["pro-01", "pro-02"]}
    hostvars = {"pro-01": {"preflight_serving_member": {**view, "is_head": False}},
                "pro-02": {"preflight_serving_member": {**view, "is_head": True}}}
    assert [b["name"] for b in fd.front_door_backends(hostvars, ["pro-01", "pro-02"], {})] == ["pro-02"]


def test_batches_follow_ansibles_serial():
    hosts = ["h1", "h2", "h3", "h4", "h5"]
    assert fd.front_door_batches(hosts, [1, "100%"]) == [["h1"], ["h2", "h3", "h4", "h5"]]
    assert fd.front_door_batches(hosts, [1, "40%"]) == [["h1"], ["h2", "h3"], ["h4", "h5"]]
    assert fd.front_door_batches(hosts, 2) == [["h1", "h2"], ["h3", "h4"], ["h5"]]
    assert fd.front_door_batches(hosts, "10%") == [[h] for h in hosts]  # at least one host
    assert fd.front_door_batches(hosts, None) == [hosts]


def test_a_batch_that_leaves_fewer_than_min_serving_is_refused_naming_it():
    backends = fd.front_door_backends(HOSTVARS, ["a", "b", "pro-01", "pro-02"], GROUPS)
    plan = fd.front_door_batches(["a", "b", "pro-01", "pro-02"], [1, "100%"])
    # the canary batch leaves two: fine; the rest takes b and the group (its worker counts as its head)
    # out while a is in batch 1 only: a serves during batch 2
    assert fd.front_door_min_serving(backends, plan, 1) == []
    assert fd.front_door_min_serving(backends, plan, 2) == [
        "batch 2 (b, pro-01, pro-02) takes b, pro-01 out of the front door; 1 healthy backend would serve (a), "
        "fewer than mlafleet_min_serving 2: make the batches smaller (mlafleet_serial) or bring backends back first"]
    # a worker alone in a batch takes its group's backend out
    assert fd.front_door_min_serving(backends, [["pro-02"]], 3) == [
        "batch 1 (pro-02) takes pro-01 out of the front door; 2 healthy backends would serve (a, b), "
        "fewer than mlafleet_min_serving 3: make the batches smaller (mlafleet_serial) or bring backends back first"]


def test_backends_already_out_of_service_count_against_the_plan():
    backends = fd.front_door_backends(HOSTVARS, ["a", "b"], GROUPS)
    # b is down at the door now: rolling a alone would leave nothing serving
    assert fd.front_door_min_serving(backends, [["a"], ["b"]], 1, healthy=["a"]) == [
        "batch 1 (a) takes a out of the front door; 0 healthy backends would serve (none), fewer than "
        "mlafleet_min_serving 1 (not healthy now: b): make the batches smaller (mlafleet_serial) or bring "
        "backends back first"]
    assert fd.front_door_min_serving(backends, [["a"], ["b"]], 1, healthy=["a", "b"]) == []
    # hosts that are not backends (the door itself) take nothing out
    assert fd.front_door_min_serving(backends, [["door"]], 2) == []


def test_a_batch_of_backends_that_serve_nothing_now_loses_nothing():
    backends = fd.front_door_backends(HOSTVARS, ["a", "b"], GROUPS)
    # the first rollout behind a new door (nothing UP yet), and a repair of the one host that is down
    assert fd.front_door_min_serving(backends, [["a"], ["b"]], 1, healthy=[]) == []
    assert fd.front_door_min_serving(backends, [["b"], ["a"]], 1, healthy=["a"]) == []


def test_the_plays_on_vllm_hosts_leave_the_doors_out():
    assert fd.without_doors({"all": ["a", "b"], "ungrouped": ["a", "b"]}) == "all"
    assert fd.without_doors({"all": ["a", "door"], "mlafleet_front_door": ["door"]}) == "all:!mlafleet_front_door"
    # an empty door group (an inventory that declares it for later) leaves nothing out
    assert fd.without_doors({"all": ["a"], "mlafleet_front_door": []}) == "all"
    assert fd.without_doors({"all": ["a", "lb"], "edge": ["lb"]}, "edge") == "all:!edge"


def test_has_front_door_when_the_inventory_has_doors_or_the_operator_has_hooks() -> None:
    assert not fd.has_front_door({"all": ["a"]})
    assert not fd.has_front_door({"all": ["a"], "mlafleet_front_door": []}, "", {})
    assert fd.has_front_door({"all": ["a", "door"], "mlafleet_front_door": ["door"]})
    assert not fd.has_front_door({"all": ["a", "lb"], "edge": ["lb"]})  # a door group of another name...
    assert fd.has_front_door({"all": ["a", "lb"], "edge": ["lb"]}, "edge")  # ...named by front_door_group
    assert fd.has_front_door({"all": ["a"]}, "", {"drain": "/usr/local/bin/lb-drain {host}"})
