"""Variables that look like ours but that nothing declares: the check of `mlafleet_check_vars`.

A misspelled variable (`vllm_verison`, `vllm_server_portt`) is silently ignored by Ansible: the
role runs with its default. A variable is "ours" when it carries one of our prefixes (a role's
name, the first word of one, or `mlafleet_`); it is declared when some role's
meta/argument_specs.yml or the playbooks' (playbooks/meta/argument_specs.yml) names it.

Plain Python on the controller: the action plugin (plugins/action/mlafleet_check_vars.py) and the
mlafleet CLI (which masks the no_log variables in its reports) import it by its collection name,
ansible_collections.mlafleet.fleet.plugins.plugin_utils.check_vars.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml

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
    """`vllm_server_`, `vllm_`, `weights_`, `gguf_`, ... and `mlafleet_`."""
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
