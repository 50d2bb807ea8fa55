#!/usr/bin/python
"""Ansible module: take or release the mlafleet rollout lock of one host, and run long steps under it.

The lock is a small JSON file ({owner, run, controller, controller_pid, time}) created with
O_EXCL, so two controllers racing for it cannot both win. A lock held by another run makes the
module fail with its owner and age; a lock older than `stale_after` seconds is reported as stale
and is removed only when `break_stale` is true; the lock of a run proven over (the action plugin
of the same name proves it on the controller) is taken over with `takeover`. Releasing removes
the file only when it is ours.

Long host-side steps (the pip install of a release) run with `state: run`: in a session of their
own, recorded under the lock (`<path>.steps/<run>.<step>.json`: pid, session, start time) while
they run. Whoever removes a run's lock (its own release, the cleanup after an interrupt, a
takeover, a break) first stops every step that run recorded and is still running (SIGTERM to the
session, SIGKILL after `stop_grace` seconds) and waits until none of its processes is left, so
nothing the old run started still writes when the next run cleans up after it.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: mlafleet_rollout_lock
short_description: Take or release the mlafleet per-host rollout lock; run long steps under it
description:
  - Creates the lock file atomically (O_EXCL) with owner, run id, controller, controller process and time.
  - Fails, naming the owner and age, when another run holds the lock; a lock older than
    O(stale_after) seconds is called stale and is broken only with O(break_stale=true).
  - The lock of a run that is provably over is taken over with O(takeover) (the run id); the
    action plugin of the same name checks on the controller that the run is over and refuses otherwise.
  - Releases only a lock held by the same run id.
  - With O(state=run), runs O(argv) as the recorded step O(step) of the run; removing the run's lock
    (release, takeover, break) stops its recorded steps first and waits until they are gone.
version_added: 0.3.0
author: mlafleet maintainers (@mlafleet)
options:
  path: {type: path, required: true, description: Lock file.}
  state:
    type: str
    choices: [present, absent, check, run]
    default: present
    description: >-
      Take (V(present)), release (V(absent)), only check that no other run holds it (V(check)), or
      run O(argv) as a recorded step of this run (V(run)).
  run: {type: str, required: true, description: Run id of this rollout (re-entrant for the same run).}
  owner: {type: str, default: "", description: Who takes it (user@controller; the action plugin fills it in).}
  controller: {type: str, default: "", description: Host name of the controller (filled in by the action plugin).}
  controller_pid: {type: int, default: 0, description: The controller process that lives as long as the run (filled in by the action plugin).}
  stale_after: {type: int, default: 7200, description: Age in seconds after which a lock is stale.}
  break_stale: {type: bool, default: false, description: Remove a stale lock held by another run.}
  takeover: {type: str, default: "", description: Run id of an abandoned lock to take over (with O(takeover_proof)).}
  takeover_proof: {type: str, default: "", description: Why that run is over (set by the action plugin after checking).}
  keep_others: {type: bool, default: false, description: "With O(state=absent): leave another run's lock in place (and say so) instead of failing."}
  stop_grace: {type: int, default: 20, description: Seconds a stopped step gets between SIGTERM and SIGKILL.}
  step: {type: str, default: "", description: "With O(state=run): the step's name (install)."}
  argv: {type: list, elements: str, default: [], description: "With O(state=run): the command to run."}
attributes:
  check_mode:
    support: full
    description: Reports what it would take, break or release; a step is not run.
notes:
  - The role mlafleet.fleet.rollout_lock wraps it with the rollout's run id; vllm_install runs its pip install as a step.
"""

EXAMPLES = r"""
- name: Take this host's lock for run 20260110T0300Z
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    run: 20260110T0300Z

- name: Only check that no other run holds it (before any batch starts)
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    state: check
    run: 20260110T0300Z

- name: Run the install as a recorded step of the run (stopped by whoever removes the run's lock)
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    state: run
    run: 20260110T0300Z
    step: install
    argv: [/opt/mlafleet/releases/r1/venv/bin/pip, install, -r, /opt/mlafleet/releases/r1/requirements.txt]

- name: Release it (only a lock of this run is removed; its recorded steps are stopped first)
  mlafleet.fleet.mlafleet_rollout_lock:
    path: /opt/mlafleet/.lock
    state: absent
    run: 20260110T0300Z
"""

RETURN = r"""
msg:
  description: >-
    What happened (V(taken), V(released), V(free), V(no lock), V(already held by this run), the
    broken or taken-over lock, or for a step V(non-zero return code) / the step's name).
  type: str
  returned: always
  sample: taken
lock:
  description: The lock found on the host (owner, run, controller, controller_pid, time), when there was one.
  type: dict
  returned: when a lock was found
  sample: {owner: ops@ctl, run: 20260110T0300Z, controller: ctl, controller_pid: 4242, time: 1768014000.0}
age:
  description: Age of the lock found, in seconds.
  type: int
  returned: when another run's lock was found
  sample: 9000
stale:
  description: Whether that lock is older than O(stale_after).
  type: bool
  returned: when another run's lock was found
broken:
  description: The lock that was broken or taken over to take this one, or null.
  type: dict
  returned: when O(state=present) took the lock
stopped:
  description: The recorded steps that were still running and were stopped before a lock was removed.
  type: list
  elements: str
  returned: when a lock was released, broken or taken over
  sample: ["install of run 20260110T0300Z (pid 4321, 3 processes: pip install ...), stopped after 0.3 s"]
rc:
  description: The step's exit status (negative for a signal).
  type: int
  returned: with O(state=run)
stdout:
  description: What the step printed.
  type: str
  returned: with O(state=run)
stderr:
  description: What the step printed on stderr.
  type: str
  returned: with O(state=run)
"""

import json
import os
import re
import signal
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule


def read_lock(path: str) -> dict | None:
    """The lock's content, None when there is no lock; an unreadable lock is reported as such."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError:
        data = {"owner": "unknown (unreadable lock file)", "run": "", "time": os.path.getmtime(path)}
    return data


def describe(lock: dict, now: float) -> tuple[str, int]:
    age = int(now - float(lock.get("time", now)))
    text = (f"owner {lock.get('owner', '?')}, run {lock.get('run', '?')}, "
            f"taken {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(float(lock.get('time', now))))} "
            f"({age} s ago)")
    return text, age


def take(module: AnsibleModule, path: str) -> None:
    p = module.params
    content = json.dumps({"owner": p["owner"] or "unknown", "run": p["run"], "controller": p["controller"],
                          "controller_pid": p["controller_pid"], "time": time.time()})
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        lock = read_lock(path) or {}
        text, dummy = describe(lock, time.time())
        module.fail_json(msg=f"{path}: taken by another rollout at the same moment: {text}", lock=lock)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content + "\n")


# --- recorded steps ---------------------------------------------------------------------------

def steps_dir(path: str) -> str:
    return path + ".steps"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "-"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time in clock ticks since boot) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[3]), int(fields[19])


def step_processes(record: dict) -> list[int]:
    """The processes still left of a recorded step: every live member of the session it started.

    A session id is the pid of its first process, which Linux does not hand out again while any
    member of the session lives; so the members are ours unless a new process now owns that pid
    (its start time differs), and after a reboot nothing is.
    """
    sid, ticks = int(record.get("sid") or 0), int(record.get("start_ticks") or 0)
    if sid <= 1 or (record.get("boot_id") and record["boot_id"] != _boot_id()):
        return []
    leader = _stat(sid)
    if leader is not None and leader[2] != ticks:
        return []
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == sid and st[0] not in ("Z", "X"):
                found.append(int(name))
    return found


def read_steps(path: str, run: str | None = None) -> list[tuple[str, dict]]:
    """(record file, record) of every recorded step, or of `run`'s only."""
    out = []
    try:
        names = sorted(os.listdir(steps_dir(path)))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        file = os.path.join(steps_dir(path), name)
        try:
            with open(file, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and (run is None or record.get("run") == run):
            out.append((file, record))
    return out


def _forget(file: str) -> None:
    base = file[:-len(".json")]
    for leftover in (file, base + ".out", base + ".err"):
        try:
            os.unlink(leftover)
        except OSError:
            pass
    try:
        os.rmdir(os.path.dirname(file))  # only when no other step is recorded
    except OSError:
        pass


def stop_steps(module: AnsibleModule, path: str, run: str) -> list[str]:
    """Stop every step `run` recorded under the lock at `path`; wait until none of them is left."""
    grace = max(0, module.params["stop_grace"])
    stopped = []
    for file, record in read_steps(path, run):
        pids = step_processes(record)
        if pids:
            if module.check_mode:
                stopped.append(f"{record.get('step')} of run {run} (pid {record.get('pid')}) would be stopped")
                continue
            started = time.monotonic()
            what = " ".join(" ".join(str(a).split()) for a in (record.get("argv") or [])[:4])[:160]
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30)):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                deadline = time.monotonic() + wait
                while pids and time.monotonic() < deadline:
                    time.sleep(0.1)
                    pids = step_processes(record)
                if not pids:
                    break
            if pids:
                module.fail_json(msg=f"{path}: could not stop the step {record.get('step')} of run {run}: "
                                     f"processes {pids} are still there after SIGKILL; nothing was released")
            stopped.append(f"{record.get('step')} of run {run} (pid {record.get('pid')}: {what}), "
                           f"stopped after {time.monotonic() - started:.1f} s")
        if not module.check_mode:
            _forget(file)
    return stopped


def run_step(module: AnsibleModule, path: str) -> None:
    p = module.params
    if not p["step"] or not p["argv"]:
        module.fail_json(msg="state=run needs step (a name) and argv (the command)")
    lock = read_lock(path)
    if lock is not None and lock.get("run") != p["run"]:
        text, dummy = describe(lock, time.time())
        module.fail_json(msg=f"{path}: another rollout holds this host, not starting {p['step']}: {text}", lock=lock)
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg=f"{p['step']} would have run if not in check mode")
    folder = steps_dir(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    base = os.path.join(folder, f"{_safe(p['run'])}.{_safe(p['step'])}")
    start = time.time()
    with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
        try:
            proc = subprocess.Popen(p["argv"], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
        except OSError as exc:
            _forget(base + ".json")
            module.fail_json(msg=f"{p['step']}: cannot run {p['argv'][0]}: {exc}", rc=2, cmd=p["argv"])
        st = _stat(proc.pid)
        record = {"run": p["run"], "step": p["step"], "pid": proc.pid, "sid": proc.pid,
                  "start_ticks": st[2] if st else 0, "boot_id": _boot_id(), "argv": p["argv"], "started": start}
        tmp = base + ".json.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, base + ".json")
        rc = proc.wait()
    with open(base + ".out", encoding="utf-8", errors="replace") as f:
        stdout = f.read()
    with open(base + ".err", encoding="utf-8", errors="replace") as f:
        stderr = f.read()
    _forget(base + ".json")
    end = time.time()
    result = {"changed": True, "rc": rc, "stdout": stdout.rstrip("\n"), "stderr": stderr.rstrip("\n"),
              "cmd": p["argv"], "start": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)),
              "end": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)), "delta": f"{end - start:.3f} s"}
    if rc != 0:
        reason = f"stopped by signal {-rc}" if rc < 0 else "non-zero return code"
        module.fail_json(msg=reason, **result)
    module.exit_json(msg=f"{p['step']} done", **result)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {"type": "str", "choices": ["present", "absent", "check", "run"], "default": "present"},
            "run": {"type": "str", "required": True},
            "owner": {"type": "str", "default": ""},
            "controller": {"type": "str", "default": ""},
            "controller_pid": {"type": "int", "default": 0},
            "stale_after": {"type": "int", "default": 7200},
            "break_stale": {"type": "bool", "default": False},
            "takeover": {"type": "str", "default": ""},
            "takeover_proof": {"type": "str", "default": ""},
            "keep_others": {"type": "bool", "default": False},
            "stop_grace": {"type": "int", "default": 20},
            "step": {"type": "str", "default": ""},
            "argv": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    path = p["path"]
    if p["state"] == "run":
        run_step(module, path)
    if not p["run"]:
        module.fail_json(msg="run must be a non-empty run id: mlafleet_run_id is set by playbooks/release.yml "
                             "(site.yml and rollback.yml import it first); run it first, or pass rollout_lock_run")
    now = time.time()
    lock = read_lock(path)

    if p["state"] == "absent":
        if lock is None:
            stopped = stop_steps(module, path, p["run"])
            module.exit_json(changed=bool(stopped), msg="no lock", stopped=stopped)
        if lock.get("run") != p["run"]:
            text, dummy = describe(lock, now)
            if p["keep_others"]:
                module.exit_json(changed=False, msg=f"held by another run, left as it is: {text}", lock=lock)
            module.fail_json(msg=f"{path} is held by another run, not releasing it: {text}", lock=lock)
        stopped = stop_steps(module, path, p["run"])
        if not module.check_mode:
            os.unlink(path)
        module.exit_json(changed=True, msg="released" + (f" after stopping {'; '.join(stopped)}" if stopped else ""),
                         stopped=stopped)

    if lock is not None and lock.get("run") == p["run"]:
        module.exit_json(changed=False, msg="already held by this run", lock=lock)
    broken = None
    how = ""
    if lock is not None:
        text, age = describe(lock, now)
        if p["takeover"] and p["takeover"] == lock.get("run") and p["takeover_proof"]:
            how = f"took over the abandoned lock of {text} ({p['takeover_proof']}; rollout_lock_takeover={p['takeover']})"
            if p["state"] == "check":
                module.exit_json(changed=False, msg=f"abandoned lock will be taken over: {text}", lock=lock, age=age,
                                 stale=age >= p["stale_after"])
        elif age < p["stale_after"]:
            module.fail_json(msg=f"{path}: another rollout holds this host: {text}", lock=lock, age=age, stale=False)
        elif not p["break_stale"]:
            module.fail_json(msg=f"{path}: stale lock (older than {p['stale_after']} s): {text}; "
                                 "set rollout_lock_break=true to break it", lock=lock, age=age, stale=True)
        elif p["state"] == "check":
            module.exit_json(changed=False, msg=f"stale lock will be broken: {text}", lock=lock, age=age, stale=True)
        else:
            how = f"broke the stale lock of {text} (rollout_lock_break=true)"
        broken = lock
    if p["state"] == "check":
        module.exit_json(changed=False, msg="free")
    stopped = []
    if broken is not None:
        stopped = stop_steps(module, path, str(broken.get("run", "")))
        if not module.check_mode:
            os.unlink(path)
    if not module.check_mode:
        take(module, path)
    if broken is None:
        module.exit_json(changed=True, msg="taken", broken=None)
    msg = (f"{path}: {how}" + (f", stopped what it left running: {'; '.join(stopped)}," if stopped else "")
           + " and took it")
    module.warn(msg)
    module.exit_json(changed=True, msg=msg, broken=broken, stopped=stopped)


if __name__ == "__main__":
    main()
