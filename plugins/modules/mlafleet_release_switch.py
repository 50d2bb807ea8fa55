#!/usr/bin/python
"""Ansible module: make a release current on a host, atomically; the old one becomes previous.

A host's releases live in `<root>/releases/<id>`; `<root>/current` and `<root>/previous` are
relative symlinks to two of them. Switching writes each link as `<name>.tmp` and renames it over
the old one (rename(2) is atomic: a reader sees the old release or the new one, never neither).
The vllm_install role (a new release) and the vllm_rollback role (back to an older one) both
switch with it.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_release_switch
short_description: Switch a host's current vLLM release atomically, keeping the old one as previous
description:
  - Points C(<root>/current) at C(releases/<release>); the release it pointed at before becomes
    C(<root>/previous). Each symlink is written beside its final name and renamed over it, so
    C(current) is never missing or half written.
  - Changes nothing when C(current) already points at the release.
  - Fails, changing nothing, when the release directory does not exist or C(current) is not a symlink.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  root: {type: path, required: true, description: Root of the releases on the host (holds C(releases/)).}
  release:
    type: str
    required: true
    description: Release id, a directory under C(<root>/releases) (letters, digits, '.', '_', '-').
attributes:
  check_mode:
    support: full
    description: Reports whether current would move (the release directory is not required to exist yet).
notes:
  - The roles mlafleet.fleet.vllm_install and mlafleet.fleet.vllm_rollback call it.
"""

EXAMPLES = r"""
- name: Make release 20260110T0300Z current
  mlafleet.fleet.mlafleet_release_switch:
    root: /opt/mlafleet
    release: 20260110T0300Z
"""

RETURN = r"""
current:
  description: What C(current) points at afterwards (in check mode, would point at).
  type: str
  returned: always
  sample: releases/20260110T0300Z
previous:
  description: What C(previous) points at afterwards (the release current pointed at before), or null when there is none.
  type: str
  returned: always
  sample: releases/20251201T0300Z
"""

import os
import re

from ansible.module_utils.basic import AnsibleModule

RELEASE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def read_link(path: str) -> str | None:
    """A symlink's target, None when there is nothing at `path`."""
    try:
        return os.readlink(path)
    except FileNotFoundError:
        return None


def same_target(root: str, link_target: str | None, wanted: str) -> bool:
    """Whether a link target (relative to root, or absolute) names the wanted release directory."""
    if link_target is None:
        return False
    return os.path.normpath(os.path.join(root, link_target)) == os.path.normpath(os.path.join(root, wanted))


def replace_link(root: str, name: str, target: str) -> None:
    """`<root>/<name>` -> target, written as `<name>.tmp` and renamed over the old link."""
    tmp = os.path.join(root, name + ".tmp")
    if os.path.lexists(tmp):  # left by an interrupted switch
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(root, name))


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "root": {"type": "path", "required": True},
            "release": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    root, release = module.params["root"], module.params["release"]
    if not RELEASE_RE.match(release):
        module.fail_json(msg=f"{release!r} is not a release id (letters, digits, '.', '_', '-')")
    wanted = f"releases/{release}"
    current_path = os.path.join(root, "current")
    if os.path.lexists(current_path) and not os.path.islink(current_path):
        module.fail_json(msg=f"{current_path} is not a symlink; nothing was changed")
    old = read_link(current_path)
    if same_target(root, old, wanted):
        module.exit_json(changed=False, current=old, previous=read_link(os.path.join(root, "previous")))
    if not module.check_mode:
        if not os.path.isdir(os.path.join(root, wanted)):
            module.fail_json(msg=f"{os.path.join(root, wanted)} is not a directory; nothing was changed")
        if old is not None:
            replace_link(root, "previous", old)
        replace_link(root, "current", wanted)
    previous = old if old is not None else read_link(os.path.join(root, "previous"))
    module.exit_json(changed=True, current=wanted, previous=previous)


if __name__ == "__main__":
    main()
