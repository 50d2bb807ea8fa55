"""The serving-group model (plugins/filter/serving_groups.py): from what each host of a play says to
each group's head, members in rank order and layout, each member's view, and every reason the
play cannot serve a group, naming the group, the hosts and the numbers. Plain data in, plain
data out: preflight's tasks/group.yml feeds it (its real runs are in test_serving_groups_play.py)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "plugins" / "filter" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sg = _load("serving_groups")
pp = _load("preflight_parallel")

PRO = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
GB10 = "NVIDIA GB10"
SERVER = {"vllm_server_model": "/opt/mlafleet/models/glm-5", "vllm_server_served_model_name": "glm-5",
          "vllm_server_hf_config_path": "", "vllm_server_tokenizer": "", "vllm_server_args": []}


def host(group: str = "", *, gpus: int = 4, gpu: str = PRO, address: str = "", args: list[str] | None = None,
         **over) -> dict:
    """What preflight's group.yml collects on one host (the values it gives when nothing is set)."""
    server = {**SERVER, "vllm_server_args": list(args or [])}
    info = {"group": group, "head": "", "launch": "native", "tensor": None, "pipeline": None, "master_addr": "",
            "master_port": None, "ray_port": None, "address": address, "parallel": pp.parallel_sizes(args or []),
            "server": server, "release": "0.32.0-5f268df039", "patch": "a" * 64, "weights": "b" * 64,
            "gpus": [gpu] * gpus, "slots": gpus, "heads": 64, "heads_from": "controller:/models/glm-5/config.json",
            "lock": "vllm-0.32.0.txt", "ray_pinned": False}
    info.update(over)
    return info


def pro_boxes() -> tuple[dict, dict]:
    """Two 4-GPU RTX PRO 6000 boxes at TP 4 x PP 2 beside a single host, as in inventory/prod.example."""
    layout = {"tensor": 4, "pipeline": 2}
    hosts = {"pro-a": host("pro", address="10.0.1.11", **layout), "pro-b": host("pro", address="10.0.1.12", **layout),
             "single": host("", gpus=8, args=["--tensor-parallel-size=8"])}
    groups = {"all": list(hosts), "pro": ["pro-a", "pro-b"], "fleet": ["single"]}
    return hosts, groups


def sparks() -> tuple[dict, dict]:
    """Four DGX Sparks (one GB10 each) at TP 4, the head named, the cluster network's address given."""
    names = [f"spark-0{i}" for i in range(1, 5)]
    hosts = {n: host("sparks", gpus=1, gpu=GB10, address=f"192.168.1.{10 + i}", tensor=4, head="spark-02",
                     master_addr="192.168.100.12") for i, n in enumerate(names)}
    return hosts, {"all": names, "sparks": names}


def run(hosts: dict, groups: dict, play: list[str] | None = None) -> dict:
    return sg.serving_groups(copy.deepcopy(hosts), groups, play)


def reasons(out: dict, name: str) -> str:
    return " | ".join(out["problems"].get(name, []))


def test_two_pro_boxes_form_one_group_and_the_single_host_stays_single():
    hosts, groups = pro_boxes()
    out = run(hosts, groups)
    assert out["problems"] == {}
    assert out["groups"] == {"pro": {
        "name": "pro", "head": "pro-a", "members": ["pro-a", "pro-b"], "workers": ["pro-b"], "nnodes": 2,
        "master_addr": "10.0.1.11", "master_port": 29501, "ray_port": 6379, "launch": "native",
        "tensor": 4, "pipeline": 2, "gpus_per_member": 4, "ok": True}}
    assert out["hosts"]["pro-a"]["rank"] == 0 and out["hosts"]["pro-a"]["is_head"] is True
    assert out["hosts"]["pro-a"]["role"] == "head" and out["hosts"]["pro-a"]["group"] == "pro"
    assert out["hosts"]["pro-b"]["rank"] == 1 and out["hosts"]["pro-b"]["role"] == "worker"
    assert "single" not in out["hosts"]  # a host in no group has no view: it behaves as before


def test_sparks_rank_the_named_head_first_then_inventory_order():
    hosts, groups = sparks()
    out = run(hosts, groups)
    assert out["problems"] == {}
    group = out["groups"]["sparks"]
    assert group["members"] == ["spark-02", "spark-01", "spark-03", "spark-04"]
    assert (group["head"], group["master_addr"], group["tensor"], group["pipeline"]) == ("spark-02", "192.168.100.12", 4, 1)
    assert [out["hosts"][h]["rank"] for h in ("spark-01", "spark-02", "spark-03", "spark-04")] == [1, 0, 2, 3]


def test_the_layout_comes_from_the_server_arguments_when_the_group_sets_none():
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name] = host("pro", address="10.0.1.1", args=["--tensor-parallel-size=4", "-pp", "2"])
    out = run(hosts, groups)
    assert out["problems"] == {}
    assert (out["groups"]["pro"]["tensor"], out["groups"]["pro"]["pipeline"]) == (4, 2)


def test_a_layout_that_does_not_fill_the_members_gpus_is_refused_with_the_numbers():
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name]["pipeline"] = 1
    out = run(hosts, groups)
    want = ("serving group pro: tensor parallel 4 x pipeline parallel 1 = 4 GPUs, but 2 members x 4 GPUs = 8 "
            "(pro-a, pro-b): they must be equal")
    assert out["problems"] == {"pro-a": [want], "pro-b": [want]}
    assert out["groups"]["pro"]["ok"] is False


def test_arguments_and_group_variables_that_disagree_are_refused():
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name].update(parallel=pp.parallel_sizes(["--tensor-parallel-size=8"]),
                           server={**SERVER, "vllm_server_args": ["--tensor-parallel-size=8"]})
    out = run(hosts, groups)
    assert ("serving group pro: vllm_server_args say --tensor-parallel-size 8, "
            "mlafleet_serving_group_tensor_parallel says 4") in reasons(out, "pro-a")


def test_heads_that_tensor_parallel_cannot_split_are_refused_naming_the_config():
    names = ["a", "b", "c"]
    hosts = {n: host("three", gpus=1, address="10.0.0.1", tensor=3) for n in names}
    out = run(hosts, {"three": names})
    assert reasons(out, "b") == ("serving group three: tensor parallel 3 does not divide the model's 64 attention "
                                 "heads (controller:/models/glm-5/config.json)")
    hosts = {n: host("three", gpus=1, address="10.0.0.1", tensor=3, heads=None) for n in names}
    assert run(hosts, {"three": names})["problems"] == {}  # no readable config: not checked


@pytest.mark.parametrize("key, value, label", [
    ("release", "0.32.0-0000000000", "release"),
    ("patch", "c" * 64, "patch set manifest (sha256)"),
    ("weights", "none (/srv/manifest.json not found)", "weights manifest (sha256)"),
])
def test_members_must_resolve_to_what_their_head_resolves_to(key, value, label):
    hosts, groups = pro_boxes()
    hosts["pro-b"][key] = value
    out = run(hosts, groups)
    want = f"serving group pro: pro-b resolves to {label} {value!r}, the head pro-a to {hosts['pro-a'][key]!r}"
    assert out["problems"] == {"pro-a": [want], "pro-b": [want]}


def test_members_must_run_the_same_server_command():
    hosts, groups = pro_boxes()
    hosts["pro-b"]["server"] = {**SERVER, "vllm_server_args": ["--max-model-len=4096"]}
    out = run(hosts, groups)
    assert reasons(out, "pro-a") == ("serving group pro: vllm_server_args is ['--max-model-len=4096'] on pro-b but [] "
                                     "on the head pro-a: every member runs the same server command")


@pytest.mark.parametrize("change, shown", [
    ({"gpus": [PRO] * 2, "slots": 2}, f"pro-b has 2 GPUs ({PRO}), the head pro-a has 4 GPUs ({PRO})"),
    ({"gpus": ["NVIDIA H200"] * 4}, f"pro-b has 4 GPUs (NVIDIA H200), the head pro-a has 4 GPUs ({PRO})"),
])
def test_members_need_the_same_gpu_model_and_count(change, shown):
    hosts, groups = pro_boxes()
    hosts["pro-b"].update(change)
    assert (f"serving group pro: {shown}: every member needs the same GPU model and count"
            in reasons(run(hosts, groups), "pro-b"))


def test_a_limit_that_cuts_a_group_is_refused_naming_the_missing_members():
    hosts, groups = sparks()
    play = ["spark-01", "spark-03"]
    out = run({h: hosts[h] for h in play}, groups, play)
    want = ("serving group sparks: this play leaves out spark-02, spark-04 (of spark-01, spark-02, spark-03, spark-04): "
            "a --limit must take a serving group whole (e.g. --limit sparks)")
    assert want in out["problems"]["spark-01"] and want in out["problems"]["spark-03"]
    # a limit that takes only single hosts leaves every group alone
    hosts, groups = pro_boxes()
    assert run({"single": hosts["single"]}, groups, ["single"]) == {"groups": {}, "hosts": {}, "problems": {}}


def test_group_variables_set_differently_on_one_member_are_refused():
    hosts, groups = pro_boxes()
    hosts["pro-b"]["master_port"] = 29600
    assert ("serving group pro: mlafleet_serving_group_master_port is 29600 on pro-b but None on the head pro-a: "
            "set it once, in the group's variables") in reasons(run(hosts, groups), "pro-a")


def test_group_names_that_are_not_inventory_groups_or_not_the_hosts_own_are_refused():
    hosts, groups = pro_boxes()
    hosts["single"]["group"] = "pr0"
    assert reasons(run(hosts, groups), "single") == (
        "mlafleet_serving_group names 'pr0', which is not an inventory group (named by single): a serving group is "
        "the inventory group whose variables name it")
    hosts, groups = pro_boxes()
    hosts["single"]["group"] = "pro"  # names the group without being in it
    assert "serving group pro: single names it but is not in inventory group pro" in reasons(run(hosts, groups), "single")
    hosts, groups = pro_boxes()
    groups["pro"].append("single")  # in the group, but its own variables say it is a single host
    out = run(hosts, groups)
    assert ("serving group pro: member single names no serving group (mlafleet_serving_group is empty): "
            "a host serves in one group only") in reasons(out, "pro-a")


def test_a_head_that_is_no_member_and_a_group_of_one_are_refused():
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name]["head"] = "single"
    assert ("serving group pro: mlafleet_serving_group_head 'single' is not a member (members: pro-a, pro-b)"
            in reasons(run(hosts, groups), "pro-b"))
    hosts, groups = pro_boxes()
    groups["pro"] = ["pro-a"]
    del hosts["pro-b"]
    assert ("serving group pro has one member (pro-a): a group spans at least two hosts"
            in reasons(run(hosts, groups), "pro-a"))


@pytest.mark.parametrize("change, want", [
    ({"launch": "mpi"}, "mlafleet_serving_group_launch is 'mpi', not one of native, ray"),
    ({"master_port": 70000}, "mlafleet_serving_group_master_port 70000 is not a port (1-65535)"),
    ({"master_port": "x"}, "mlafleet_serving_group_master_port 'x' is not a port (1-65535)"),
    ({"launch": "ray", "ray_port": 29501, "ray_pinned": True}, "the master port and the Ray port are both 29501"),
    ({"launch": "ray"}, "launch ray runs Ray from the release, and its lock file vllm-0.32.0.txt pins no ray "
                        "(ray==<version>): pin Ray in the release line's lock, or launch native"),
    ({"tensor": "four"}, "mlafleet_serving_group_tensor_parallel 'four' is not a positive integer"),
    ({"address": ""}, "no master address: the head pro-a has no default IPv4 address; set mlafleet_serving_group_master_addr"),
    ({"server": {**SERVER, "vllm_server_args": ["--distributed-executor-backend=uni"]}},
     "vllm_server_args say --distributed-executor-backend uni, but a group launched native runs the mp executor"),
    ({"launch": "ray", "ray_pinned": True, "server": {**SERVER, "vllm_server_args": ["--distributed-executor-backend", "mp"]}},
     "vllm_server_args say --distributed-executor-backend mp, but a group launched ray runs the ray executor"),
])
def test_bad_group_settings_are_refused(change, want):
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name].update(change)
    assert f"serving group pro: {want}" in reasons(run(hosts, groups), "pro-a")


def test_ray_and_explicit_ports_and_address_reach_every_view():
    hosts, groups = pro_boxes()
    for name in ("pro-a", "pro-b"):
        hosts[name].update(launch="ray", master_port="29555", ray_port=6380, master_addr="10.9.0.1", ray_pinned=True)
    out = run(hosts, groups)
    assert out["problems"] == {}
    view = out["hosts"]["pro-b"]
    assert (view["launch"], view["master_port"], view["ray_port"], view["master_addr"]) == ("ray", 29555, 6380, "10.9.0.1")


def test_two_groups_and_single_hosts_in_one_inventory():
    pro, pro_groups = pro_boxes()
    spark, spark_groups = sparks()
    hosts = {**pro, **spark}
    groups = {**pro_groups, **spark_groups, "all": list(hosts)}
    out = run(hosts, groups)
    assert out["problems"] == {}
    assert sorted(out["groups"]) == ["pro", "sparks"] and sorted(out["hosts"]) == sorted(set(hosts) - {"single"})
    # one broken group does not mark the other
    hosts["spark-03"]["release"] = "other"
    out = run(hosts, groups)
    assert out["groups"]["sparks"]["ok"] is False and out["groups"]["pro"]["ok"] is True
    assert set(out["problems"]) == {f"spark-0{i}" for i in range(1, 5)}


def test_cpu_lab_hosts_count_one_worker_each():
    names = ["lab-a", "lab-b"]
    hosts = {n: host("lab", gpus=0, address="172.18.0.2", tensor=2) for n in names}
    for n in names:
        hosts[n]["slots"] = 1  # no GPU and none required: one CPU worker (preflight's rule)
    out = run(hosts, {"lab": names})
    assert out["problems"] == {} and out["groups"]["lab"]["gpus_per_member"] == 1


def test_the_production_example_inventory_describes_two_valid_groups_beside_single_hosts():
    """inventory/prod.example as Ansible reads it (group_vars merged), each host's GPUs as the
    hardware would report them (SIMULATED: no such GPUs here): 4 x RTX PRO 6000 per pro_pair box,
    one GB10 per Spark, 8 GPUs on the single hosts."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(REPO / "inventory" / "prod.example")])
    variables = VariableManager(loader=loader, inventory=inventory)
    gpus = {"pro_pair": (4, PRO), "sparks": (1, GB10)}
    hosts = {}
    for h in inventory.get_hosts():
        v = variables.get_vars(host=h)
        name = v.get("mlafleet_serving_group", "")
        count, model = gpus.get(name, (8, PRO))
        args = v.get("vllm_server_args", [])
        hosts[h.name] = host(name, gpus=count, gpu=model, args=args, address=v["ansible_host"],
                             head=v.get("mlafleet_serving_group_head", ""),
                             tensor=v.get("mlafleet_serving_group_tensor_parallel"),
                             pipeline=v.get("mlafleet_serving_group_pipeline_parallel"),
                             master_addr=v.get("mlafleet_serving_group_master_addr", ""),
                             release=v.get("vllm_install_version"))
    groups = {g: [h.name for h in inventory.groups[g].get_hosts()] for g in inventory.groups}
    out = run(hosts, groups)
    assert out["problems"] == {}
    assert {n: (g["head"], g["members"], g["tensor"], g["pipeline"], g["master_addr"]) for n, g in out["groups"].items()} == {
        "pro_pair": ("pro-01", ["pro-01", "pro-02"], 4, 2, "10.0.0.21"),
        "sparks": ("spark-01", ["spark-01", "spark-02", "spark-03", "spark-04"], 4, 1, "192.168.100.31")}
    assert not {"gpu-node-01", "gpu-node-02"} & set(out["hosts"])


# --- rollout batches: mlafleet_serial counts serving groups and single hosts alike -----------------

rb = _load("rollout_batches")


def test_a_canary_group_goes_first_whole_and_the_serial_counts_units():
    hosts = ["spark-1", "spark-2", "solo-1", "spark-3", "solo-2", "solo-3"]
    groups = {"spark-1": "sparks", "spark-2": "sparks", "spark-3": "sparks", "solo-1": ""}
    plan = rb.rollout_batches(hosts, groups, [1, "50%"])
    # 50% of four units (one group, three single hosts) is two units a batch after the canary
    assert plan["batches"] == [["sparks"], ["solo-1", "solo-2"], ["solo-3"]]
    # the group's hosts are consecutive, in the play's order, and its batch holds all three
    assert plan["hosts"] == ["spark-1", "spark-2", "spark-3", "solo-1", "solo-2", "solo-3"]
    assert plan["serial"] == [3, 2, 1]
    # the report's timeline draws each group's members together
    assert plan["groups"] == {"sparks": ["spark-1", "spark-2", "spark-3"]}


def test_a_group_never_splits_across_batches_whatever_the_serial():
    hosts = ["a", "g1", "b", "g2", "c", "h1", "h2"]
    groups = {"g1": "g", "g2": "g", "h1": "h", "h2": "h"}
    for serial in (1, 2, "100%", [1, 2], "30%"):
        plan = rb.rollout_batches(hosts, groups, serial)
        start = 0
        for size in plan["serial"]:
            batch = plan["hosts"][start:start + size]
            start += size
            for members in (["g1", "g2"], ["h1", "h2"]):
                assert set(members) <= set(batch) or not set(members) & set(batch), (serial, plan)
        assert sorted(plan["hosts"]) == sorted(hosts) and start == len(hosts)
    assert rb.rollout_batches(hosts, groups, 2)["batches"] == [["a", "g"], ["b", "c"], ["h"]]
    assert rb.rollout_batches(hosts, groups, "100%")["serial"] == [7]


def test_hosts_without_groups_batch_as_ansible_serial_does():
    plan = rb.rollout_batches(["a", "b", "c", "d", "e"], {}, [1, "25%"])
    assert plan["serial"] == [1, 1, 1, 1, 1]
    assert rb.rollout_batches(["a", "b", "c"], None, None)["serial"] == [3]


@pytest.mark.parametrize("bad", [0, "x", "-1"])
def test_a_serial_that_is_not_a_size_is_refused_by_name(bad):
    with pytest.raises(Exception, match="mlafleet_serial"):
        rb.rollout_batches(["a"], {}, [bad])
