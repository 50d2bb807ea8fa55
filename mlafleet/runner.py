"""`mlafleet rollout | rollback | plan`: the playbooks run through ansible-runner.

Each run gets a private data directory in the layout AWX and automation controllers use
(`env/extravars`, `env/envvars`, `env/cmdline`, `project/` -> the repository, `artifacts/`) under
`build/runner/<run>`, a live per-host progress display fed by ansible-runner's events, and under
`reports/<run>/` a JSON report (`run.json`) plus a human summary (`summary.txt`). The playbooks'
own per-host reports (smoke test results, rollback causes) land in the same directory and are
folded into the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

REPO = Path(__file__).resolve().parent.parent

# Which playbook each command runs, and whether it runs in check mode.
COMMAND_PLAYBOOKS: dict[str, tuple[str, bool]] = {
    "rollout": ("site.yml", False),
    "plan": ("site.yml", True),
    "rollback": ("rollback.yml", False),
}


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
    plays: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None


@dataclass
class Progress:
    """Per-host state, updated event by event; prints one line per host when its step changes."""

    out: TextIO
    started: float = field(default_factory=time.monotonic)
    hosts: dict[str, HostState] = field(default_factory=dict)
    play: str = ""
    stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def _host(self, name: str) -> HostState:
        if name not in self.hosts:
            self.hosts[name] = HostState(name)
        return self.hosts[name]

    def _say(self, text: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        self.out.write(f"[{elapsed // 60:3d}:{elapsed % 60:02d}] {text}\n")
        self.out.flush()

    def handle(self, event: dict[str, Any]) -> bool:
        """ansible-runner's event_handler: keep the event (True) after updating the display."""
        kind = event.get("event", "")
        data = event.get("event_data", {}) or {}
        if kind == "playbook_on_play_start":
            self.play = data.get("play", "")
            self._say(f"== {self.play}")
            return True
        if kind == "playbook_on_stats":
            for key in ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored"):
                for host, count in (data.get(key) or {}).items():
                    self.stats.setdefault(host, {})[key] = count
            return True
        host_name = data.get("host")
        if not host_name or host_name == "localhost":  # the controller's own play
            return True
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
            if role != getattr(host, "_last_role", None):
                self._say(f"{host_name:<28} {role or '-':<16} {task}")
                host._last_role = role  # type: ignore[attr-defined]
            host.task = label
        elif kind == "runner_on_ok":
            if (data.get("res") or {}).get("changed"):
                host.changed.append(label)
        elif kind in ("runner_on_failed", "runner_item_on_failed"):
            if not data.get("ignore_errors"):
                msg = _message(data.get("res") or {})
                host.failures.append({"task": label, "msg": msg})
                self._say(f"{host_name:<28} FAILED           {label}: {msg[:160]}")
        elif kind == "runner_on_unreachable":
            msg = _message(data.get("res") or {})
            host.status = "unreachable"
            host.failures.append({"task": label, "msg": msg})
            self._say(f"{host_name:<28} UNREACHABLE      {label}: {msg[:160]}")
        return True


def _message(res: dict[str, Any]) -> str:
    msg = str(res.get("msg") or "").strip()
    stderr = str(res.get("stderr") or "").strip()
    if stderr and stderr not in msg:
        msg = f"{msg} {stderr[-400:]}".strip()
    return msg or json.dumps(res)[:400]


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
        restored = host.report.get("rolled_back_to")
        return f"{host.report['cause']}" + (f" (rolled back to {restored})" if restored else "")
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
    """`KEY=VALUE` pairs (VALUE read as YAML, so lists and numbers work) or `@file.yml`."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if item.startswith("@"):
            path = Path(item[1:])
            if not path.is_file():
                raise RunnerError(f"extra vars file {path} not found")
            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise RunnerError(f"extra vars file {path} must hold a mapping")
            out.update(data)
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise RunnerError(f"extra var {item!r} is not KEY=VALUE (or @file.yml)")
        out[key] = yaml.safe_load(value) if value else ""
    return out


def inventory_hosts(inventories: list[Path], limit: str | None) -> list[str]:
    """The inventory's host names under --limit, so hosts the run never reaches are reported too."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    inventory = InventoryManager(loader=DataLoader(), sources=[str(i) for i in inventories])
    if limit:
        inventory.subset(limit)
    return [h.name for h in inventory.get_hosts("all")]


def prepare_private_data_dir(root: Path, run: str, extravars: dict[str, Any], check: bool,
                             limit: str | None) -> Path:
    """The AWX layout: env/{extravars,envvars,cmdline,settings}, project/ -> repo, artifacts/."""
    pdd = root / run
    if pdd.exists():
        raise RunnerError(f"run {run} already has a private data directory {pdd}: pick another run id")
    (pdd / "env").mkdir(parents=True)
    (pdd / "env" / "extravars").write_text(json.dumps(extravars, indent=2, sort_keys=True) + "\n")
    envvars = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
               "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1",
               # ansible.cfg's callback_plugins, which ansible-runner's own setting would replace:
               # the mlafleet_report callback writes the timeline and the HTML report.
               "ANSIBLE_CALLBACK_PLUGINS": str(REPO / "plugins" / "callback"),
               # ansible-playbook from the same venv as mlafleet, whatever the caller's PATH.
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    (pdd / "env" / "envvars").write_text(json.dumps(envvars, indent=2, sort_keys=True) + "\n")
    # The playbooks fix the release and run ids in a play on localhost: a --limit must keep it.
    cmdline = (["--check", "--diff"] if check else []) + (["--limit", f"{limit},localhost"] if limit else [])
    (pdd / "env" / "cmdline").write_text(" ".join(cmdline) + "\n")
    (pdd / "project").symlink_to(REPO)
    return pdd


def run_playbook(command: str, inventories: list[Path], extravars: dict[str, Any] | None = None,
                 limit: str | None = None, run: str | None = None, out: TextIO = sys.stdout,
                 runner_root: Path | None = None, report_root: Path | None = None,
                 playbook: str | None = None) -> dict[str, Any]:
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
    runner_root = runner_root or REPO / "build" / "runner"
    report_dir = (report_root or REPO / "reports") / run
    pdd = prepare_private_data_dir(runner_root, run, extravars, check, limit)
    report_dir.mkdir(parents=True, exist_ok=True)

    progress = Progress(out)
    for name in inventory_hosts(inventories, limit):
        progress.hosts[name] = HostState(name)
    progress._say(f"mlafleet {command}: run {run}, {playbook}, private data dir {pdd}")
    plays: list[str] = []

    def on_event(event: dict[str, Any]) -> bool:
        if event.get("event") == "playbook_on_play_start":
            plays.append((event.get("event_data") or {}).get("play", ""))
        return progress.handle(event)

    result = ansible_runner.run(
        private_data_dir=str(pdd), playbook=playbook, inventory=[str(i.resolve()) for i in inventories],
        ident=run, event_handler=on_event, quiet=True,
        envvars={"MLAFLEET_REPORT_ROOT": str(report_dir.parent)},  # where the report callback writes
    )
    finish(progress, plays[-1] if plays else "")
    collect_reports(progress, report_dir)
    report = {
        "command": command, "run": run, "playbook": playbook, "check": check, "limit": limit,
        "inventories": [str(i) for i in inventories], "extravars": extravars,
        "rc": result.rc, "status": result.status, "elapsed_s": int(time.monotonic() - progress.started),
        "private_data_dir": str(pdd), "stdout": str(pdd / "artifacts" / run / "stdout"),
        "hosts": [{**asdict(h), "cause": cause(h) if h.status != "ok" else ""}
                  for h in sorted(progress.hosts.values(), key=lambda h: h.host)],
    }
    (report_dir / "run.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    text = summary_text(report)
    (report_dir / "summary.txt").write_text(text)
    out.write(text)
    out.write(f"report: {report_dir / 'run.json'}, summary: {report_dir / 'summary.txt'}\n")
    # perf gate / rollout report: the HTML again, now with run.json's statuses and causes.
    from mlafleet.report import render_quietly

    out.write(f"rollout report: {render_quietly(report_dir)}\n")
    return report


def _cmd(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            extravars = parse_extra_vars(args.extra_vars)
            if command == "rollback":
                extravars.setdefault("rollback_to", args.to)
            if getattr(args, "serial", None):
                extravars["mlafleet_serial"] = parse_extra_vars([f"s={args.serial}"])["s"]
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
        p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE|@FILE",
                       help="extra variables (repeatable)")
        p.add_argument("--run", help="run id (default: the UTC time); names reports/<run>")
        if command != "rollback":
            p.add_argument("--serial", help='batch sizes, e.g. 1 or "[1, 25%%]" (default [1, "100%%"])')
        else:
            p.add_argument("--to", default="previous", help="release id to restore (default: previous)")
        p.set_defaults(func=_cmd(command))
