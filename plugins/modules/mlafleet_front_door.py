#!/usr/bin/python
"""Ansible module: a front door's view of its backends, and a backend's state there, through HAProxy's
runtime API (the stats socket, local to the door host: the module runs there over SSH).

The runtime API takes one command per connection and answers text: `show stat` is CSV (a `# `
header line naming the fields), `set server <backend>/<server> state drain|ready|maint` answers
nothing when it worked and a sentence when it did not ("No such server."). The module reads the
backend's servers before and after a change, so it reports `changed` only when the state moved
and fails naming the door's own words when HAProxy refuses.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_front_door
short_description: Read a HAProxy front door's backends and set one backend's state (drain, ready, maint)
description:
  - Talks to HAProxy's runtime API on its local stats socket (C(stats socket ... level admin)).
  - Returns every server of O(backend) as the door sees it (status, current sessions, weight, check).
  - With O(state) drain, ready or maint, sets O(server)'s administrative state first.
version_added: 0.4.0
author: mlafleet maintainers (@mlafleet)
options:
  socket: {type: path, default: /run/haproxy/admin.sock, description: The door's runtime API socket.}
  backend: {type: str, default: vllm, description: The HAProxy backend.}
  server: {type: str, default: "", description: The server (a backend host's inventory name) for O(state).}
  state:
    type: str
    choices: [query, drain, ready, maint]
    default: query
    description: V(query) only reads; the others set O(server)'s state.
  wait:
    type: str
    choices: [none, idle, up]
    default: none
    description: >-
      Then wait, polling every O(poll) seconds for at most O(wait_timeout), until the door counts no
      session on O(server) (V(idle)) or sees it UP (V(up)). Running out of time is no failure:
      RV(waited) and RV(reached) say what happened.
  wait_timeout: {type: float, default: 0, description: Seconds the wait may take.}
  poll: {type: float, default: 1, description: Seconds between two looks.}
attributes:
  check_mode:
    support: full
    description: Reads the door; sets nothing and reports whether it would.
"""

RETURN = r"""
servers:
  description: Every server of the backend, as the door counts it.
  type: list
  elements: dict
  returned: always
  sample: [{name: h1, status: UP, admin: ready, scur: 2, weight: 1, check_status: L7OK, address: "10.0.0.5:8000"}]
server:
  description: O(server)'s entry of RV(servers) after the change and the wait ({} without O(server)).
  type: dict
  returned: always
waited: {description: Seconds spent waiting., type: float, returned: always}
reached: {description: Whether the wait's condition held at its end (true without a wait)., type: bool, returned: always}
"""

EXAMPLES = r"""
- name: Take h1 out of the door (running requests finish)
  mlafleet.fleet.mlafleet_front_door:
    server: h1
    state: drain
  delegate_to: door-01
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.mlafleet.fleet.plugins.module_utils.haproxy_runtime import ask, read_servers


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "socket": {"type": "path", "default": "/run/haproxy/admin.sock"},
            "backend": {"type": "str", "default": "vllm"},
            "server": {"type": "str", "default": ""},
            "state": {"type": "str", "default": "query", "choices": ["query", "drain", "ready", "maint"]},
            "wait": {"type": "str", "default": "none", "choices": ["none", "idle", "up"]},
            "wait_timeout": {"type": "float", "default": 0},
            "poll": {"type": "float", "default": 1},
        },
        required_if=[("state", s, ["server"]) for s in ("drain", "ready", "maint")]
        + [("wait", w, ["server"]) for w in ("idle", "up")],
        supports_check_mode=True,
    )
    path, backend, server, state = (module.params[k] for k in ("socket", "backend", "server", "state"))

    def read() -> list[dict]:
        try:
            return read_servers(path, backend)
        except (OSError, ValueError) as exc:
            module.fail_json(msg=f"front door: cannot read HAProxy's runtime API on {path}: {exc}")

    def entry(servers: list[dict]) -> dict:
        return next((s for s in servers if s["name"] == server), {})

    servers = read()
    if server and not entry(servers):
        module.fail_json(msg=f"front door: backend {backend} has no server {server} (servers: "
                             f"{', '.join(s['name'] for s in servers) or 'none'}): is it in front_door_backends?",
                         servers=servers)
    changed = state != "query" and entry(servers)["admin"] != state
    if changed and not module.check_mode:
        answer = ask(path, f"set server {backend}/{server} state {state}").strip()
        if answer:
            module.fail_json(msg=f"front door: HAProxy refused to set {backend}/{server} {state}: {answer}")
        servers = read()
    wait = module.params["wait"]

    def reached() -> bool:
        mine = entry(servers)
        return wait == "none" or (mine["scur"] == 0 if wait == "idle" else mine["status"].startswith("UP"))

    started = time.monotonic()
    deadline = started + module.params["wait_timeout"]
    while not module.check_mode and not reached() and time.monotonic() < deadline:
        time.sleep(max(0.05, min(module.params["poll"], deadline - time.monotonic())))
        servers = read()
    module.exit_json(changed=changed, servers=servers, server=entry(servers) if server else {},
                     waited=round(time.monotonic() - started, 3), reached=module.check_mode or reached())


if __name__ == "__main__":
    main()
