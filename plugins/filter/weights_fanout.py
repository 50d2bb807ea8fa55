"""Filter `weights_fanout`: which host fetches from the origin, which from which peer, and when.

Hosts are taken in play order. The first `origins` hosts fetch from the origin in wave 0; after
that every host that holds the shards serves exactly one new host per wave, so the number of
holders doubles each wave: wave w covers positions [origins * 2**(w-1), origins * 2**w), and the
host at position p pulls from position p - origins * 2**(w-1). A fleet of N hosts is staged in
1 + ceil(log2(N / origins)) waves and the origin serves only `origins` copies.
"""

from __future__ import annotations


def fanout(hosts: list[str], origins: int = 1, enabled: bool = True) -> dict[str, dict]:
    """Map each host to {"wave": int, "peer": the host it pulls from, or None for the origin}."""
    hosts = list(hosts)
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"weights_fanout: duplicate hosts in {hosts}")
    if isinstance(origins, bool) or not isinstance(origins, int) or origins < 1:
        raise ValueError(f"weights_fanout: origins must be a positive integer, not {origins!r}")
    plan: dict[str, dict] = {}
    for position, host in enumerate(hosts):
        if not enabled or position < origins:
            plan[host] = {"wave": 0, "peer": None}
            continue
        wave, start = 1, origins
        while position >= start * 2:
            wave, start = wave + 1, start * 2
        plan[host] = {"wave": wave, "peer": hosts[position - start]}
    return plan


class FilterModule:
    def filters(self) -> dict:
        return {"weights_fanout": fanout}
