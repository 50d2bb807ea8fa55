"""Filter `serving_groups`: the serving groups of a play (one vLLM server spanning several hosts),
worked out on the controller from what each host says, with every reason the play cannot serve
them as they stand.

A serving group is an inventory group whose variables name it (`mlafleet_serving_group: <its own
name>`). Its head (node rank 0, the API server) is `mlafleet_serving_group_head` or else the
group's first host; the others are workers, ranked in inventory order. Hosts that name no group
are single hosts and get no view: they behave exactly as before groups existed.

Input, one entry per host of the play (preflight's tasks/group.yml collects it on each host):
  group, head, launch, tensor, pipeline, master_addr, master_port, ray_port (the mlafleet_serving_group*
  variables; None or "" when unset), address (the host's default IPv4 address: the head's is the
  master address unless one is named), parallel (what vllm_server_args say: preflight_parallel_sizes),
  server (model, arguments and names: the same command on every member), release, patch, weights
  (release id and checksums of the patch set's and the weights' manifests), gpus (GPU model names),
  slots (GPUs the server may use there: the GPU count, 1 on a CPU lab host), heads and heads_from
  (the model's attention heads where config.json was readable), lock and ray_pinned (the release
  line's lock file, and whether it pins ray: launch ray needs it).

Output: {groups: {name: layout}, hosts: {host: its view}, problems: {host: [reasons]}}. A reason
names the group, the hosts and the numbers; every member of a group carries its group's reasons.
"""

from __future__ import annotations

from typing import Any

LAUNCHES = ("native", "ray")
DEFAULT_MASTER_PORT = 29501  # vLLM's own default (ParallelConfig.master_port)
DEFAULT_RAY_PORT = 6379  # Ray's default GCS port (ray start --head)

# Values every member must share with the head, and how a reason names them.
AGREE = {
    "head": "mlafleet_serving_group_head",
    "launch": "mlafleet_serving_group_launch",
    "tensor": "mlafleet_serving_group_tensor_parallel",
    "pipeline": "mlafleet_serving_group_pipeline_parallel",
    "master_addr": "mlafleet_serving_group_master_addr",
    "master_port": "mlafleet_serving_group_master_port",
    "ray_port": "mlafleet_serving_group_ray_port",
}
IDENTITY = {
    "release": "release",
    "patch": "patch set manifest (sha256)",
    "weights": "weights manifest (sha256)",
}
# What the server command is made of (input `server`): the same on every member.
SERVER = ("vllm_server_model", "vllm_server_served_model_name", "vllm_server_hf_config_path",
          "vllm_server_tokenizer", "vllm_server_args")


def _unset(value: Any) -> bool:
    return value is None or value == ""


def _int(value: Any) -> int | None:
    """A positive integer from an int or a string of digits, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip()) or None
    return None


def _option_values(args: Any, option: str) -> list[str]:
    """Every value given to `option` in an argument list ("--opt=V", "--opt V" or "--opt", "V")."""
    words = [w for item in (args or []) for w in str(item).split()]
    values = []
    for i, word in enumerate(words):
        name, sep, value = word.partition("=")
        if name == option:
            values.append(value if sep else (words[i + 1] if i + 1 < len(words) else ""))
    return values


def _gpus(info: dict[str, Any]) -> str:
    slots = info.get("slots") or 0
    names = sorted(set(info.get("gpus") or []))
    return f"{slots} GPU{'' if slots == 1 else 's'} ({', '.join(names) if names else 'no GPU: CPU worker'})"


def serving_groups(hosts: dict[str, dict[str, Any]], groups: dict[str, list[str]],
                   play_hosts: list[str] | None = None) -> dict[str, Any]:
    """The play's serving groups, each member's view, and the reasons per host (see the module doc)."""
    hosts = dict(hosts or {})
    play = list(play_hosts) if play_hosts is not None else list(hosts)
    problems: dict[str, list[str]] = {}
    out_groups: dict[str, dict[str, Any]] = {}
    views: dict[str, dict[str, Any]] = {}

    def refuse(who: list[str] | str, reason: str) -> None:
        for host in [who] if isinstance(who, str) else who:
            problems.setdefault(host, [])
            if reason not in problems[host]:
                problems[host].append(reason)

    named: dict[str, list[str]] = {}
    for host in play:
        name = (hosts.get(host) or {}).get("group") or ""
        if name:
            named.setdefault(str(name), []).append(host)

    for name, naming in sorted(named.items()):
        if name not in groups:
            refuse(naming, f"mlafleet_serving_group names {name!r}, which is not an inventory group "
                           f"(named by {', '.join(naming)}): a serving group is the inventory group whose "
                           f"variables name it")
            continue
        inventory = list(dict.fromkeys(groups[name]))
        in_play = [h for h in inventory if h in hosts and h in play]
        strays = [h for h in naming if h not in inventory]
        if strays:
            refuse(strays, f"serving group {name}: {', '.join(strays)} name{'s' if len(strays) == 1 else ''} "
                           f"it but {'is' if len(strays) == 1 else 'are'} not in inventory group {name}")
        others = [h for h in in_play if (hosts[h].get("group") or "") != name]
        for host in others:
            theirs = hosts[host].get("group") or ""
            refuse([host] + in_play, f"serving group {name}: member {host} names "
                   + (f"serving group {theirs!r}" if theirs else "no serving group (mlafleet_serving_group is empty)")
                   + ": a host serves in one group only")
        members_play = [h for h in in_play if h not in others]
        missing = [h for h in inventory if h not in play]
        if missing:
            refuse(members_play, f"serving group {name}: this play leaves out {', '.join(missing)} "
                                 f"(of {', '.join(inventory)}): a --limit must take a serving group whole "
                                 f"(e.g. --limit {name})")
        if len(inventory) < 2:
            refuse(members_play, f"serving group {name} has one member ({', '.join(inventory)}): a group spans "
                                 f"at least two hosts; serve a single host without mlafleet_serving_group")
        if not members_play:
            continue

        # The head: the one named (all members must name the same), else the group's first host.
        first = hosts[members_play[0]]
        head = first.get("head") or inventory[0]
        if head not in inventory:
            refuse(members_play, f"serving group {name}: mlafleet_serving_group_head {head!r} is not a member "
                                 f"(members: {', '.join(inventory)})")
            head = inventory[0]
        ref = head if head in members_play else members_play[0]
        ref_info = hosts[ref]
        ref_name = f"the head {ref}" if ref == head else ref
        for key, label in AGREE.items():
            for host in members_play:
                if host != ref and hosts[host].get(key) != ref_info.get(key):
                    refuse(members_play, f"serving group {name}: {label} is {hosts[host].get(key)!r} on {host} "
                                         f"but {ref_info.get(key)!r} on {ref_name}: set it once, in the group's variables")
        for key, label in IDENTITY.items():
            for host in members_play:
                if host != ref and hosts[host].get(key) != ref_info.get(key):
                    refuse(members_play, f"serving group {name}: {host} resolves to {label} "
                                         f"{hosts[host].get(key)!r}, {ref_name} to {ref_info.get(key)!r}")
        for key in SERVER:
            for host in members_play:
                mine, theirs = (hosts[host].get("server") or {}).get(key), (ref_info.get("server") or {}).get(key)
                if host != ref and mine != theirs:
                    refuse(members_play, f"serving group {name}: {key} is {mine!r} on {host} but {theirs!r} on "
                                         f"{ref_name}: every member runs the same server command")
        for host in members_play:
            info = hosts[host]
            if host != ref and (info.get("slots"), sorted(info.get("gpus") or [])) != (
                    ref_info.get("slots"), sorted(ref_info.get("gpus") or [])):
                refuse(members_play, f"serving group {name}: {host} has {_gpus(info)}, {ref_name} has "
                                     f"{_gpus(ref_info)}: every member needs the same GPU model and count")

        launch = ref_info.get("launch") or "native"
        if launch not in LAUNCHES:
            refuse(members_play, f"serving group {name}: mlafleet_serving_group_launch is {launch!r}, "
                                 f"not one of {', '.join(LAUNCHES)}")
        ports = {}
        for key, default in (("master_port", DEFAULT_MASTER_PORT), ("ray_port", DEFAULT_RAY_PORT)):
            raw = ref_info.get(key)
            port = default if _unset(raw) else _int(raw)
            if port is None or port > 65535:
                refuse(members_play, f"serving group {name}: {AGREE[key]} {raw!r} is not a port (1-65535)")
                port = default
            ports[key] = port
        backends = _option_values((ref_info.get("server") or {}).get("vllm_server_args"), "--distributed-executor-backend")
        wanted = "ray" if launch == "ray" else "mp"
        if backends and backends[-1] != wanted:
            refuse(members_play, f"serving group {name}: vllm_server_args say --distributed-executor-backend "
                                 f"{backends[-1]}, but a group launched {launch} runs the {wanted} executor: "
                                 f"leave the option out of the group's vllm_server_args")
        if launch == "ray" and not ref_info.get("ray_pinned"):
            refuse(members_play, f"serving group {name}: launch ray runs Ray from the release, and its lock file "
                                 f"{ref_info.get('lock') or '(unknown)'} pins no ray (ray==<version>): pin Ray in "
                                 f"the release line's lock, or launch native")
        if launch == "ray" and ports["master_port"] == ports["ray_port"]:
            refuse(members_play, f"serving group {name}: the master port and the Ray port are both "
                                 f"{ports['ray_port']}")
        master_addr = ref_info.get("master_addr") or (hosts[head].get("address") if head in hosts else "") or ""
        if not master_addr:
            refuse(members_play, f"serving group {name}: no master address: the head {head} has no default "
                                 f"IPv4 address; set mlafleet_serving_group_master_addr (the head's address "
                                 f"on the cluster network)")

        # The parallel layout: the group's variables, else what vllm_server_args say; both must agree.
        parallel = ref_info.get("parallel") or {}
        layout = {}
        for key, option in (("tensor", "--tensor-parallel-size"), ("pipeline", "--pipeline-parallel-size")):
            raw = ref_info.get(key)
            from_args = parallel.get(key, 1)
            if _unset(raw):
                layout[key] = from_args
                continue
            size = _int(raw)
            if size is None:
                refuse(members_play, f"serving group {name}: {AGREE[key]} {raw!r} is not a positive integer")
                size = 1
            elif key in (parallel.get("named") or []) and from_args != size:
                refuse(members_play, f"serving group {name}: vllm_server_args say {option} {from_args}, "
                                     f"{AGREE[key]} says {size}")
            layout[key] = size
        for reason in parallel.get("problems") or []:
            refuse(members_play, f"serving group {name}: {reason}")
        nnodes = len(inventory)
        slots = ref_info.get("slots") or 0
        world = layout["tensor"] * layout["pipeline"]
        if world != nnodes * slots:
            refuse(members_play, f"serving group {name}: tensor parallel {layout['tensor']} x pipeline parallel "
                                 f"{layout['pipeline']} = {world} GPUs, but {nnodes} members x {slots} "
                                 f"GPU{'' if slots == 1 else 's'} = {nnodes * slots} "
                                 f"({', '.join(inventory)}): they must be equal")
        with_heads = [h for h in [ref, *members_play] if hosts[h].get("heads")]
        if with_heads:
            heads = hosts[with_heads[0]]["heads"]
            if heads % layout["tensor"]:
                refuse(members_play, f"serving group {name}: tensor parallel {layout['tensor']} does not divide "
                                     f"the model's {heads} attention heads ({hosts[with_heads[0]].get('heads_from')})")

        ranked = [head] + [h for h in inventory if h != head]
        group = {
            "name": name, "head": head, "members": ranked, "workers": ranked[1:], "nnodes": nnodes,
            "master_addr": master_addr, "master_port": ports["master_port"], "ray_port": ports["ray_port"],
            "launch": launch, "tensor": layout["tensor"], "pipeline": layout["pipeline"], "gpus_per_member": slots,
        }
        group["ok"] = not any(problems.get(h) for h in members_play)
        out_groups[name] = group
        for host in members_play:
            rank = ranked.index(host)
            views[host] = {**group, "group": name, "rank": rank, "is_head": rank == 0,
                           "role": "head" if rank == 0 else "worker"}

    return {"groups": out_groups, "hosts": views, "problems": problems}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"serving_groups": serving_groups}
