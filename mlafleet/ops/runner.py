"""`mlafleet rollout | rollback | plan`: the playbooks run through ansible-runner.

Each run gets a private data directory in the layout AWX and automation controllers use
(`env/extravars`, `env/envvars`, `env/cmdline`, `project/` -> the repository, `artifacts/`) under
`build/runner/<run>`, a live per-host progress display fed by ansible-runner's events, and under
`reports/<run>/` a JSON report (`run.json`) plus a human summary (`summary.txt`). The playbooks'
own per-host reports (smoke test results, rollback causes) land in the same directory and are
folded into the report.

`-e` means what it means to ansible-playbook (KEY=VALUE pairs are strings, `{...}`/`[...]` is
YAML or JSON, `@FILE` a YAML or JSON file), parsed by Ansible's own functions. Secrets (variables
a role declares `no_log`, or whose names say password, token, secret or API key) never reach the
reports: their values are masked there and in the live output, the private data directory is
0700 and its `env/extravars` is removed when the run ends; reports and artifacts are 0700/0600.

SIGINT or SIGTERM (Ctrl-C) stops the run cleanly: ansible-runner's cancel stops the running
tasks, then a short cleanup (playbooks/interrupted.yml) runs over the hosts this run had locked:
it stops what the run still runs there (the steps recorded under its lock), releases each lock
this run holds (never another run's) and reads what each host serves, changing nothing else. The
report names each host's true state: ok (done), interrupted at a step (with what it still
serves), not reached. A second signal during the cleanup says what it is doing and what would be
left; a third stops it and names what is left for the operator.

Exit status (the `rc` of run.json, the summary and the HTML report): 0 every host succeeded, 1
some host failed, 2 bad input (nothing started), 128 + the signal (130 for SIGINT, 143 for
SIGTERM) when interrupted; ansible-playbook's own return code is recorded as `playbook_rc`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

REPO = Path(__file__).resolve().parents[2]

# Which playbook each command runs, and whether it runs in check mode.
COMMAND_PLAYBOOKS: dict[str, tuple[str, bool]] = {
    "rollout": ("site.yml", False),
    "plan": ("site.yml", True),
    "rollback": ("rollback.yml", False),
}

# Tasks that are bookkeeping, not work: the live display names the first real task of a role
# ("Install the pinned packages"), not "Validating arguments against arg spec main".
QUIET_ACTIONS = frozenset({
    "validate_argument_spec", "set_fact", "include_role", "import_role", "include_tasks", "import_tasks",
    "include_vars", "debug", "meta", "assert", "fail", "stat", "slurp", "mlafleet_check_vars",
})
# A host that has been on one task this long gets a heartbeat line (and again every as long).
HEARTBEAT_S = 30.0
# Variable names whose values are secrets even when no role declares them no_log.
SECRET_NAME = re.compile(r"pass(word|wd|phrase)|token|secret|api_?key|private_key(?!_file)", re.IGNORECASE)
MASK = "********"
# The cleanup after an interrupted run, and the task of it that reads what a host serves.
CLEANUP_PLAYBOOK = "playbooks/interrupted.yml"
SERVES_TASK = "Read what the host serves"
LOCK_ACTION = "mlafleet_rollout_lock"
# After a cancel, how long the tasks then in flight get to stop before the cleanup starts.
CANCEL_WAIT_S = 10.0


class RunnerError(Exception):
    """Bad input to a run (named in the message); nothing was started."""


@dataclass
class HostState:
    """What one host went through, built from ansible-runner events."""

    host: str
    status: str = "pending"  # pending | running | ok | failed | unreachable | not reached | interrupted
    play: str = ""
    task: str = ""
    # This run's lock on the host, as the lock module reported it: "held", "released" or "".
    lock: str = ""
    # An interrupted host: the step it was cut short in (or after), what it serves now, what the
    # cleanup did there.
    interrupted_at: str = ""
    serves: str = ""
    cleanup: str = ""
    changed: list[str] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plays: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    # Live display only (not in the report): the role last shown, when the current task began,
    # when its last heartbeat was printed.
    shown_role: str | None = field(default=None, repr=False)
    task_started: float | None = field(default=None, repr=False)
    beat: float = field(default=0.0, repr=False)
    action: str = field(default="", repr=False)
    role: str = field(default="", repr=False)
    last_done: str = field(default="", repr=False)


INTERNAL_FIELDS = ("shown_role", "task_started", "beat", "action", "role", "last_done")


def _action(data: dict[str, Any]) -> str:
    return str(data.get("task_action") or "").rsplit(".", 1)[-1]


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class Progress:
    """Per-host state, updated event by event, and the live display.

    One line per host when it starts the first real task of a role, a heartbeat for a host that
    has spent HEARTBEAT_S on one task, every warning, failure and unreachable host as it happens
    (the message whole), all with the elapsed time. Secret values are masked in every line.
    """

    out: TextIO
    started: float = field(default_factory=time.monotonic)
    hosts: dict[str, HostState] = field(default_factory=dict)
    play: str = ""
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)
    heartbeat_s: float = HEARTBEAT_S
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _host(self, name: str) -> HostState:
        if name not in self.hosts:
            self.hosts[name] = HostState(name)
        return self.hosts[name]

    def _say(self, text: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        text = mask(text, self.secrets).replace("\n", "\n" + " " * 10)
        self.out.write(f"[{elapsed // 60:3d}:{elapsed % 60:02d}] {text}\n")
        self.out.flush()

    def handle(self, event: dict[str, Any]) -> bool:
        """ansible-runner's event_handler: keep the event (True) after updating the display."""
        with self._lock:
            self._handle(event)
        return True

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event", "")
        data = event.get("event_data", {}) or {}
        if kind == "playbook_on_play_start":
            self.play = data.get("play", "")
            self._say(f"== {self.play}")
            return
        if kind == "playbook_on_stats":
            for key in ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored"):
                for host, count in (data.get(key) or {}).items():
                    self.stats.setdefault(host, {})[key] = count
            return
        host_name = data.get("host")
        res = data.get("res") or {}
        if kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable") and res.get("warnings"):
            for warning in res["warnings"]:
                text = str(warning)
                if text not in self.warnings:
                    self.warnings.append(text)
                    self._say(f"{host_name or '-':<28} WARNING          {text}")
                if host_name in self.hosts:
                    self.hosts[host_name].warnings.append(text)
        if not host_name or host_name == "localhost":  # the controller's own plays
            return
        host = self._host(host_name)
        task = data.get("task", "")
        role = data.get("role", "")
        label = f"{role} : {task}" if role else task
        if self.play and self.play not in host.plays:
            host.plays.append(self.play)
        host.play = self.play
        if kind == "runner_on_start":
            if host.status in ("pending", "ok"):
                host.status = "running"
            host.task = label
            host.action, host.role = _action(data), role.rsplit(".", 1)[-1]
            host.task_started = host.beat = time.monotonic()
            if _action(data) not in QUIET_ACTIONS and role != host.shown_role:
                self._say(f"{host_name:<28} {role or '-':<16} {task}")
                host.shown_role = role
        elif kind in ("runner_on_ok", "runner_on_skipped", "runner_on_failed", "runner_on_unreachable"):
            host.task_started = None
            host.last_done = label
        if kind == "runner_on_ok":
            if res.get("changed"):
                host.changed.append(label)
            if _action(data) == LOCK_ACTION:
                host.lock = _lock_state(str(res.get("msg") or ""), host.lock)
        elif kind in ("runner_on_failed", "runner_item_on_failed"):
            if not data.get("ignore_errors"):
                msg = _message(res)
                host.failures.append({"task": label, "msg": msg})
                self._say(f"{host_name:<28} FAILED           {label}: {msg}")
        elif kind == "runner_on_unreachable":
            msg = _message(res)
            host.status = "unreachable"
            host.failures.append({"task": label, "msg": msg})
            self._say(f"{host_name:<28} UNREACHABLE      {label}: {msg}")

    def heartbeat(self, now: float | None = None) -> None:
        """A line for every host that has spent heartbeat_s on its task since its last line."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for name, host in self.hosts.items():
                if host.task_started is not None and now - host.beat >= self.heartbeat_s:
                    host.beat = now
                    self._say(f"{name:<28} ...              {host.task} (still running, "
                              f"{_clock(now - host.task_started)} on this step)")


def _lock_state(msg: str, before: str) -> str:
    """This run's lock on a host after the lock module said `msg` (steps and checks leave it as it was)."""
    if msg == "taken" or msg == "already held by this run" or msg.endswith("and took it"):
        return "held"
    if msg.startswith("released") or msg == "no lock":
        return "released"
    return before


def _message(res: dict[str, Any]) -> str:
    """The whole failure message: msg, then what the module or command printed (stderr, stdout)."""
    msg = str(res.get("msg") or "").strip()
    parts = [msg] if msg else []
    for key in ("stderr", "module_stderr", "stdout", "module_stdout"):
        text = str(res.get(key) or "").strip()
        if text and text not in msg and (key.endswith("stderr") or not parts[1:]):
            parts.append(text[-2000:])
    if "Make sure this host can be reached over ssh" in msg and msg.endswith(":"):
        parts.append("(ssh said nothing more: the connection dropped, e.g. the host stopped or lost its network)")
    return " ".join(parts) if parts else json.dumps(res)[:2000]


def mask(value: Any, secrets: list[str]) -> Any:
    """`value` with every secret string replaced by MASK, through dicts, lists and strings."""
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, MASK)
        return value
    if isinstance(value, dict):
        return {k: mask(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask(v, secrets) for v in value]
    return value


@functools.cache
def no_log_variables() -> frozenset[str]:
    """The variables some role (or playbook) declares no_log in its argument specs."""
    from ansible_collections.mlafleet.fleet.plugins.plugin_utils.check_vars import declared_variables

    return frozenset(n for n, o in declared_variables(REPO).items() if o.get("no_log"))


def is_secret(name: str) -> bool:
    return name in no_log_variables() or bool(SECRET_NAME.search(name))


def secret_values(extravars: dict[str, Any]) -> list[str]:
    """Every string under a secret variable (nested too), longest first, so masks do not overlap."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            if len(value) >= 4:
                found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif value is not None and not isinstance(value, bool) and len(str(value)) >= 4:
            found.append(str(value))

    def scan(value: Any) -> None:
        if isinstance(value, dict):
            for key, v in value.items():
                (walk if is_secret(str(key)) else scan)(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                scan(v)

    scan(extravars)
    return sorted(set(found), key=len, reverse=True)


def finish(progress: Progress, last_play: str, interrupted: bool = False) -> None:
    """Final per-host status from the stats: failed, unreachable, ok, or never reached.

    An interrupted run has no stats: a host that was in the middle of a task, or that still held
    this run's lock (its part of the run unfinished), was interrupted at that task (or after the
    last one it finished); the others are unreachable, failed, ok (done) or not reached, from what
    their events said.
    """
    for name, host in progress.hosts.items():
        stats = progress.stats.get(name, {})
        if interrupted:
            if host.status == "unreachable":
                pass
            elif host.task_started is not None or host.lock == "held":
                host.status = "interrupted"
                host.interrupted_at = host.task if host.task_started is not None else f"after {host.last_done}"
            elif host.failures:
                host.status = "failed"
            elif not host.plays or (last_play and last_play not in host.plays):
                host.status = "not reached"
            else:
                host.status = "ok"
        elif stats.get("dark"):
            host.status = "unreachable"
        elif stats.get("failures"):
            host.status = "failed"
        elif not host.plays or (last_play and last_play not in host.plays):
            host.status = "not reached"
        else:
            host.status = "ok"


def collect_reports(progress: Progress, report_dir: Path) -> None:
    for name, host in progress.hosts.items():
        path = report_dir / f"{name}.json"
        if path.is_file():
            try:
                host.report = json.loads(path.read_text())
            except ValueError as exc:
                host.report = {"error": f"unreadable report {path}: {exc}"}


def cause(host: HostState) -> str:
    """The reason a host did not finish, as one line."""
    if host.status == "interrupted":
        parts = [f"interrupted at {host.interrupted_at}" if not host.interrupted_at.startswith("after ")
                 else f"interrupted {host.interrupted_at}"]
        if host.serves:
            parts.append(host.serves)
        if host.cleanup:
            parts.append(host.cleanup)
        return "; ".join(parts)
    if host.report and host.report.get("ok") is False and host.report.get("cause"):
        restored, error = host.report.get("rolled_back_to"), host.report.get("rollback_error")
        return (f"{host.report['cause']}" + (f" (rolled back to {restored})" if restored else "")
                + (f"; rollback failed: {error}" if error else ""))
    if host.failures:
        last = host.failures[-1]
        first = host.failures[0]
        text = f"{last['task']}: {last['msg']}"
        if first is not last:
            text = f"{first['task']}: {first['msg']} -> {text}"
        if host.cleanup:
            text += f"; {host.cleanup}"
        return text
    return host.cleanup


def exit_line(report: dict[str, Any]) -> str:
    """The exit status the CLI returns, with ansible-playbook's own return code named as such."""
    text = f"exit {report['rc']}"
    interrupted = report.get("interrupted")
    if interrupted:
        return text + f" (interrupted by {interrupted['signal']}; ansible-playbook canceled)"
    if report.get("playbook_rc") is not None and report["playbook_rc"] != report["rc"]:
        text += f" (ansible-playbook rc {report['playbook_rc']})"
    return text


def summary_text(report: dict[str, Any]) -> str:
    lines = [f"mlafleet {report['command']}  run {report['run']}  {exit_line(report)}  "
             f"status {report['status']}  {report['elapsed_s']} s",
             f"playbook {report['playbook']}{'  (check mode: nothing changed)' if report['check'] else ''}"]
    for host in report["hosts"]:
        line = f"  {host['host']:<28} {host['status']:<12}"
        release = (host.get("report") or {}).get("release")
        if host["status"] == "ok" and release:
            line += f" release {release}"
        if report["check"] and host["changed"]:
            line += f" would change {len(host['changed'])}: " + "; ".join(host["changed"][:8])
        if host["cause"]:
            line += f" {host['cause']}"
        lines.append(line.rstrip())
    failed = [h["host"] for h in report["hosts"] if h["status"] in ("failed", "unreachable")]
    if failed:
        lines.append(f"failed hosts: {', '.join(failed)}")
    cut = [h["host"] for h in report["hosts"] if h["status"] == "interrupted"]
    if cut:
        lines.append(f"interrupted hosts: {', '.join(cut)}")
    left = (report.get("interrupted") or {}).get("left") or []
    if left:
        lines.append("left for you: " + "; ".join(left))
    return "\n".join(lines) + "\n"


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def parse_extra_vars(items: list[str]) -> dict[str, Any]:
    """What ansible-playbook makes of its `-e` options, parsed by Ansible's own functions.

    `KEY=VALUE [KEY=VALUE ...]` gives strings (`vllm_install_version=0.20` stays "0.20"),
    `{...}` or `[...]` is YAML/JSON, `@FILE` a YAML/JSON file; later options win, key by key.
    Raises RunnerError naming an option Ansible would refuse or silently misread.
    """
    from ansible.errors import AnsibleError
    from ansible.parsing.dataloader import DataLoader
    from ansible.parsing.splitter import parse_kv
    from ansible.utils.vars import combine_vars

    loader = DataLoader()
    out: dict[str, Any] = {}
    for item in items:
        if not item:
            continue
        try:
            if item.startswith("@"):
                path = Path(item[1:]).expanduser()
                if not path.is_file():
                    raise RunnerError(f"extra vars file {path} not found")
                data = loader.load_from_file(str(path.resolve()))
            elif item[0] in "/.":
                raise RunnerError(f"extra vars {item!r}: prepend a file name with '@'")
            elif item[0] in "[{":
                data = loader.load(item)
            else:
                data = parse_kv(item)
                if "_raw_params" in data:
                    raise RunnerError(f"extra var {item!r} is not KEY=VALUE, YAML/JSON or @FILE")
        except AnsibleError as exc:
            raise RunnerError(f"extra vars {item!r}: {exc.message}") from None
        if not isinstance(data, dict):
            raise RunnerError(f"extra vars {item!r} is not a mapping of variables")
        out = combine_vars(out, data)
    return json.loads(json.dumps(out, default=str))  # plain types: Ansible tags its values


def parse_serial(text: str) -> Any:
    """--serial: a YAML value (`1`, `"25%"`, `[1, "25%"]`), as the play keyword takes it."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RunnerError(f"--serial {text!r} is not a batch size or list of them: {exc}") from None


def inventory_hosts(inventories: list[Path], limit: str | None) -> list[str]:
    """The inventory's host names under --limit, so hosts the run never reaches are reported too."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    inventory = InventoryManager(loader=DataLoader(), sources=[str(i) for i in inventories])
    if limit:
        inventory.subset(limit)
    return [h.name for h in inventory.get_hosts("all")]


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def prepare_private_data_dir(root: Path, run: str, extravars: dict[str, Any], check: bool,
                             limit: str | None) -> Path:
    """The AWX layout: env/{extravars,envvars,cmdline}, project/ -> repo, artifacts/; 0700, files 0600."""
    pdd = root / run
    if pdd.exists():
        raise RunnerError(f"run {run} already has a private data directory {pdd}: pick another run id")
    root.mkdir(parents=True, exist_ok=True)
    pdd.mkdir(mode=0o700)
    os.chmod(pdd, 0o700)  # whatever the umask: extravars may hold secrets while the run lasts
    (pdd / "env").mkdir(mode=0o700)
    _write_private(pdd / "env" / "extravars", json.dumps(extravars, indent=2, sort_keys=True) + "\n")
    envvars = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
               "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1",
               # ansible.cfg's callback_plugins, which ansible-runner's own setting would replace:
               # the mlafleet_report callback writes the timeline and the HTML report.
               "ANSIBLE_CALLBACK_PLUGINS": str(REPO / "plugins" / "callback"),
               # ansible-playbook from the same venv as mlafleet, whatever the caller's PATH.
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    _write_private(pdd / "env" / "envvars", json.dumps(envvars, indent=2, sort_keys=True) + "\n")
    # The playbooks fix the release and run ids in a play on localhost: a --limit must keep it.
    cmdline = (["--check", "--diff"] if check else []) + (["--limit", f"{limit},localhost"] if limit else [])
    _write_private(pdd / "env" / "cmdline", " ".join(cmdline) + "\n")
    (pdd / "project").symlink_to(REPO)
    return pdd


def report_extravars(extravars: dict[str, Any]) -> dict[str, Any]:
    """The extra variables as run.json records them: a secret variable's value is masked."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (MASK if is_secret(str(k)) else clean(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value
    return clean(extravars)


class Interrupts:
    """SIGINT / SIGTERM during a run: recorded by the handler, acted on by ansible-runner's cancel callback.

    The handler only records the signal (printing from a signal handler could interleave with a
    line being written); `poll`, which ansible-runner calls about once a second from its loop,
    announces it and says whether to cancel. During the run, the first signal cancels it (later
    ones only repeat that it is stopping). During the cleanup, the first signal says what the
    cleanup is still doing and what would be left; the second stops the cleanup.
    """

    def __init__(self, progress: Progress, run: str) -> None:
        self.progress, self.run = progress, run
        self.signal: int | None = None
        self.pending: list[int] = []
        self.phase = "run"
        self.cleanup_hosts: list[str] = []
        self.cleaned: dict[str, str] = {}
        self.cleanup_signals = 0
        self.abort_cleanup = False
        self.cleanup_started = 0.0
        self.announced = False
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; ansible-runner's own cancel stays off
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handler(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.pending.append(signum)
        if self.signal is None:
            self.signal = signum

    def left(self) -> list[str]:
        """What the cleanup has not done (yet): the hosts whose lock of this run may still be there."""
        return [h for h in self.cleanup_hosts if h not in self.cleaned]

    def poll(self) -> bool:
        while self.pending:
            signum = self.pending.pop(0)
            name = signal.Signals(signum).name
            if self.phase == "run":
                if not self.announced:
                    self.announced = True
                    self.progress._say(f"interrupted ({name}): stopping the running tasks (ansible-runner cancel), "
                                       "then releasing this run's locks on the hosts it locked")
                else:
                    self.progress._say(f"{name}: already stopping; the cleanup of the hosts this run locked follows")
                continue
            self.cleanup_signals += 1
            doing = ", ".join(self.left()) or "nothing more"
            if self.cleanup_signals == 1:
                self.progress._say(
                    f"{name}: the cleanup is still running ({int(time.monotonic() - self.cleanup_started)} s): "
                    f"stopping what run {self.run} still runs and releasing its locks on: {doing}. "
                    f"Interrupt again to stop the cleanup now; left for you then: {self.left_text()}")
            else:
                self.abort_cleanup = True
                self.progress._say(f"{name}: stopping the cleanup; left for you: {self.left_text()}")
        return self.abort_cleanup if self.phase == "cleanup" else self.signal is not None

    def left_text(self) -> str:
        hosts = self.left()
        if not hosts:
            return "nothing"
        return (f"the lock of run {self.run} on {', '.join(hosts)} (unless the release in flight still finishes), "
                "and whatever the run still runs there; `mlafleet status` shows such a lock as abandoned once this "
                "command has exited, and the next rollout's refusal prints the command that takes it over "
                f"(-e rollout_lock_takeover={self.run})")


def _private_tree(*roots: Path) -> None:
    """Files 0600 and directories 0700 under each root (ansible-runner writes its artifacts 0644)."""
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            os.chmod(dirpath, 0o700)
            for name in filenames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o600)


def _serves(lines: list[str]) -> str:
    """What a host serves, from the cleanup's read of `current` and the running server's release."""
    current = lines[0].rsplit("/", 1)[-1] if lines and lines[0] not in ("", "none") else None
    server = lines[1] if len(lines) > 1 and lines[1] not in ("", "none") else None
    if server and (server == current or current is None):
        return f"serves {server}"
    if server:
        return (f"serves {server}, but current points at {current}: a restart would serve {current} "
                f"(roll back with `mlafleet rollback --to {server}`, or roll out again)")
    return f"no server running; current release {current or 'none'}"


def _orphaned_workers() -> list[int]:
    """ansible-playbook processes of this run still alive after the cancel: its workers.

    ansible-runner's cancel kills ansible-playbook's process group, but Ansible's workers run in
    sessions of their own and finish the task they were running. They carry this process's pid in
    $MLAFLEET_CONTROLLER_PID (set for the run). Linux (/proc) only; elsewhere none are found.
    """
    marker = f"MLAFLEET_CONTROLLER_PID={os.getpid()}".encode()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in env and b"ansible-playbook" in cmdline and state not in (b"Z", b"X"):
            found.append(int(name))
    return found


def wait_for_tasks_in_flight(progress: Progress, timeout: float = CANCEL_WAIT_S) -> None:
    """Let the tasks that were running when the run was canceled stop (up to `timeout` seconds).

    A host in a step recorded under its lock (the pip install) is not waited for: that step ends
    only when the cleanup stops it.
    """
    in_flight = {n: h for n, h in progress.hosts.items() if h.task_started is not None}
    # The lock module outside the rollout_lock role's own task runs a step (vllm_install's install).
    steps = [n for n, h in in_flight.items() if h.action == LOCK_ACTION and h.role != "rollout_lock"]
    others = sorted(set(in_flight) - set(steps))
    if not others or len(_orphaned_workers()) <= len(steps):
        return
    progress._say("waiting up to %d s for the tasks in flight to stop: %s" % (
        timeout, ", ".join(f"{n} ({in_flight[n].task})" for n in others)))
    deadline = time.monotonic() + timeout
    while len(_orphaned_workers()) > len(steps) and time.monotonic() < deadline:
        time.sleep(0.2)


def cleanup_interrupted(progress: Progress, interrupts: Interrupts, pdd: Path, run: str,
                        inventories: list[Path], extravars: dict[str, Any]) -> str:
    """Release this run's locks on the hosts it locked and read what each serves; return the cleanup's status."""
    import ansible_runner

    hosts = [n for n, h in sorted(progress.hosts.items())
             if h.lock == "held" or (h.task_started is not None and h.action == LOCK_ACTION)]
    interrupts.cleanup_hosts = hosts
    if not hosts:
        progress._say("cleanup: this run holds no lock on any host; nothing to release")
        return "nothing to clean"
    interrupts.phase = "cleanup"
    interrupts.cleanup_started = time.monotonic()
    progress._say(f"cleanup: stopping what run {run} still runs and releasing its locks on {', '.join(hosts)}")
    variables = {k: v for k, v in extravars.items() if k != "mlafleet_run"}  # no report of its own
    variables.update(rollout_lock_run=run, rollout_lock_state="absent", rollout_lock_keep_others=True)
    cpdd = prepare_private_data_dir(pdd, "cleanup", variables, False, ",".join(hosts))

    def on_event(event: dict[str, Any]) -> bool:
        data = event.get("event_data") or {}
        name, res = data.get("host"), data.get("res") or {}
        host = progress.hosts.get(name) if name else None
        kind = event.get("event")
        if host is None:
            return True
        if kind == "runner_on_ok" and _action(data) == LOCK_ACTION:
            msg = str(res.get("msg") or "")
            host.lock = _lock_state(msg, host.lock)
            if msg.startswith("released"):
                host.cleanup = "cleanup: " + msg.replace("released", "lock released", 1)
            elif msg == "no lock":
                host.cleanup = "cleanup: no lock of this run was left"
            else:
                host.cleanup = f"cleanup: {msg}"
            interrupts.cleaned[name] = host.cleanup
            progress._say(f"{name:<28} {host.cleanup}")
        elif kind == "runner_on_ok" and data.get("task") == SERVES_TASK:
            host.serves = _serves([str(x).strip() for x in res.get("stdout_lines") or []])
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            what = "unreachable" if kind == "runner_on_unreachable" else "failed"
            host.cleanup = f"cleanup {what}, lock kept: {_message(res)}"
            progress._say(f"{name:<28} {host.cleanup}")
        return True

    try:
        result = ansible_runner.run(
            private_data_dir=str(cpdd), playbook=str(REPO / CLEANUP_PLAYBOOK),
            inventory=[str(i.resolve()) for i in inventories], ident=f"{run}-cleanup", event_handler=on_event,
            quiet=True, cancel_callback=interrupts.poll, settings={"pexpect_timeout": 1},
            envvars={"MLAFLEET_CONTROLLER_PID": str(os.getpid())})
    finally:
        (cpdd / "env" / "extravars").unlink(missing_ok=True)
    for name in interrupts.left():
        host = progress.hosts[name]
        if not host.cleanup:
            host.cleanup = ("cleanup stopped before it confirmed the release: the lock may be left"
                            if interrupts.abort_cleanup else "cleanup did not reach it: the lock may be left")
    return "stopped" if interrupts.abort_cleanup else ("done" if result.rc == 0 else "failed")


def command_line_of(command: str, args: argparse.Namespace) -> list[str]:
    """The mlafleet command as the operator gave it, without --run (a next run needs an id of its own)."""
    line = ["mlafleet", command]
    for inv in args.inventory:
        line += ["-i", inv]
    if args.limit:
        line += ["--limit", args.limit]
    for item in args.extra_vars:
        line += ["-e", item]
    if getattr(args, "serial", None):
        line += ["--serial", args.serial]
    if command == "rollback" and args.to != "previous":
        line += ["--to", args.to]
    if getattr(args, "playbook", None):
        line += ["--playbook", args.playbook]
    return line


def run_playbook(command: str, inventories: list[Path], extravars: dict[str, Any] | None = None,
                 limit: str | None = None, run: str | None = None, out: TextIO | None = None,
                 runner_root: Path | None = None, report_root: Path | None = None,
                 playbook: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 command_line: list[str] | None = None) -> dict[str, Any]:
    """Run one command's playbook through ansible-runner; return (and write) the report."""
    import ansible_runner

    if command not in COMMAND_PLAYBOOKS:
        raise RunnerError(f"unknown command {command!r} (one of {', '.join(COMMAND_PLAYBOOKS)})")
    default_playbook, check = COMMAND_PLAYBOOKS[command]
    playbook = playbook or default_playbook
    if not (REPO / playbook).is_file():
        raise RunnerError(f"playbook {playbook} not found in {REPO}")
    if not inventories:
        raise RunnerError("no inventory given (-i PATH)")
    for inv in inventories:
        if not inv.exists():
            raise RunnerError(f"inventory {inv} not found")
    run = run or new_run_id()
    if not run.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise RunnerError(f"run id {run!r} may hold only letters, digits, '.', '_', '-'")
    extravars = {**(extravars or {}), "mlafleet_run": run}
    secrets = secret_values(extravars)
    out = out or sys.stdout
    runner_root = runner_root or Path(os.environ.get("MLAFLEET_RUNNER_ROOT") or REPO / "build" / "runner")
    report_dir = (report_root or Path(os.environ.get("MLAFLEET_REPORT_ROOT") or REPO / "reports")) / run
    pdd = prepare_private_data_dir(runner_root, run, extravars, check, limit)
    report_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(report_dir, 0o700)

    progress = Progress(out, secrets=secrets, heartbeat_s=heartbeat_s)
    for name in inventory_hosts(inventories, limit):
        progress.hosts[name] = HostState(name)
    progress._say(f"mlafleet {command}: run {run}, {playbook}, private data dir {pdd}")
    plays: list[str] = []

    def on_event(event: dict[str, Any]) -> bool:
        if event.get("event") == "playbook_on_play_start":
            plays.append((event.get("event_data") or {}).get("play", ""))
        return progress.handle(event)

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(5.0, heartbeat_s)):
            progress.heartbeat()

    # What the playbooks' controller side needs: where the report callback writes, the process that
    # lives as long as the run (recorded in each host's lock), and the command (a refused lock
    # prints it, plus the takeover). Secret values never reach the command.
    envvars = {"MLAFLEET_REPORT_ROOT": str(report_dir.parent), "MLAFLEET_CONTROLLER_PID": str(os.getpid())}
    if command_line:
        envvars["MLAFLEET_COMMAND"] = mask(shlex.join(command_line), secrets)
    interrupts = Interrupts(progress, run)
    interrupts.install()
    beater = threading.Thread(target=beat, name="mlafleet-heartbeat", daemon=True)
    beater.start()
    cleanup_status = None
    try:
        try:
            result = ansible_runner.run(
                private_data_dir=str(pdd), playbook=playbook, inventory=[str(i.resolve()) for i in inventories],
                ident=run, event_handler=on_event, quiet=True, envvars=envvars,
                cancel_callback=interrupts.poll, settings={"pexpect_timeout": 1})
        finally:
            stop.set()
            beater.join(10)
            # The extra variables may hold secrets: they lived only as long as the run.
            (pdd / "env" / "extravars").unlink(missing_ok=True)
        canceled = result.status == "canceled"
        finish(progress, plays[-1] if plays else "", interrupted=canceled)
        if canceled:
            wait_for_tasks_in_flight(progress)
            cleanup_status = cleanup_interrupted(progress, interrupts, pdd, run, inventories, extravars)
    finally:
        interrupts.restore()
    collect_reports(progress, report_dir)
    if canceled:
        signum = interrupts.signal or signal.SIGINT
        rc = 128 + signum
        status = "interrupted"
    else:
        rc = 0 if result.rc == 0 else 1
        status = result.status
    report = mask({
        "command": command, "run": run, "playbook": playbook, "check": check, "limit": limit,
        "inventories": [str(i) for i in inventories], "extravars": report_extravars(extravars),
        "rc": rc, "playbook_rc": result.rc, "status": status,
        "elapsed_s": int(time.monotonic() - progress.started), "ended": time.time(),
        "private_data_dir": str(pdd), "stdout": str(pdd / "artifacts" / run / "stdout"),
        "warnings": progress.warnings,
        "interrupted": {"signal": signal.Signals(interrupts.signal or signal.SIGINT).name,
                        "cleanup": cleanup_status, "cleanup_hosts": interrupts.cleanup_hosts,
                        "left": ([interrupts.left_text()] if interrupts.left() else [])} if canceled else None,
        "hosts": [{**{k: v for k, v in asdict(h).items() if k not in INTERNAL_FIELDS},
                   "cause": cause(h) if h.status != "ok" else ""}
                  for h in sorted(progress.hosts.values(), key=lambda h: h.host)],
    }, secrets)
    _write_private(report_dir / "run.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    text = summary_text(report)
    _write_private(report_dir / "summary.txt", text)
    out.write(text)
    out.write(f"report: {report_dir / 'run.json'}, summary: {report_dir / 'summary.txt'}\n")
    # perf gate / rollout report: the HTML again, now with run.json's statuses and causes.
    from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report import render_quietly

    out.write(f"rollout report: {render_quietly(report_dir)}\n")
    _private_tree(pdd, report_dir)
    return report


def _cmd(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            extravars = parse_extra_vars(args.extra_vars)
            if command == "rollback":
                extravars.setdefault("rollback_to", args.to)
            if getattr(args, "serial", None):
                extravars["mlafleet_serial"] = parse_serial(args.serial)
            report = run_playbook(command, [Path(i) for i in args.inventory], extravars,
                                  limit=args.limit, run=args.run,
                                  playbook=str(Path(args.playbook).resolve()) if args.playbook else None,
                                  command_line=command_line_of(command, args))
        except RunnerError as exc:
            print(f"mlafleet {command}: {exc}", file=sys.stderr)
            return 2
        return int(report["rc"])  # the exit status the summary and the HTML report print
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    helps = {"rollout": "roll out the release batch by batch (site.yml through ansible-runner)",
             "plan": "what a rollout would change (site.yml in check mode)",
             "rollback": "switch hosts back to the previous release, or to a named one (rollback.yml)"}
    for command, text in helps.items():
        p = subparsers.add_parser(command, help=text, description=text)
        p.add_argument("-i", "--inventory", action="append", required=True, help="inventory path (repeatable)")
        p.add_argument("-l", "--limit", help="limit to these hosts (Ansible pattern)")
        p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE|YAML|@FILE",
                       help="extra variables, as ansible-playbook reads them (repeatable)")
        p.add_argument("--run", help="run id (default: the UTC time); names reports/<run>")
        if command != "rollback":
            p.add_argument("--serial", help='batch sizes, e.g. 1 or "[1, 25%%]" (default [1, "100%%"])')
        else:
            # one backend at a time keeps a front door serving through a rollback (docs/front-door.md)
            p.add_argument("--serial", help='batch sizes, e.g. 1 (default "100%%": every host at once)')
            p.add_argument("--to", default="previous", help="release id to restore (default: previous)")
        p.add_argument("--playbook", help=f"run this playbook instead of {COMMAND_PLAYBOOKS[command][0]} (a playbook "
                                          "of your own that uses the collection's roles), with the same progress, "
                                          "reports and Ctrl-C cleanup")
        p.set_defaults(func=_cmd(command))
