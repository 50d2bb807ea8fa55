"""Action `mlafleet_check_vars`: warn about variables that look like ours but that nothing declares.

A misspelled variable (`vllm_verison`, `vllm_server_portt`) is silently ignored by Ansible: the
role runs with its default. This action runs once on the controller at the start of site.yml and
rollback.yml (playbooks/check_vars.yml), looks at every inventory and extra variable of every
host, and warns for each name that carries one of our prefixes (a role's name, the first word of
one, or `mlafleet_`) but that no role's meta/argument_specs.yml and no playbook
(playbooks/meta/argument_specs.yml) declares, naming the closest declared name. It changes nothing
and never fails the run: a warning, not a refusal (an operator may keep variables of their own).

The functions above the action are plain Python (the mlafleet CLI uses them too).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml
from ansible.plugins.action import ActionBase

REPO = Path(__file__).resolve().parents[2]


def spec_files(repo: Path = REPO) -> list[Path]:
    """Every role's argument specs, then the playbooks' own."""
    return sorted((repo / "roles").glob("*/meta/argument_specs.yml")) + [repo / "playbooks" / "meta" / "argument_specs.yml"]


def declared_variables(repo: Path = REPO) -> dict[str, dict[str, Any]]:
    """name -> option spec, over every entry point of every role and the playbooks' variables."""
    declared: dict[str, dict[str, Any]] = {}
    for path in spec_files(repo):
        if not path.is_file():
            continue
        specs = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("argument_specs") or {}
        for entry in specs.values():
            for name, option in ((entry or {}).get("options") or {}).items():
                declared.setdefault(name, {}).update(option or {})
    return declared


def prefixes(repo: Path = REPO) -> set[str]:
    """`vllm_server_`, `vllm_`, `gguf_weights_`, `gguf_`, ... and `mlafleet_`."""
    out = {"mlafleet_"}
    for role in (repo / "roles").iterdir():
        if (role / "meta" / "argument_specs.yml").is_file():
            out.add(role.name + "_")
            out.add(role.name.split("_")[0] + "_")
    return out


def closest(name: str, declared: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.5)
    return found[0] if found else None


def unknown_variables(names: Iterable[str], declared: dict[str, Any], ours: set[str]) -> list[tuple[str, str | None]]:
    """(name, closest declared name or None) for each of `names` that looks like ours but is not declared."""
    out = []
    for name in sorted(set(names)):
        if name.startswith("_") or name in declared or not any(name.startswith(p) for p in ours):
            continue
        out.append((name, closest(name, declared)))
    return out


def warning_text(name: str, suggestion: str | None, where: str) -> str:
    hint = f"did you mean {suggestion}?" if suggestion else "no declared name is close"
    return f"{name} ({where}): no mlafleet role or playbook declares it, so nothing reads it; {hint}"


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
