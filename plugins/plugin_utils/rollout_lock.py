"""Whose lock is it, and is its run over? The controller's side of the rollout lock.

A host's lock (`mlafleet_rollout_lock`) records the run, the owner (the real user and the
controller host), the controller's host name and the controller process that lives as long as
the run (the `mlafleet` command, or ansible-playbook). On the controller that wrote it, a run is
provably over when that process is gone, or when the run's own `reports/<run>/run.json` (written
when an mlafleet run ends) exists. Anything else may still be live: another controller, a
process still running, a lock of an older mlafleet that recorded neither.

Plain Python on the controller: the action plugin (plugins/action/mlafleet_rollout_lock.py) and
`mlafleet status` import it by its collection name,
ansible_collections.mlafleet.fleet.plugins.plugin_utils.rollout_lock.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RUN_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
TAKEOVER_VAR = "rollout_lock_takeover"


def controller_host() -> str:
    return socket.gethostname()


def real_user() -> str:
    """The name of the real uid ($USER is often unset under ansible-runner, cron or CI)."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return f"uid{os.getuid()}"


def owner() -> str:
    return f"{real_user()}@{controller_host()}"


def report_root() -> Path:
    """Where mlafleet runs keep reports/<run>/ ($MLAFLEET_REPORT_ROOT, as the CLI sets it, else reports/)."""
    return Path(os.environ.get("MLAFLEET_REPORT_ROOT") or REPO / "reports")


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie runs nothing
    except (OSError, IndexError):
        return False


def run_over(lock: dict[str, Any], reports: Path | None = None) -> str | None:
    """Why the lock's run is provably over, or None when it may still be live."""
    run = str(lock.get("run") or "")
    if RUN_ID.match(run):
        path = (reports or report_root()) / run / "run.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("run") == run and ("ended" in data or "rc" in data):
            return f"its run.json {path} says it ended, exit status {data.get('rc', '?')}"
    pid = lock.get("controller_pid")
    if lock.get("controller") and lock.get("controller") == controller_host() and isinstance(pid, int) and pid > 1:
        if _process_gone(pid):
            return f"its controller process {pid} on {lock['controller']}, this machine, is gone"
    return None


def why_live(lock: dict[str, Any]) -> str:
    """Why a lock whose run is not provably over may still be live."""
    controller = lock.get("controller")
    if not controller:
        return "the lock names no controller process: taken by an older mlafleet, or by hand"
    if controller != controller_host():
        return f"its controller is {controller}, not this machine, and no run.json here says the run ended"
    return f"its controller process {lock.get('controller_pid')} on this machine is still running"


def takeover_command(run: str) -> str:
    """The command that takes over `run`'s abandoned lock: the command of this run plus the takeover.

    `mlafleet rollout|rollback` put their own command line (without --run) in $MLAFLEET_COMMAND;
    under plain ansible-playbook it is this process's command line.
    """
    base = os.environ.get("MLAFLEET_COMMAND")
    if not base:
        argv = list(sys.argv)
        name = os.path.basename(argv[0]) if argv else ""
        base = shlex.join([name if name.startswith("ansible") else "ansible-playbook", *argv[1:]])
    return f"{base} -e {TAKEOVER_VAR}={shlex.quote(run)}"
