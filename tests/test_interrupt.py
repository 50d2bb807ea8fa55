"""Ctrl-C during `mlafleet rollout` (issue 46), for real.

A real `mlafleet rollout` process (python -m mlafleet.cli, its own process group, like a command
in a terminal) runs a playbook of the rollout's shape through ansible-runner against two
local-connection scratch hosts: take the host's lock, run the install as a step recorded under it,
release the lock in any case; serial 1, so h2 waits for h1. The "install" is a real process tree
that keeps writing into the new release's directory. While h1 is in it, the test sends SIGINT to
the command's process group, as a terminal's Ctrl-C does, and checks what the command did about
it, what it reported and what it left on the hosts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlafleet.ops import runner
from ansible_collections.mlafleet.fleet.plugins.plugin_utils import rollout_lock as lockinfo

WRITER = r"""
import os, signal, subprocess, sys, time
target, marker, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if stubborn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(marker + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(marker + ".tmp", marker)
i = 0
while True:
    os.makedirs(os.path.join(target, "venv", "lib"), exist_ok=True)
    with open(os.path.join(target, "venv", "lib", f"f{i % 40}"), "w") as f:
        f.write("x" * 4096)
    i += 1
    time.sleep(0.01)
"""

# The shape of playbooks/rollout.yml, reduced to what Ctrl-C is about.
PLAY = """
- name: Roll out vLLM
  hosts: all
  gather_facts: false
  serial: 1
  vars:
    mlafleet_run_id: "{{ mlafleet_run }}"
  tasks:
    - name: Take this host's rollout lock
      ansible.builtin.include_role:
        name: rollout_lock
    - name: Install; release the lock in any case
      block:
        - name: Switch current to the new release
          ansible.builtin.shell: >-
            touch {{ marker }}.switching && sleep 3 &&
            ln -sfn releases/rel-b {{ vllm_install_root }}/current.tmp && mv -T {{ vllm_install_root }}/current.tmp
            {{ vllm_install_root }}/current
          when: switch | default(false) | bool
        - name: Install the pinned packages
          mlafleet.fleet.mlafleet_rollout_lock:
            path: "{{ rollout_lock_path }}"
            state: run
            run: "{{ mlafleet_run }}"
            step: install
            argv: "{{ [python, writer, vllm_install_root ~ '/releases/' ~ mlafleet_run, marker, stubborn | default('0')]
                      if slow | default(false) | bool else ['true'] }}"
      always:
        - name: Release this host's rollout lock
          ansible.builtin.include_role:
            name: rollout_lock
          vars:
            rollout_lock_state: absent
"""


@pytest.fixture()
def fleet(tmp_path: Path) -> dict[str, Path]:
    for host in ("h1", "h2"):
        for name in ("rel-a", "rel-b"):
            release = tmp_path / host / "releases" / name
            (release / "venv" / "bin").mkdir(parents=True)
            (release / "release.json").write_text(json.dumps({"id": name}))
        os.symlink("releases/rel-a", tmp_path / host / "current")
    (tmp_path / "writer.py").write_text(WRITER)
    (tmp_path / "play.yml").write_text(PLAY)
    inv = tmp_path / "inventory.yml"
    inv.write_text(
        "all:\n  vars:\n    ansible_connection: local\n    ansible_become: false\n"
        f"    ansible_python_interpreter: {sys.executable}\n    python: {sys.executable}\n"
        f"    writer: {tmp_path / 'writer.py'}\n    marker: {tmp_path / 'writer.pids'}\n"
        f"    vllm_install_root: \"{tmp_path}/{{{{ inventory_hostname }}}}\"\n"
        f"    rollout_lock_path: \"{tmp_path}/{{{{ inventory_hostname }}}}/.lock\"\n"
        "    rollout_lock_stop_grace: 3\n"
        "  hosts:\n    h1: {}\n    h2: {}\n")
    return {"root": tmp_path, "inventory": inv, "reports": tmp_path / "reports"}


def env(fleet: dict[str, Path]) -> dict[str, str]:
    path = os.pathsep.join([str(runner.REPO), str(runner.REPO / "collections"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "ANSIBLE_CONFIG": str(runner.REPO / "ansible.cfg"),
            "MLAFLEET_REPORT_ROOT": str(fleet["reports"]), "MLAFLEET_RUNNER_ROOT": str(fleet["root"] / "runner")}


class Cli:
    """`mlafleet <args>` in a process group of its own, its output in a file."""

    def __init__(self, fleet: dict[str, Path], args: list[str]) -> None:
        self.log = fleet["root"] / f"cli-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "mlafleet.cli", *args], cwd=runner.REPO, env=env(fleet),
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, what: str | Path, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (what.exists() if isinstance(what, Path) else what in self.output()):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"waiting for {what}:\n{self.output()}"
            time.sleep(0.1)

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        os.killpg(self.proc.pid, sig)  # SIGINT: what a terminal's Ctrl-C does

    def exit(self, timeout: float = 180) -> int:
        return self.proc.wait(timeout)


def rollout(fleet: dict[str, Path], run: str, *extra: str) -> Cli:
    return Cli(fleet, ["rollout", "-i", str(fleet["inventory"]), "--playbook", str(fleet["root"] / "play.yml"),
                       "--run", run, "-e", "slow=true", *extra])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_releases_the_locks_names_the_cut_host_and_the_next_run_goes_on(fleet, sig):
    marker, h1 = fleet["root"] / "writer.pids", fleet["root"] / "h1"
    name = signal.Signals(sig).name
    cli = rollout(fleet, "p23")
    pids: list[int] = []
    try:
        cli.wait_for(marker)
        pids = [int(p) for p in marker.read_text().split()]
        assert json.loads((h1 / ".lock").read_text())["run"] == "p23"
        cli.interrupt(sig)
        assert cli.exit() == 128 + sig, cli.output()
        out = cli.output()
        # 1. The running tasks were stopped, then this run's lock released after its install was stopped.
        assert f"interrupted ({name}): stopping the running tasks" in out
        assert "cleanup: stopping what run p23 still runs and releasing its locks on h1" in out
        assert re.search(rf"h1 +cleanup: lock released after stopping install of run p23 \(pid {pids[0]}", out), out
        assert not (h1 / ".lock").exists() and not (h1 / ".lock.steps").exists()
        assert all(gone(p) for p in pids)
        assert not (fleet["root"] / "h2" / ".lock").exists()
        # Nothing switched: h1 still serves (here: points at) what it did.
        assert os.readlink(h1 / "current") == "releases/rel-a"
        # 2. Every host's true state, in the summary, run.json and the HTML report; one exit status.
        summary = out[out.index("mlafleet rollout  run p23"):]
        assert summary.startswith(f"mlafleet rollout  run p23  exit {128 + sig} (interrupted by {name}; ansible-playbook canceled)")
        assert re.search(r"\n  h1 +interrupted +interrupted at Install the pinned packages; "
                         r"no server running; current release rel-a; cleanup: lock released", summary), summary
        assert re.search(r"\n  h2 +not reached\n", summary), summary
        assert " ok " not in summary
        report = json.loads((fleet["reports"] / "p23" / "run.json").read_text())
        assert report["rc"] == 128 + sig and report["playbook_rc"] == 254 and report["status"] == "interrupted"
        assert report["interrupted"]["signal"] == name and report["interrupted"]["cleanup"] == "done"
        hosts = {h["host"]: h for h in report["hosts"]}
        assert hosts["h1"]["status"] == "interrupted" and hosts["h1"]["interrupted_at"] == "Install the pinned packages"
        assert hosts["h1"]["serves"] == "no server running; current release rel-a" and hosts["h1"]["lock"] == "released"
        assert hosts["h2"]["status"] == "not reached"
        html = (fleet["reports"] / "p23" / "index.html").read_text()
        assert f"exit status {128 + sig} (interrupted by {name}; ansible-playbook canceled)" in html
        row = re.search(r'<tr id="row-h1">(.*?)</tr>', html, re.S).group(1)
        assert ">interrupted</span>" in row and "interrupted at Install the pinned packages" in row
        # 4. The cut run's half-installed release is left for the next run to remove, as before.
        assert (h1 / "releases" / "p23").is_dir()

        # The next run is not blocked: it takes the lock, installs and releases it.
        nxt = rollout(fleet, "p24", "-e", "slow=false")
        assert nxt.exit() == 0, nxt.output()
        assert not (h1 / ".lock").exists()
    finally:
        kill_all(pids)
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)


def test_a_task_in_flight_finishes_before_the_cleanup_reads_the_host(fleet):
    """ansible-runner's cancel kills ansible-playbook, not the task its worker is running: the
    cleanup waits for that task, so what it reports is what the host is left with."""
    h1 = fleet["root"] / "h1"
    cli = rollout(fleet, "p60", "-e", "switch=true", "-e", "slow=false")
    try:
        cli.wait_for(fleet["root"] / "writer.pids.switching")
        cli.interrupt()
        assert cli.exit() == 130, cli.output()
        out = cli.output()
        assert "waiting up to 10 s for the tasks in flight to stop: h1 (Switch current to the new release)" in out
        assert os.readlink(h1 / "current") == "releases/rel-b"  # the switch in flight finished
        summary = out[out.index("mlafleet rollout  run p60"):]
        assert re.search(r"\n  h1 +interrupted +interrupted at Switch current to the new release; "
                         r"no server running; current release rel-b; cleanup: lock released", summary), summary
        assert not (h1 / ".lock").exists()
    finally:
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)


def test_a_second_ctrl_c_says_what_the_cleanup_does_and_what_is_left(fleet):
    """The install ignores SIGTERM: its stop takes the grace period, long enough to interrupt the cleanup."""
    marker, h1 = fleet["root"] / "writer.pids", fleet["root"] / "h1"
    cli = rollout(fleet, "p30", "-e", "stubborn=1")
    pids: list[int] = []
    try:
        cli.wait_for(marker)
        pids = [int(p) for p in marker.read_text().split()]
        cli.interrupt()
        cli.wait_for("cleanup: stopping what run p30 still runs")
        time.sleep(1)
        cli.interrupt()
        cli.wait_for("the cleanup is still running")
        assert cli.exit() == 130, cli.output()
        out = cli.output()
        assert re.search(r"SIGINT: the cleanup is still running \(\d+ s\): stopping what run p30 still runs and "
                         r"releasing its locks on: h1\. Interrupt again to stop the cleanup now; left for you then: "
                         r"the lock of run p30 on h1", out), out
        # It went on, and finished: the stubborn install was killed after the grace period.
        assert re.search(r"h1 +cleanup: lock released after stopping install of run p30 .*stopped after [3-9]\.\d s", out)
        assert not (h1 / ".lock").exists() and all(gone(p) for p in pids)
    finally:
        kill_all(pids)
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)


def test_a_third_ctrl_c_stops_the_cleanup_and_names_what_is_left(fleet):
    marker = fleet["root"] / "writer.pids"
    cli = rollout(fleet, "p40", "-e", "stubborn=1")
    pids: list[int] = []
    try:
        cli.wait_for(marker)
        pids = [int(p) for p in marker.read_text().split()]
        cli.interrupt()
        cli.wait_for("cleanup: stopping what run p40 still runs")
        time.sleep(1)
        cli.interrupt()
        cli.wait_for("the cleanup is still running")
        cli.interrupt()
        assert cli.exit() == 130, cli.output()
        out = cli.output()
        assert "SIGINT: stopping the cleanup; left for you: the lock of run p40 on h1" in out
        summary = out[out.index("mlafleet rollout  run p40"):]
        assert re.search(r"\n  h1 +interrupted +interrupted at Install the pinned packages; .*"
                         r"cleanup stopped before it confirmed the release: the lock may be left", summary), summary
        assert "left for you: the lock of run p40 on h1" in summary and "-e rollout_lock_takeover=p40" in summary
        report = json.loads((fleet["reports"] / "p40" / "run.json").read_text())
        assert report["interrupted"]["cleanup"] == "stopped" and report["rc"] == 130
    finally:
        kill_all(pids)
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)


def controller_processes(pid: int) -> list[int]:
    """The ansible-playbook processes a `mlafleet` process started (they carry its pid)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if f"MLAFLEET_CONTROLLER_PID={pid}".encode() in env and b"ansible-playbook" in cmdline:
            found.append(int(name))
    return found


def test_a_lost_controllers_lock_is_abandoned_and_the_printed_command_takes_it_over(fleet):
    """The controller dies with the run (kill -9 of mlafleet and its ansible-playbook): no cleanup ran."""
    marker, h1 = fleet["root"] / "writer.pids", fleet["root"] / "h1"
    cli = rollout(fleet, "p50")
    pids: list[int] = []
    try:
        cli.wait_for(marker)
        pids = [int(p) for p in marker.read_text().split()]
        ansible = controller_processes(cli.proc.pid)
        assert ansible
        os.killpg(cli.proc.pid, signal.SIGKILL)
        for pid in ansible:
            os.kill(pid, signal.SIGKILL)
        cli.exit()
        lock = json.loads((h1 / ".lock").read_text())
        assert lock["run"] == "p50" and lock["controller"] == socket.gethostname()
        assert lock["controller_pid"] == cli.proc.pid  # the mlafleet process, now gone
        assert lock["owner"] == f"{lockinfo.real_user()}@{socket.gethostname()}"
        assert not any(gone(p) for p in pids), "the install outlived its controller"
        assert lockinfo.run_over(lock, fleet["reports"]) == (
            f"its controller process {cli.proc.pid} on {socket.gethostname()}, this machine, is gone")

        # The next rollout is refused, says the lock is abandoned and prints the one command that
        # takes it over; that command stops the install, takes the lock and goes on.
        refused = rollout(fleet, "p51", "-e", "slow=false")
        assert refused.exit() == 1
        report = json.loads((fleet["reports"] / "p51" / "run.json").read_text())
        cause = {h["host"]: h for h in report["hosts"]}["h1"]["cause"]
        assert "another rollout holds this host" in cause and "abandoned: run p50 is over" in cause
        command = cause.split("before removing its lock: ", 1)[1]
        assert command == shlex.join(["mlafleet", "rollout", "-i", str(fleet["inventory"]), "-e", "slow=true",
                                      "-e", "slow=false", "--playbook", str(fleet["root"] / "play.yml")]) \
            + " -e rollout_lock_takeover=p50"
        taken = Cli(fleet, shlex.split(command)[1:] + ["--run", "p52"])
        assert taken.exit() == 0, taken.output()
        assert all(gone(p) for p in pids)
        assert "took over the abandoned lock of" in taken.output()
        assert f"stopped what it left running: install of run p50 (pid {pids[0]}" in taken.output()
        assert not (h1 / ".lock").exists()
    finally:
        kill_all(pids)
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)
