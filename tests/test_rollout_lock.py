"""The rollout lock's owner, abandoned locks and steps recorded under the lock, for real.

Real ansible-runner and ansible-playbook runs (connection local: the controller is the host) of
the rollout_lock role and the mlafleet_rollout_lock module (and its action plugin) on scratch
lock files. An "orphaned install" is a real process tree left running by a controller that was
killed: it keeps writing into a release directory until the next run stops it.
"""

from __future__ import annotations

import io
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlafleet.ops import runner

BIN = Path(sys.executable).parent

LOCK_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: rollout_lock
      vars:
        rollout_lock_path: "{{ scratch }}/{{ inventory_hostname }}.lock"
        rollout_lock_run: "{{ mlafleet_run }}"
"""

# What a lost run leaves: its lock, and its install still running under it. The "install" starts
# a child (as pip starts build backends) and rewrites files in the release directory, recreating
# it when it is removed; with `stubborn` it ignores SIGTERM.
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

STEP_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: rollout_lock
      vars:
        rollout_lock_path: "{{ scratch }}/{{ inventory_hostname }}.lock"
        rollout_lock_run: "{{ mlafleet_run }}"
    - name: Install the pinned packages
      mlafleet.fleet.mlafleet_rollout_lock:
        path: "{{ scratch }}/{{ inventory_hostname }}.lock"
        state: run
        run: "{{ mlafleet_run }}"
        step: install
        argv: "{{ step_argv }}"
"""

# The next run: take the lock (taking over or breaking the lost run's), then remove the incomplete
# release as vllm_install does before it installs again.
RETRY_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: rollout_lock
      vars:
        rollout_lock_path: "{{ scratch }}/{{ inventory_hostname }}.lock"
        rollout_lock_run: "{{ mlafleet_run }}"
        rollout_lock_stop_grace: 1
    - name: Remove an incomplete earlier attempt at this release
      ansible.builtin.file:
        path: "{{ scratch }}/release"
        state: absent
"""


@pytest.fixture()
def scratch(tmp_path: Path) -> dict[str, Path]:
    inv = tmp_path / "inventory.yml"
    inv.write_text(f"all:\n  vars:\n    scratch: {tmp_path}\n  hosts:\n"
                   f"    h1: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n")
    return {"root": tmp_path, "inventory": inv, "runner": tmp_path / "runner", "reports": tmp_path / "reports"}


def run(scratch: dict[str, Path], play: str, run_id: str, **kw) -> dict:
    playbook = scratch["root"] / f"{run_id}.yml"
    playbook.write_text(play)
    out = io.StringIO()
    report = runner.run_playbook("rollout", [scratch["inventory"]], run=run_id, out=out, playbook=str(playbook),
                                 runner_root=scratch["runner"], report_root=scratch["reports"], **kw)
    report["_out"] = out.getvalue()
    return report


def h1(report: dict) -> dict:
    return next(h for h in report["hosts"] if h["host"] == "h1")


def gone(pid: int) -> bool:
    """The process has ended (a zombie nobody reaped runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write_lock(path: Path, **fields) -> None:
    path.write_text(json.dumps({"owner": "ops@ctl", "time": time.time() - 141, **fields}))


def test_owner_names_the_real_user_and_controller_without_USER(scratch, monkeypatch):
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("LOGNAME", raising=False)
    report = run(scratch, LOCK_PLAY, "own-1")
    assert report["rc"] == 0, report["_out"]
    lock = json.loads((scratch["root"] / "h1.lock").read_text())
    me = pwd.getpwuid(os.getuid()).pw_name
    assert lock["owner"] == f"{me}@{socket.gethostname()}" and lock["controller"] == socket.gethostname()
    assert lock["controller_pid"] == os.getpid()  # the mlafleet process (here: this test), which outlives the run


def test_abandoned_lock_is_named_with_the_command_that_takes_it_over(scratch):
    lock = scratch["root"] / "h1.lock"
    pid = dead_pid()
    write_lock(lock, run="p23", controller=socket.gethostname(), controller_pid=pid)
    refused = run(scratch, LOCK_PLAY, "ab-1", command_line=["mlafleet", "rollout", "-i", "inv", "-e", "x=1"])
    cause = h1(refused)["cause"]
    assert refused["rc"] == 1
    assert "another rollout holds this host" in cause and "run p23" in cause and re.search(r"\(14\d s ago\)", cause)
    assert f"abandoned: run p23 is over, its controller process {pid} on {socket.gethostname()}" in cause
    assert "lock: mlafleet rollout -i inv -e x=1 -e rollout_lock_takeover=p23" in cause
    assert json.loads(lock.read_text())["run"] == "p23"

    taken = run(scratch, LOCK_PLAY, "ab-2", extravars={"rollout_lock_takeover": "p23"})
    assert taken["rc"] == 0, taken["_out"]
    warning = [w for w in h1(taken)["warnings"] if "took over the abandoned lock of owner ops@ctl, run p23" in w]
    assert warning and "rollout_lock_takeover=p23" in warning[0]
    assert json.loads(lock.read_text())["run"] == "ab-2"


def test_a_run_whose_run_json_says_it_ended_is_over(scratch):
    lock = scratch["root"] / "h1.lock"
    write_lock(lock, run="elsewhere-run", controller="another-controller", controller_pid=4242)
    refused = run(scratch, LOCK_PLAY, "rj-1")
    assert "may still be live: its controller is another-controller, not this machine" in h1(refused)["cause"]
    assert "rollout_lock_takeover" not in h1(refused)["cause"]
    (scratch["reports"] / "elsewhere-run").mkdir(parents=True)
    (scratch["reports"] / "elsewhere-run" / "run.json").write_text(json.dumps({"run": "elsewhere-run", "rc": 1}))
    refused = run(scratch, LOCK_PLAY, "rj-2")
    assert "abandoned: run elsewhere-run is over, its run.json" in h1(refused)["cause"]
    assert "-e rollout_lock_takeover=elsewhere-run" in h1(refused)["cause"]
    assert run(scratch, LOCK_PLAY, "rj-3", extravars={"rollout_lock_takeover": "elsewhere-run"})["rc"] == 0


def test_a_lock_that_may_be_live_is_never_taken_over(scratch):
    lock = scratch["root"] / "h1.lock"
    write_lock(lock, run="live", controller=socket.gethostname(), controller_pid=os.getpid())
    refused = run(scratch, LOCK_PLAY, "lv-1", extravars={"rollout_lock_takeover": "live"})
    cause = h1(refused)["cause"]
    assert refused["rc"] == 1
    assert f"not taking it over: run live may still be live: its controller process {os.getpid()}" in cause
    assert "never broken" in cause
    assert json.loads(lock.read_text())["run"] == "live"
    # An old lock without a controller cannot be proven over either.
    write_lock(lock, run="old-style", controller_pid=dead_pid())
    refused = run(scratch, LOCK_PLAY, "lv-2", extravars={"rollout_lock_takeover": "old-style"})
    assert "may still be live: the lock names no controller process" in h1(refused)["cause"]
    assert json.loads(lock.read_text())["run"] == "old-style"


def test_a_step_runs_like_a_command_and_leaves_no_record(scratch):
    ok = run(scratch, STEP_PLAY, "st-1", extravars={
        "step_argv": [sys.executable, "-c", "import sys; print('installed'); print('warn', file=sys.stderr)"]})
    assert ok["rc"] == 0, ok["_out"]
    assert "Install the pinned packages" in h1(ok)["changed"]
    assert not (scratch["root"] / "h1.lock.steps").exists()
    bad = run(scratch, STEP_PLAY, "st-2", extravars={
        "step_argv": [sys.executable, "-c", "import sys; sys.exit('ERROR: No matching distribution for torch')"]})
    # the lock of st-1 is still there: st-2 is refused; release it and try again
    assert "another rollout holds this host" in h1(bad)["cause"]
    (scratch["root"] / "h1.lock").unlink()
    bad = run(scratch, STEP_PLAY, "st-3", extravars={
        "step_argv": [sys.executable, "-c", "import sys; sys.exit('ERROR: No matching distribution for torch')"]})
    assert h1(bad)["status"] == "failed"
    assert "non-zero return code ERROR: No matching distribution for torch" in h1(bad)["cause"]
    assert not (scratch["root"] / "h1.lock.steps").exists()


def test_a_step_may_run_in_the_background(scratch):
    """async/poll: the step runs detached from the task (as a long install may), still recorded."""
    play = STEP_PLAY.replace("        argv: \"{{ step_argv }}\"\n", "        argv: \"{{ step_argv }}\"\n      async: 120\n      poll: 1\n")
    ok = run(scratch, play, "as-1", extravars={"step_argv": [sys.executable, "-c", "print('in the background')"]})
    assert ok["rc"] == 0, ok["_out"]
    events = " ".join(p.read_text() for p in (scratch["runner"] / "as-1" / "artifacts" / "as-1" / "job_events").iterdir())
    assert '"ansible_job_id"' in events and "in the background" in events
    assert "Install the pinned packages" in h1(ok)["changed"]
    assert not (scratch["root"] / "h1.lock.steps").exists()


@pytest.mark.parametrize("stubborn", [False, True], ids=["stops-on-sigterm", "ignores-sigterm"])
def test_taking_over_stops_the_orphaned_install_before_its_release_is_removed(scratch, stubborn):
    """Issue 39: a lost run's install still writes; the next run stops it first, then removes the release."""
    release, marker = scratch["root"] / "release", scratch["root"] / "writer.pids"
    (scratch["root"] / "writer.py").write_text(WRITER)
    (scratch["root"] / "lost.yml").write_text(STEP_PLAY)
    env = {**os.environ, "ANSIBLE_CONFIG": str(runner.REPO / "ansible.cfg"),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "MLAFLEET_REPORT_ROOT": str(scratch["reports"])}
    env.pop("MLAFLEET_CONTROLLER_PID", None)
    argv = json.dumps([sys.executable, str(scratch["root"] / "writer.py"), str(release), str(marker),
                       "1" if stubborn else "0"])
    lost = subprocess.Popen([str(BIN / "ansible-playbook"), "-i", str(scratch["inventory"]),
                             str(scratch["root"] / "lost.yml"), "-e", "mlafleet_run=lost", "-e",
                             json.dumps({"step_argv": json.loads(argv)})],
                            env=env, cwd=runner.REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert lost.poll() is None and time.monotonic() < deadline, lost.communicate()[0][-3000:]
            time.sleep(0.2)
        pids = [int(p) for p in marker.read_text().split()]
        # The controller is lost (killed with everything in its process group): the install is not.
        os.killpg(lost.pid, signal.SIGKILL)
        lost.wait(30)
        time.sleep(1)
        assert not any(gone(p) for p in pids), "the install should have outlived its controller"
        record = json.loads((scratch["root"] / "h1.lock.steps" / "lost.install.json").read_text())
        assert record["pid"] == pids[0] and record["step"] == "install"
        assert json.loads((scratch["root"] / "h1.lock").read_text())["run"] == "lost"

        retry = run(scratch, RETRY_PLAY, "retry-1", extravars={"rollout_lock_takeover": "lost"})
        assert retry["rc"] == 0, retry["_out"]
        warning = " ".join(h1(retry)["warnings"])
        assert "took over the abandoned lock of" in warning and "run lost" in warning
        assert f"stopped what it left running: install of run lost (pid {pids[0]}" in warning
        assert all(gone(p) for p in pids), [open(f"/proc/{p}/stat").read() for p in pids if not gone(p)]
        time.sleep(0.5)
        assert not release.exists(), "nothing may write into the removed release any more"
        assert not (scratch["root"] / "h1.lock.steps").exists()
        assert json.loads((scratch["root"] / "h1.lock").read_text())["run"] == "retry-1"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_breaking_a_stale_lock_stops_its_step_too(scratch):
    """The explicit override (stale + rollout_lock_break) stops a recorded step as well, and says so."""
    lock = scratch["root"] / "h1.lock"
    write_lock(lock, run="ancient")
    lock_time = json.loads(lock.read_text())
    lock_time["time"] = time.time() - 9000
    lock.write_text(json.dumps(lock_time))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ticks = int(open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[19])
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (scratch["root"] / "h1.lock.steps").mkdir()
    (scratch["root"] / "h1.lock.steps" / "ancient.install.json").write_text(json.dumps(
        {"run": "ancient", "step": "install", "pid": sleeper.pid, "sid": sleeper.pid, "start_ticks": ticks,
         "boot_id": boot, "argv": ["pip", "install"]}))
    try:
        broken = run(scratch, LOCK_PLAY, "br-1", extravars={"rollout_lock_break": True})
        assert broken["rc"] == 0, broken["_out"]
        assert sleeper.wait(10) == -signal.SIGTERM
        warning = " ".join(h1(broken)["warnings"])
        assert "broke the stale lock of owner ops@ctl, run ancient" in warning
        assert f"stopped what it left running: install of run ancient (pid {sleeper.pid}: pip install)" in warning
    finally:
        sleeper.kill()
