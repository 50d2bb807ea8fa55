"""Action `mlafleet_check_vars`: warn about variables that look like ours but that nothing declares.

A misspelled variable (`vllm_verison`, `vllm_server_portt`) is silently ignored by Ansible: the
role runs with its default. This action runs once on the controller at the start of site.yml and
rollback.yml (playbooks/check_vars.yml), looks at every inventory and extra variable of every
host, and warns for each name that carries one of our prefixes (a role's name, the first word of
one, or `mlafleet_`) but that no role's meta/argument_specs.yml and no playbook
(playbooks/meta/argument_specs.yml) declares, naming the closest declared name. It changes nothing
and never fails the run: a warning, not a refusal (an operator may keep variables of their own).

The check itself is plugins/plugin_utils/check_vars.py (the mlafleet CLI uses it too).
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase
from ansible_collections.mlafleet.fleet.plugins.plugin_utils.check_vars import (
    declared_variables, prefixes, unknown_variables, warning_text)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        hostvars = task_vars.get("hostvars") or {}
        manager = getattr(hostvars, "_variable_manager", None)
        extra = set(getattr(manager, "extra_vars", None) or {})
        seen: dict[str, list[str]] = {}
        for host in hostvars:
            for name in hostvars[host].keys():
                if name not in extra:
                    seen.setdefault(name, []).append(str(host))
        declared = declared_variables()
        ours = prefixes()
        warnings = []
        unknown = []
        for name, suggestion in unknown_variables(list(seen) + list(extra), declared, ours):
            hosts = seen.get(name, [])
            where = "extra variable" if name in extra else (
                f"inventory: {', '.join(sorted(hosts)[:5])}{' and others' if len(hosts) > 5 else ''}")
            warnings.append(warning_text(name, suggestion, where))
            unknown.append({"name": name, "where": where, "closest": suggestion})
        result.update(changed=False, unknown=unknown, warnings=warnings,
                      msg=f"{len(unknown)} unknown variable(s) with mlafleet prefixes" if unknown
                      else "every variable with an mlafleet prefix is declared")
        return result
