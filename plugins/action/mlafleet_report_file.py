"""Action `mlafleet_report_file`: write one of a run's report files on the controller.

The smoke test's and the perf gate's per-host JSON and a failed batch's host report go into the
run's report directory (lookup `mlafleet_report_dir`): the file 0600, each directory it creates
0700, written atomically (plugins/plugin_utils/report_dir.py). The controller's own process writes
it: no module runs, where a `file` and a `copy` delegated to localhost started three. A report, not
a change to any host: never "changed"; in check mode nothing is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.mlafleet.fleet.plugins.plugin_utils.report_dir import write_private


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("dest", "content"))

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        dest = self._task.args.get("dest")
        content = self._task.args.get("content")
        if not isinstance(dest, str) or not Path(dest).is_absolute():
            raise AnsibleActionFail(f"mlafleet_report_file: dest must be an absolute path, not {dest!r}")
        if not isinstance(content, str):
            raise AnsibleActionFail(f"mlafleet_report_file: content must be text, not {type(content).__name__}")
        result.update(changed=False, dest=dest)
        if self._task.check_mode:
            result["msg"] = "not written in check mode"
            return result
        try:
            write_private(Path(dest), content)
        except OSError as exc:
            raise AnsibleActionFail(f"mlafleet_report_file: could not write {dest}: {exc}") from None
        return result
