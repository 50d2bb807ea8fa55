"""Action `mlafleet_rollout_lock`: the controller's half of the rollout lock module of the same name.

On the controller it fills in who takes the lock (the real user and controller host, whatever
$USER says), the controller's host name and the controller process that lives as long as the run
($MLAFLEET_CONTROLLER_PID, which `mlafleet rollout|rollback` set to their own pid, else
ansible-playbook's), then runs the module on the host. When the module refuses because another
run holds the lock, it asks whether that run is provably over (plugins/plugin_utils/rollout_lock.py:
the controller process is gone on this machine, or the run's run.json says it ended):

- over, and `takeover` names that run: the module runs again with the proof, stops what the old run
  left running on the host, removes its lock and takes it (a warning names all of it);
- over, no takeover: the refusal says the lock is abandoned, why, and prints the command that takes
  it over (this run's command plus `-e rollout_lock_takeover=<run>`);
- maybe live: the refusal says why; a takeover is refused. Only a stale lock with
  `rollout_lock_break=true` is broken without proof, as before.
"""

from __future__ import annotations

import os
from typing import Any

from ansible.plugins.action import ActionBase
from ansible_collections.mlafleet.fleet.plugins.plugin_utils.rollout_lock import (
    controller_host, owner, run_over, takeover_command, why_live)

MODULE = "mlafleet.fleet.mlafleet_rollout_lock"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _supports_async = True  # a long step may run in the background (async, poll)

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        super().run(tmp, task_vars)
        args = dict(self._task.args)
        args["owner"] = args.get("owner") or owner()
        args["controller"] = args.get("controller") or controller_host()
        args["controller_pid"] = int(args.get("controller_pid") or os.environ.get("MLAFLEET_CONTROLLER_PID")
                                     or os.getppid())  # a worker's parent: the ansible-playbook process
        takeover = str(args.pop("takeover", "") or "")
        args.pop("takeover_proof", None)  # only this plugin may state the proof
        try:
            result = self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars,
                                          wrap_async=bool(self._task.async_val))
            lock = result.get("lock") if isinstance(result.get("lock"), dict) else None
            if (result.get("failed") and lock and args.get("state", "present") in ("present", "check")
                    and lock.get("run") != args.get("run")):
                run = str(lock.get("run") or "")
                over = run_over(lock)
                if over and takeover == run:
                    result = self._execute_module(module_name=MODULE, task_vars=task_vars,
                                                  module_args={**args, "takeover": run, "takeover_proof": over})
                elif over:
                    result.update(abandoned=True, over=over, takeover_command=takeover_command(run),
                                  msg=f"{result.get('msg')}; abandoned: run {run} is over, {over}. Take it over safely, "
                                      "which stops what that run left running on the host before removing its "
                                      f"lock: {takeover_command(run)}")
                else:
                    live = why_live(lock)
                    refusal = (f"; not taking it over: run {run} may still be live: {live}" if takeover == run
                               else f"; it may still be live: {live}")
                    if not result.get("stale"):
                        refusal += (". Wait for that run to end: a lock that may be live is never broken, unless it "
                                    "is stale, older than rollout_lock_stale_after, and rollout_lock_break=true is set")
                    result.update(abandoned=False, msg=f"{result.get('msg')}{refusal}")
        finally:
            if not self._task.async_val:  # an async job still needs its files
                self._remove_tmp_path(self._connection._shell.tmpdir)
        return result
