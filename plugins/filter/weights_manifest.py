"""Filter `mlafleet.fleet.weights_manifest_problem`: what is wrong with a manifest, "" when nothing is.

The check itself is the staging code's (plugins/module_utils/weights_stage.py `check_manifest`, which
the host module runs: the format, the model name, split_count and every shard name, 1..N of N),
run here on the controller so that a bad manifest is refused before the role creates anything on
any host.
"""

from __future__ import annotations

from typing import Any

from ansible_collections.mlafleet.fleet.plugins.module_utils.weights_stage import StageError, check_manifest


def manifest_problem(manifest: Any) -> str:
    try:
        check_manifest(manifest)
    except StageError as err:
        return str(err)
    return ""


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"weights_manifest_problem": manifest_problem}
