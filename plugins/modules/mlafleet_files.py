#!/usr/bin/python
"""Ansible module: a role's small files and their directories in one call.

A role that installs a program, its settings and its systemd unit with `file`, `copy` and
`template` pays one module run per directory and two per file on every run, also when nothing
changes (a `stat`, then a `file` for the attributes). This module takes the directories and the
files' contents (rendered on the controller with the `template` and `file` lookups) and makes the
host match in one run: a missing directory is created, a file whose bytes differ is replaced
atomically, owner, group and mode are set where they differ. It names what changed.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_files
short_description: Directories and small files with their content, owner, group and mode, in one module run
description:
  - Creates each of O(directories) that is missing and sets its owner, group and mode.
  - Writes each of O(files) whose content differs (atomically, a temporary file in the same
    directory renamed over it) and sets its owner, group and mode.
  - Removes each of O(absent) that exists (a file or a symlink).
  - Changes nothing when everything already matches; in check mode reports what would change.
  - For contents that are not secret (they travel as module arguments).
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  directories:
    type: list
    elements: dict
    default: []
    description: Directories to ensure, parents first.
    suboptions:
      path: {type: path, required: true, description: The directory.}
      owner: {type: str, description: Its owner.}
      group: {type: str, description: Its group.}
      mode: {type: raw, description: Its mode (an octal string such as V(0755)).}
  files:
    type: list
    elements: dict
    default: []
    description: Files to ensure (their directories must exist or be among O(directories)).
    suboptions:
      dest: {type: path, required: true, description: The file.}
      content: {type: str, required: true, description: Its whole content (text).}
      owner: {type: str, description: Its owner.}
      group: {type: str, description: Its group.}
      mode: {type: raw, description: Its mode (an octal string such as V(0644)).}
  absent:
    type: list
    elements: path
    default: []
    description: Files that must not exist (left-overs of earlier versions); a directory there is refused.
attributes:
  check_mode:
    support: full
    description: Reports what would change and changes nothing.
notes:
  - The roles mlafleet.fleet.vllm_watchdog, mlafleet.fleet.vllm_server and mlafleet.fleet.smoke_test call it.
"""

EXAMPLES = r"""
- name: Install the program, its settings and its unit
  mlafleet.fleet.mlafleet_files:
    directories:
      - {path: /usr/local/lib/mlafleet, owner: root, group: root, mode: "0755"}
    files:
      - dest: /usr/local/lib/mlafleet/watchdog.py
        content: "{{ lookup('ansible.builtin.file', 'watchdog.py', rstrip=false) }}"
        mode: "0644"
      - dest: /etc/systemd/system/watchdog.service
        content: "{{ lookup('ansible.builtin.template', 'watchdog.service.j2') }}"
        mode: "0644"
  notify: Restart the watchdog
"""

RETURN = r"""
updated:
  description: The directories and files that were (in check mode, would be) created, written, given new attributes or removed, in order.
  type: list
  elements: str
  returned: always
"""

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule


def _attributes(module: AnsibleModule, path: str, item: dict, changed: bool) -> bool:
    args = {"path": path, "owner": item.get("owner"), "group": item.get("group"), "mode": item.get("mode"),
            "secontext": None, "attributes": None}
    return module.set_fs_attributes_if_different(args, changed)


def _directory(module: AnsibleModule, item: dict) -> bool:
    path = item["path"]
    if os.path.isdir(path):
        return _attributes(module, path, item, False)
    if os.path.lexists(path):
        module.fail_json(msg=f"{path} exists and is not a directory")
    if module.check_mode:
        return True
    try:
        os.makedirs(path)
    except OSError as exc:
        module.fail_json(msg=f"could not create {path}: {exc}")
    return _attributes(module, path, item, True)


def _file(module: AnsibleModule, item: dict) -> bool:
    dest, data = item["dest"], item["content"].encode("utf-8")
    current = None
    if os.path.lexists(dest):
        if not os.path.isfile(dest) or os.path.islink(dest):
            module.fail_json(msg=f"{dest} exists and is not a regular file")
        with open(dest, "rb") as handle:
            current = handle.read()
    changed = current != data
    if changed and module.check_mode:
        return True
    if changed:
        folder = os.path.dirname(dest) or "."
        if not os.path.isdir(folder):
            module.fail_json(msg=f"{dest}: its directory {folder} does not exist (list it in directories)")
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mlafleet-files-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            module.atomic_move(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return _attributes(module, dest, item, changed)


def _absent(module: AnsibleModule, path: str) -> bool:
    if not os.path.lexists(path):
        return False
    if os.path.isdir(path) and not os.path.islink(path):
        module.fail_json(msg=f"{path} is a directory, not a file to remove")
    if not module.check_mode:
        os.unlink(path)
    return True


def main() -> None:
    entry = {"owner": {"type": "str"}, "group": {"type": "str"}, "mode": {"type": "raw"}}
    module = AnsibleModule(
        argument_spec={
            "directories": {"type": "list", "elements": "dict", "default": [],
                            "options": {"path": {"type": "path", "required": True}, **entry}},
            "files": {"type": "list", "elements": "dict", "default": [],
                      "options": {"dest": {"type": "path", "required": True},
                                  "content": {"type": "str", "required": True}, **entry}},
            "absent": {"type": "list", "elements": "path", "default": []},
        },
        supports_check_mode=True,
    )
    updated = [d["path"] for d in module.params["directories"] if _directory(module, d)]
    updated += [f["dest"] for f in module.params["files"] if _file(module, f)]
    updated += [p for p in module.params["absent"] if _absent(module, p)]
    module.exit_json(changed=bool(updated), updated=updated)


if __name__ == "__main__":
    main()
