"""Filters of the front door (roles/front_door, docs/front-door.md): which servers the door balances
over, Ansible's batches of a rollout, and the refusal of a plan whose batch would leave too few
backends serving. Plain data in, plain data out (tests/test_front_door_plan.py).

front_door_backends(hostvars, hosts, groups) -> [{name, address, port, group, members}]
  One backend per single host and per serving group (its head, node rank 0, the API server); a
  group's other members are never backends. A host's part comes from preflight's view
  (preflight_serving_member: is_head, head, members) when this run has it, else from the
  inventory (mlafleet_serving_group names the group; its head is mlafleet_serving_group_head or
  the group's first host), so the door can be configured without a preflight run. The address
  the door connects to: front_door_backend_address, else vllm_server_host unless it is a wildcard
  (0.0.0.0, ::), else ansible_host, else the inventory name; the port: vllm_server_port (8000).

front_door_batches(hosts, serial) -> [[host, ...], ...]
  The batches Ansible's `serial` makes of a play's hosts: each entry a count or "N%" of all hosts
  (at least 1), the last entry repeated until no host is left.

front_door_min_serving(backends, batches, min_serving=1, healthy=None) -> [reason, ...]
  For each batch: the backends it takes out (a member of a serving group takes its group's
  backend), and a reason when it takes a healthy one out and fewer than min_serving healthy
  backends stay in: those healthy now (`healthy`: names; default every backend) and those of the
  batches before it (a batch that passed put its backends back). A batch that takes out only
  backends that serve nothing now (a first rollout, a repair) loses nothing and passes. An empty list: the plan keeps the door serving.

front_door_healthy(views) -> [name, ...]
  The backends every door serves with (views: each door's servers as mlafleet_front_door returns
  them): UP, state ready, weight above 0 (the door's completion check sets 0 on a server whose
  completions fail).

without_doors(groups, door_group="") -> str
  The host pattern of every play that touches vLLM hosts: "all", or "all:!<door group>" when the
  inventory has door hosts (group front_door_group, "" : mlafleet_front_door). A door host gets
  no preflight, release, weights or server. Play patterns see extra vars but not group_vars: a
  door group of another name is passed as `-e front_door_group=NAME`.

has_front_door(groups, door_group="", hooks=None) -> bool
  Whether servers leave a door before they stop and go back in after (drain and ready): the
  inventory has door hosts (the door group) or the operator's own door through controller-side
  hooks (front_door_hooks). The vllm_server role's default, rollout.yml and rollback.yml ask it.

front_door_requests_running(text) -> float
  vLLM's `vllm:num_requests_running` summed over its labels (engines, models), from a /metrics
  text parsed by prometheus_client's own parser; -1 when the text has no such series.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WILDCARDS = ("", "0.0.0.0", "::", "[::]")
DOOR_GROUP = "mlafleet_front_door"
DEFAULT_PORT = 8000


def _vars(hostvars: Mapping[str, Any], host: str) -> Mapping[str, Any]:
    try:
        return hostvars[host]
    except KeyError:
        return {}


def _get(hv: Mapping[str, Any], key: str, default: Any = None) -> Any:
    try:
        value = hv[key]
    except KeyError:
        return default
    return default if value is None else value


def _part(hv: Mapping[str, Any], host: str, groups: Mapping[str, list[str]]) -> tuple[str, str, list[str]]:
    """(group name, head, members) of a host; ("", host, [host]) for a single host."""
    view = _get(hv, "preflight_serving_member") or {}
    if view:
        return str(view.get("group", "")), str(view["head"]), list(view.get("members") or [host])
    name = str(_get(hv, "mlafleet_serving_group", "") or "")
    if not name:
        return "", host, [host]
    members = list(groups.get(name) or [host])
    head = str(_get(hv, "mlafleet_serving_group_head", "") or members[0])
    return name, head, members


def front_door_backends(hostvars: Mapping[str, Any], hosts: list[str],
                        groups: Mapping[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The door's backends among `hosts` (see the module doc), in the order of `hosts`."""
    groups = groups or {}
    backends: list[dict[str, Any]] = []
    for host in dict.fromkeys(hosts or []):
        hv = _vars(hostvars, host)
        group, head, members = _part(hv, host, groups)
        if head != host:
            continue  # a worker of a serving group: its head serves for it
        bind = str(_get(hv, "vllm_server_host", "") or "")
        address = (_get(hv, "front_door_backend_address", "")
                   or (bind if bind not in WILDCARDS else "")
                   or _get(hv, "ansible_host", "") or host)
        backends.append({"name": host, "address": str(address),
                         "port": int(_get(hv, "vllm_server_port", DEFAULT_PORT)),
                         "group": group, "members": members})
    return backends


def front_door_batches(hosts: list[str], serial: Any = None) -> list[list[str]]:
    """Ansible's batches of `hosts` for `serial` (an int, "N%" or a list of them; none: one batch)."""
    hosts = list(hosts or [])
    if not hosts:
        return []
    steps = serial if isinstance(serial, list) else [serial]
    if serial is None or serial == [] or serial == 0:
        return [hosts]
    sizes = []
    for step in steps:
        text = str(step).strip()
        size = int(len(hosts) * float(text[:-1]) / 100.0) if text.endswith("%") else int(text)
        sizes.append(max(1, size) if size or text.endswith("%") else len(hosts))
    batches, i, n = [], 0, 0
    while i < len(hosts):
        size = sizes[min(n, len(sizes) - 1)]
        batches.append(hosts[i:i + size])
        i, n = i + size, n + 1
    return batches


def front_door_min_serving(backends: list[dict[str, Any]], batches: list[list[str]], min_serving: Any = 1,
                           healthy: list[str] | None = None) -> list[str]:
    """Reasons a rollout plan would leave fewer than min_serving healthy backends (see the module doc)."""
    minimum = int(min_serving)
    names = [b["name"] for b in backends or []]
    of_host = {member: b["name"] for b in backends or [] for member in (b.get("members") or [b["name"]])}
    serving = [n for n in names if healthy is None or n in healthy]
    reasons, back = [], []
    for number, batch in enumerate(batches or [], start=1):
        out = list(dict.fromkeys(of_host[h] for h in batch if h in of_host))
        left = [n for n in names if (n in serving or n in back) and n not in out]
        back += out
        if any(n in serving for n in out) and len(left) < minimum:
            down = [n for n in names if n not in serving]
            reasons.append(
                f"batch {number} ({', '.join(batch)}) takes {', '.join(out)} out of the front door; "
                f"{len(left)} healthy backend{'' if len(left) == 1 else 's'} would serve "
                f"({', '.join(left) if left else 'none'}), fewer than mlafleet_min_serving {minimum}"
                + (f" (not healthy now: {', '.join(down)})" if down else "")
                + ": make the batches smaller (mlafleet_serial) or bring backends back first")
    return reasons


def front_door_healthy(views: list[list[dict[str, Any]]]) -> list[str]:
    """Names of the servers UP, ready and weighted at every door (see the module doc)."""
    sets = [[s["name"] for s in servers
             if str(s.get("status", "")).startswith("UP") and s.get("admin") == "ready" and int(s.get("weight", 0)) > 0]
            for servers in views or []]
    if not sets:
        return []
    return [name for name in sets[0] if all(name in other for other in sets[1:])]


def without_doors(groups: Mapping[str, list[str]], door_group: str = "") -> str:
    """The host pattern of the plays on vLLM hosts: every host but the doors (see the module doc)."""
    name = door_group or DOOR_GROUP
    return f"all:!{name}" if (groups or {}).get(name) else "all"


def has_front_door(groups: Mapping[str, list[str]], door_group: str = "", hooks: Mapping[str, Any] | None = None) -> bool:
    """Door hosts in the inventory or the operator's hooks (see the module doc)."""
    return bool((groups or {}).get(door_group or DOOR_GROUP)) or bool(hooks)


def front_door_requests_running(text: str) -> float:
    """vllm:num_requests_running summed over its labels; -1 when absent (see the module doc)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s.value for family in text_string_to_metric_families(text or "") for s in family.samples
               if s.name == "vllm:num_requests_running"]
    return float(sum(samples)) if samples else -1.0


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"front_door_backends": front_door_backends, "front_door_batches": front_door_batches,
                "front_door_min_serving": front_door_min_serving, "front_door_healthy": front_door_healthy,
                "front_door_requests_running": front_door_requests_running, "without_doors": without_doors,
                "has_front_door": has_front_door}
