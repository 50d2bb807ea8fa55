"""Filter `rollout_batches`: the rollout's batches, counting serving groups and single hosts alike.

A serving group (plugins/filter/serving_groups.py) is one vLLM server over several hosts, so a batch
takes it whole: `mlafleet_serial` ([1, "25%"], 2, "50%", ...) counts units, where a unit is a
serving group or a single host, in the order the play lists their first host (the first unit is the
canary: a canary group when a group comes first). Percentages are of the units, rounded down, at
least one; the last size repeats until every unit is in a batch, as Ansible's `serial` does.

Input: the play's hosts in order, each host's serving group name ({host: mlafleet_serving_group},
"" or absent for a single host; preflight refuses a play that cuts a group) and the serial value.
Output: {hosts: the play's hosts reordered so each batch's hosts are consecutive, serial: the
number of hosts of each batch (a list for the play's `serial`), batches: [[unit, ...], ...] with a
unit named by its group or host, groups: {group: [its hosts in the play's order]} (the report's
timeline draws a group's members together)}.
"""
from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError


def _size(entry: Any, units: int) -> int:
    text = str(entry).strip()
    try:
        if text.endswith("%"):
            return max(1, int(units * float(text[:-1]) / 100))
        size = int(text)
    except ValueError:
        raise AnsibleFilterError(f"mlafleet_serial: {entry!r} is neither a number nor a percentage") from None
    if size < 1:
        raise AnsibleFilterError(f"mlafleet_serial: {entry!r} must be at least 1 (or a percentage)")
    return size


def rollout_batches(play_hosts: list[str], host_groups: dict[str, Any] | None, serial: Any) -> dict[str, Any]:
    group_of = {host: str(name) for host, name in (host_groups or {}).items() if name}
    units: list[tuple[str, list[str]]] = []
    seen: dict[str, list[str]] = {}
    for host in play_hosts:
        name = group_of.get(host)
        if name is None:
            units.append((host, [host]))
        elif name in seen:
            seen[name].append(host)
        else:
            seen[name] = [host]
            units.append((name, seen[name]))
    entries = serial if isinstance(serial, (list, tuple)) else [serial]
    entries = [e for e in entries if e is not None and str(e).strip()] or ["100%"]
    batches: list[list[tuple[str, list[str]]]] = []
    i = 0
    while i < len(units):
        size = _size(entries[min(len(batches), len(entries) - 1)], len(units))
        batches.append(units[i:i + size])
        i += size
    return {
        "hosts": [h for batch in batches for _, members in batch for h in members],
        "serial": [sum(len(members) for _, members in batch) for batch in batches],
        "batches": [[name for name, _ in batch] for batch in batches],
        "groups": dict(seen),
    }


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"rollout_batches": rollout_batches}
