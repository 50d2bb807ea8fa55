"""Filter `gguf_weights_manifest_problem`: what is wrong with a manifest, "" when nothing is.

The check itself is the host module's (library/gguf_weights_stage.py `check_manifest`: the
format, the model name, split_count and every shard name, 1..N of N), run here on the controller
so that a bad manifest is refused before the role creates anything on any host.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

LIBRARY = Path(__file__).resolve().parent.parent / "library" / "gguf_weights_stage.py"


def _stager() -> ModuleType:
    name = "gguf_weights_stage_for_filter"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LIBRARY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


def manifest_problem(manifest: Any) -> str:
    stager = _stager()
    try:
        stager.check_manifest(manifest)
    except stager.StageError as err:
        return str(err)
    return ""


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"gguf_weights_manifest_problem": manifest_problem}
