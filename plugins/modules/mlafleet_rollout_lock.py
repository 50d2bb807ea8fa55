#!/usr/bin/python
"""Ansible module: take or release the mlafleet rollout lock of one host.

The lock is a small JSON file ({owner, run, controller, pid, time}) created with O_EXCL, so two
controllers racing for it cannot both win. A lock held by another run makes the module fail
with its owner and age; a lock older than `stale_after` seconds is reported as stale and is
removed only when `break_stale` is true. Releasing removes the file only when it is ours.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_rollout_lock
short_description: Take or release the mlafleet per-host rollout lock
description:
  - Creates the lock file atomically (O_EXCL) with owner, run id, controller and time.
  - Fails, naming the owner and age, when another run holds the lock; a lock older than
    O(stale_after) seconds is called stale and is broken only with O(break_stale=true).
  - Releases only a lock held by the same run id.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  path: {type: path, required: true, description: Lock file.}
  state:
    type: str
    choices: [present, absent, check]
    default: present
    description: Take (V(present)), release (V(absent)), or only check that no other run holds it (V(check)).
  run: {type: str, required: true, description: Run id of this rollout (re-entrant for the same run).}
  owner: {type: str, required: true, description: Who takes it (user@controller).}
  stale_after: {type: int, default: 7200, description: Age in seconds after which a lock is stale.}
  break_stale: {type: bool, default: false, description: Remove a stale lock held by another run.}
attributes:
  check_mode:
    support: full
    description: Reports what it would take, break or release.
notes:
  - The role mlafleet.fleet.rollout_lock wraps it with the rollout's run id and owner.
"""

EXAMPLES = r"""
- name: Take this host's lock for run 20260110T0300Z
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    run: 20260110T0300Z
    owner: ops@controller

- name: Only check that no other run holds it (before any batch starts)
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    state: check
    run: 20260110T0300Z
    owner: ops@controller

- name: Release it (only a lock of this run is removed)
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    state: absent
    run: 20260110T0300Z
    owner: ops@controller
"""

RETURN = r"""
msg:
  description: What happened (V(taken), V(released), V(free), V(no lock), V(already held by this run), or the broken lock).
  type: str
  returned: always
  sample: taken
lock:
  description: The lock found on the host (owner, run, controller_pid, time), when there was one.
  type: dict
  returned: when a lock was found
  sample: {owner: ops@ctl, run: 20260110T0300Z, controller_pid: 4242, time: 1768014000.0}
age:
  description: Age of the lock found, in seconds.
  type: int
  returned: when another run's lock was found
  sample: 9000
stale:
  description: Whether that lock is older than O(stale_after).
  type: bool
  returned: when another run's lock was found
broken:
  description: The stale lock that was broken to take this one, or null.
  type: dict
  returned: when O(state=present) took the lock
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule


def read_lock(path: str) -> dict | None:
    """The lock's content, None when there is no lock; an unreadable lock is reported as such."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError:
        data = {"owner": "unknown (unreadable lock file)", "run": "", "time": os.path.getmtime(path)}
    return data


def describe(lock: dict, now: float) -> tuple[str, int]:
    age = int(now - float(lock.get("time", now)))
    text = (f"owner {lock.get('owner', '?')}, run {lock.get('run', '?')}, "
            f"taken {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(float(lock.get('time', now))))} "
            f"({age} s ago)")
    return text, age


def take(module: AnsibleModule, path: str, run: str, owner: str) -> None:
    content = json.dumps({"owner": owner, "run": run, "controller_pid": os.getppid(), "time": time.time()})
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        lock = read_lock(path) or {}
        text, dummy = describe(lock, time.time())
        module.fail_json(msg=f"{path}: taken by another rollout at the same moment: {text}", lock=lock)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content + "\n")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {"type": "str", "choices": ["present", "absent", "check"], "default": "present"},
            "run": {"type": "str", "required": True},
            "owner": {"type": "str", "required": True},
            "stale_after": {"type": "int", "default": 7200},
            "break_stale": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    if not p["run"]:
        module.fail_json(msg="run must be a non-empty run id (site.yml and rollback.yml set mlafleet_run_id in a "
                             "play on localhost: with --limit, keep localhost in the pattern)")
    now = time.time()
    lock = read_lock(p["path"])

    if p["state"] == "absent":
        if lock is None:
            module.exit_json(changed=False, msg="no lock")
        if lock.get("run") != p["run"]:
            text, dummy = describe(lock, now)
            module.fail_json(msg=f"{p['path']} is held by another run, not releasing it: {text}", lock=lock)
        if not module.check_mode:
            os.unlink(p["path"])
        module.exit_json(changed=True, msg="released")

    if lock is not None and lock.get("run") == p["run"]:
        module.exit_json(changed=False, msg="already held by this run", lock=lock)
    broken = None
    if lock is not None and p["state"] == "check" and p["break_stale"]:
        text, age = describe(lock, now)
        if age >= p["stale_after"]:
            module.exit_json(changed=False, msg=f"stale lock will be broken: {text}", lock=lock, age=age, stale=True)
    if lock is not None:
        text, age = describe(lock, now)
        if age < p["stale_after"]:
            module.fail_json(msg=f"{p['path']}: another rollout holds this host: {text}", lock=lock, age=age, stale=False)
        if not p["break_stale"]:
            module.fail_json(msg=f"{p['path']}: stale lock (older than {p['stale_after']} s): {text}; "
                                 "set rollout_lock_break=true to break it", lock=lock, age=age, stale=True)
        broken = lock
        if not module.check_mode and p["state"] == "present":
            os.unlink(p["path"])
    if p["state"] == "check":
        module.exit_json(changed=False, msg="free")
    if not module.check_mode:
        take(module, p["path"], p["run"], p["owner"])
    if broken is None:
        module.exit_json(changed=True, msg="taken", broken=None)
    text, dummy = describe(broken, now)
    msg = f"{p['path']}: broke the stale lock of {text} (rollout_lock_break=true) and took it"
    module.exit_json(changed=True, msg=msg, broken=broken, warnings=[msg])


if __name__ == "__main__":
    main()
