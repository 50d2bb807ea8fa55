#!/usr/bin/python
"""Ansible module: make a served state current on a host, atomically; the old one becomes previous.

What a host serves is a *state*: a release (`<root>/releases/<id>`: the venv with its patched
vLLM, installed once) plus one revision of its server configuration
(`<root>/releases/<id>/server.d/<rev>/`: the `serve` command and `vllm.env`). A revision is named
by the sha256 of its files and never rewritten, so a configuration change (new arguments, bind
address, API key, environment) is a new revision beside the old one, and going back to the old
one gives back the same bytes.

Links, each written as `<name>.tmp` and renamed over the old one (rename(2) is atomic):
- `<root>/current` -> `releases/<id>`: the release served (its `venv`, `release.json`);
- `<root>/releases/<id>/server` -> `server.d/<rev>`: the revision that release serves with
  (vllm.service runs `<root>/current/server/serve`);
- `<root>/previous` -> the state served before the last change: `releases/<id>/server.d/<rev>`,
  or `releases/<id>` for a release without revisions (older mlafleet, or one never configured).

A release's `server` that is still a plain directory (mlafleet before revisions) becomes the
revision of its files on the first switch that touches it.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_release_switch
short_description: Switch what a host serves (release and server configuration revision) atomically, keeping the old state as previous
description:
  - Points C(<root>/current) at C(releases/<release>) and, with O(server) or O(revision), that
    release's C(server) link at one revision of its server configuration
    (C(releases/<release>/server.d/<rev>)). The state served before becomes C(<root>/previous)
    (unless O(previous) names what previous must be).
  - O(server) gives the configuration's files; their revision is the sha256 of the files (names
    and bytes), written once and never rewritten, so a change of arguments, bind, API key or
    environment is a new revision and the old one stays byte for byte.
  - The first configuration of a release just made current (no revision yet) leaves previous as
    the release switch set it.
  - Changes nothing when the host already serves the requested state.
  - Fails, changing nothing, when the release or revision does not exist or C(current) is not a symlink.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  root: {type: path, required: true, description: Root of the releases on the host (holds C(releases/)).}
  release:
    type: str
    required: true
    description: Release id, a directory under C(<root>/releases) (letters, digits, '.', '_', '-').
  server:
    type: dict
    description:
      - The release's server configuration, file name to content (C(serve), C(vllm.env)). Written
        as a new revision when no revision holds these bytes yet; then made the release's revision.
  server_group:
    type: str
    default: root
    description: Group of the revision's directory and files (the service user reads them).
  server_modes:
    type: dict
    default: {}
    description: File name to octal mode string for O(server)'s files (default C(0640)); the directory is C(0750).
  revision:
    type: str
    description: An existing revision of the release to serve (what a rollback restores).
  previous:
    type: str
    description:
      - What C(previous) must point at afterwards, as a link target relative to O(root) (a rollback
        that undoes a rejected attempt puts back exactly what previous was before it). V("") removes it.
  reject:
    type: dict
    description:
      - Marks a state rejected before switching away from it (keys C(release), C(revision), C(cause) and C(run))
        by writing C(rejected.json) in its revision (or release) directory. A rejected state is never
        the default rollback target.
attributes:
  check_mode:
    support: full
    description: Reports whether the state would change (the release directory is not required to exist yet).
notes:
  - The roles mlafleet.fleet.vllm_install, mlafleet.fleet.vllm_server and mlafleet.fleet.vllm_rollback call it.
"""

EXAMPLES = r"""
- name: Make release 0.20.2-abc current (its server configuration comes later)
  mlafleet.fleet.mlafleet_release_switch:
    root: /opt/mlafleet
    release: 0.20.2-abc

- name: Serve it with this configuration (a new revision when the bytes are new)
  mlafleet.fleet.mlafleet_release_switch:
    root: /opt/mlafleet
    release: 0.20.2-abc
    server:
      serve: "{{ lookup('template', 'vllm-serve.sh.j2') }}"
      vllm.env: "{{ lookup('template', 'vllm.env.j2') }}"
    server_group: vllm
    server_modes: {serve: "0750"}

- name: Put back exactly what was served before a rejected attempt
  mlafleet.fleet.mlafleet_release_switch:
    root: /opt/mlafleet
    release: 0.20.2-abc
    revision: 3f1c0a9b2d4e
    previous: releases/0.20.1-def/server.d/77aa01bc9e12
    reject: {release: 0.20.2-abc, revision: 9e9e01bc00aa, cause: "perf gate: TTFT p50 +3700%", run: r42}
"""

RETURN = r"""
current:
  description: What C(current) points at afterwards (in check mode, would point at).
  type: str
  returned: always
  sample: releases/0.20.2-abc
revision:
  description: The server configuration revision served afterwards, or null for a release without one.
  type: str
  returned: always
  sample: 3f1c0a9b2d4e
state:
  description: The state served afterwards, C(<release>@<revision>) (just C(<release>) without a revision).
  type: str
  returned: always
  sample: 0.20.2-abc@3f1c0a9b2d4e
before:
  description: The state served before, in the same form (null when nothing was current).
  type: str
  returned: always
previous:
  description: What C(previous) points at afterwards, or null when there is none.
  type: str
  returned: always
  sample: releases/0.20.1-def/server.d/77aa01bc9e12
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def read_link(path: str) -> str | None:
    """A symlink's target, None when there is nothing at `path`."""
    try:
        return os.readlink(path)
    except (FileNotFoundError, OSError):
        return None


def replace_link(path: str, target: str) -> None:
    """`path` -> target, written as `<path>.tmp` and renamed over the old link."""
    tmp = path + ".tmp"
    if os.path.lexists(tmp):  # left by an interrupted switch
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def revision_of(files: dict[str, bytes]) -> str:
    """The revision name of a server configuration: sha256 over its sorted names and bytes."""
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:12]


def read_dir_files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and not os.path.islink(full) and name in ("serve", "vllm.env"):
            with open(full, "rb") as f:
                out[name] = f.read()
    return out


def parse_state(target: str | None) -> tuple[str | None, str | None]:
    """(release, revision) named by a link target: `releases/<id>` or `releases/<id>/server.d/<rev>`."""
    if not target:
        return None, None
    parts = os.path.normpath(target).split(os.sep)
    if len(parts) >= 2 and parts[-2] == "server.d" and len(parts) >= 4:
        return parts[-3], parts[-1]
    return parts[-1], None


def label(release: str | None, revision: str | None) -> str | None:
    if release is None:
        return None
    return f"{release}@{revision}" if revision else release


class Host:
    """One host's release root."""

    def __init__(self, module: AnsibleModule, root: str):
        self.module, self.root = module, root

    def release_dir(self, release: str) -> str:
        return os.path.join(self.root, "releases", release)

    def revision_of_release(self, release: str, migrate: bool) -> str | None:
        """The revision a release serves with: its `server` link's target; a plain `server`
        directory (older mlafleet) is turned into a revision when `migrate`, else named by its files."""
        server = os.path.join(self.release_dir(release), "server")
        if os.path.islink(server):
            return os.path.basename(os.path.normpath(read_link(server) or "")) or None
        if not os.path.isdir(server):
            return None
        files = read_dir_files(server)
        rev = revision_of(files)
        if migrate and not self.module.check_mode:
            dest = os.path.join(self.release_dir(release), "server.d", rev)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.isdir(dest):
                shutil.copytree(server, dest, symlinks=True)
            shutil.rmtree(server)
            replace_link(server, os.path.join("server.d", rev))
        return rev

    def state_target(self, release: str, revision: str | None) -> str:
        if revision:
            return os.path.join("releases", release, "server.d", revision)
        return os.path.join("releases", release)

    def write_revision(self, release: str, files: dict[str, bytes], group: str, modes: dict[str, str]) -> str:
        rev = revision_of(files)
        dest = os.path.join(self.release_dir(release), "server.d", rev)
        if os.path.isdir(dest) or self.module.check_mode:
            return rev
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".new-", dir=parent)
        try:
            gid = self.gid(group)
            os.chmod(tmp, 0o750)
            if os.geteuid() == 0:
                os.chown(tmp, 0, gid)
            for name, data in files.items():
                path = os.path.join(tmp, name)
                with open(path, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(path, int(modes.get(name, "0640"), 8))
                if os.geteuid() == 0:
                    os.chown(path, 0, gid)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return rev

    def gid(self, group: str) -> int:
        import grp  # noqa: PLC0415 (POSIX only, like the module)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            self.module.fail_json(msg=f"group {group!r} does not exist on the host; nothing was changed")
            raise

    def reject(self, spec: dict) -> None:
        release, revision = spec.get("release"), spec.get("revision") or None
        if not release or not NAME_RE.match(release):
            self.module.fail_json(msg=f"reject: {release!r} is not a release id; nothing was changed")
        where = self.release_dir(release)
        if revision:
            where = os.path.join(where, "server.d", revision)
        if not os.path.isdir(where) or self.module.check_mode:
            return
        record = {"release": release, "revision": revision, "cause": spec.get("cause", ""),
                  "run": spec.get("run", ""), "time": time.time()}
        tmp = os.path.join(where, ".rejected.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(where, "rejected.json"))


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "root": {"type": "path", "required": True},
            "release": {"type": "str", "required": True},
            "server": {"type": "dict", "no_log": True},
            "server_group": {"type": "str", "default": "root"},
            "server_modes": {"type": "dict", "default": {}},
            "revision": {"type": "str"},
            "previous": {"type": "str"},
            "reject": {"type": "dict"},
        },
        mutually_exclusive=[("server", "revision")],
        supports_check_mode=True,
    )
    p = module.params
    root, release = p["root"], p["release"]
    if not NAME_RE.match(release):
        module.fail_json(msg=f"{release!r} is not a release id (letters, digits, '.', '_', '-')")
    if p["revision"] is not None and not NAME_RE.match(p["revision"]):
        module.fail_json(msg=f"{p['revision']!r} is not a server configuration revision")
    for name in p["server"] or {}:
        if not FILE_RE.match(name):
            module.fail_json(msg=f"{name!r} is not a plain file name for the server configuration")
    host = Host(module, root)
    current_path = os.path.join(root, "current")
    previous_path = os.path.join(root, "previous")
    if os.path.lexists(current_path) and not os.path.islink(current_path):
        module.fail_json(msg=f"{current_path} is not a symlink; nothing was changed")
    if not module.check_mode and not os.path.isdir(host.release_dir(release)):
        module.fail_json(msg=f"{host.release_dir(release)} is not a directory; nothing was changed")

    old_release, _ = parse_state(read_link(current_path))
    old_rev = host.revision_of_release(old_release, migrate=True) if old_release else None
    before = label(old_release, old_rev)

    # The revision wanted: new files, a named revision, or (neither) whatever the release has.
    if p["server"] is not None:
        files = {name: str(content).encode("utf-8") for name, content in p["server"].items()}
        revision = host.write_revision(release, files, p["server_group"], p["server_modes"])
    elif p["revision"] is not None:
        revision = p["revision"]
        if not module.check_mode and not os.path.isdir(os.path.join(host.release_dir(release), "server.d", revision)):
            module.fail_json(msg=f"release {release} has no server configuration revision {revision} "
                                 f"(under {host.release_dir(release)}/server.d); nothing was changed")
    else:
        revision = host.revision_of_release(release, migrate=True) if release != old_release else old_rev

    if p["reject"]:
        host.reject(p["reject"])

    release_rev = host.revision_of_release(release, migrate=False) if os.path.isdir(host.release_dir(release)) else None
    changed = (release != old_release) or (revision != release_rev)
    prev_before = read_link(previous_path)
    want_previous = prev_before
    if p["previous"] is not None:
        want_previous = p["previous"] or None
    elif old_release is not None and release != old_release:
        want_previous = host.state_target(old_release, old_rev)  # another release
    elif old_rev is not None and revision != old_rev:
        want_previous = host.state_target(old_release, old_rev)  # the same release, another configuration
    changed = changed or want_previous != prev_before

    if changed and not module.check_mode:
        if want_previous != prev_before:
            if want_previous is None:
                os.unlink(previous_path)
            else:
                replace_link(previous_path, want_previous)
        if revision is not None and revision != release_rev:
            replace_link(os.path.join(host.release_dir(release), "server"), os.path.join("server.d", revision))
        if release != old_release:
            replace_link(current_path, os.path.join("releases", release))
    module.exit_json(changed=changed, current=os.path.join("releases", release), revision=revision,
                     state=label(release, revision), before=before, previous=want_previous)


if __name__ == "__main__":
    main()
