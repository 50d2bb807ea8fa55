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
0700 and its `env/extravars` is removed when the run ends; reports are 0700/0600.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
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


class RunnerError(Exception):
    """Bad input to a run (named in the message); nothing was started."""


@dataclass
class HostState:
    """What one host went through, built from ansible-runner events."""

    host: str
    status: str = "pending"  # pending | running | ok | failed | unreachable | not reached
    play: str = ""
    task: str = ""
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
            host.task_started = host.beat = time.monotonic()
            if _action(data) not in QUIET_ACTIONS and role != host.shown_role:
                self._say(f"{host_name:<28} {role or '-':<16} {task}")
                host.shown_role = role
        elif kind in ("runner_on_ok", "runner_on_skipped", "runner_on_failed", "runner_on_unreachable"):
            host.task_started = None
        if kind == "runner_on_ok":
            if res.get("changed"):
                host.changed.append(label)
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


def finish(progress: Progress, last_play: str) -> None:
    """Final per-host status from the stats: failed, unreachable, ok, or never reached."""
    for name, host in progress.hosts.items():
        stats = progress.stats.get(name, {})
        if stats.get("dark"):
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
        return text
    return ""


def summary_text(report: dict[str, Any]) -> str:
    lines = [f"mlafleet {report['command']}  run {report['run']}  rc {report['rc']}  "
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


def run_playbook(command: str, inventories: list[Path], extravars: dict[str, Any] | None = None,
                 limit: str | None = None, run: str | None = None, out: TextIO = sys.stdout,
                 runner_root: Path | None = None, report_root: Path | None = None,
                 playbook: str | None = None, heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
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
    runner_root = runner_root or REPO / "build" / "runner"
    report_dir = (report_root or REPO / "reports") / run
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

    beater = threading.Thread(target=beat, name="mlafleet-heartbeat", daemon=True)
    beater.start()
    try:
        result = ansible_runner.run(
            private_data_dir=str(pdd), playbook=playbook, inventory=[str(i.resolve()) for i in inventories],
            ident=run, event_handler=on_event, quiet=True,
            envvars={"MLAFLEET_REPORT_ROOT": str(report_dir.parent)},  # where the report callback writes
        )
    finally:
        stop.set()
        beater.join(10)
        # The extra variables may hold secrets: they lived only as long as the run.
        (pdd / "env" / "extravars").unlink(missing_ok=True)
    finish(progress, plays[-1] if plays else "")
    collect_reports(progress, report_dir)
    report = mask({
        "command": command, "run": run, "playbook": playbook, "check": check, "limit": limit,
        "inventories": [str(i) for i in inventories], "extravars": report_extravars(extravars),
        "rc": result.rc, "status": result.status, "elapsed_s": int(time.monotonic() - progress.started),
        "private_data_dir": str(pdd), "stdout": str(pdd / "artifacts" / run / "stdout"),
        "warnings": progress.warnings,
        "hosts": [{**{k: v for k, v in asdict(h).items() if k not in ("shown_role", "task_started", "beat")},
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
                                  limit=args.limit, run=args.run)
        except RunnerError as exc:
            print(f"mlafleet {command}: {exc}", file=sys.stderr)
            return 2
        return 0 if report["rc"] == 0 else 1
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
            p.add_argument("--to", default="previous", help="release id to restore (default: previous)")
        p.set_defaults(func=_cmd(command))
