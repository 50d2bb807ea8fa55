"""bench/engine_gpu.sh fp8-block as far as it runs without a GPU (DRY_RUN=1): the block-FP8 snapshot
written, its manifest built, staged by the weights role (bench/engine_weights.yml, connection
local, the controller's ansible-playbook standing in for the bundle's) into the lab-like layout,
and every engine run's plan (bench/engine_e2e.py --dry-run) pointing at the staged directory.

The snapshot is a narrowed tiny GLM-5 (E2E_FP8_CONFIG) to stay quick; the GPU run writes the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.mlafleet.fleet.plugins.module_utils import safetensors_check as check

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "engine_gpu.sh"
SMALL = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 2,
         "intermediate_size": 512}
RUNS = ["fp8-ours-auto", "fp8-ref-auto", "fp8-ours-fp8_ds_mla", "fp8-ref-fp8_ds_mla", "fp8-oursnodg-auto"]


def dry_run(work: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    out.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "DRY_RUN", "VLLM_DEEP_GEMM_WARMUP", "VLLM_USE_DEEP_GEMM")}
    full.update(DRY_RUN="1", E2E_WORK=str(work), E2E_PYTHON=sys.executable, E2E_FP8_CONFIG=json.dumps(SMALL),
                E2E_ANSIBLE_PLAYBOOK=str(Path(sys.executable).parent / "ansible-playbook"),
                ANSIBLE_LOCAL_TEMP=str(work / ".ansible-tmp"))
    full.update(env)
    return subprocess.run(["bash", str(SCRIPT), "fp8-block", str(out)], capture_output=True, text=True, env=full,
                          timeout=300, check=False)


def plans(stdout: str) -> dict[str, dict]:
    lines = stdout.splitlines()
    return {line.split()[1]: json.loads(lines[k + 1]) for k, line in enumerate(lines)
            if line.startswith("== fp8-") and line.endswith(": dry run")}


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fp8-block")
    done = dry_run(root / "work", root / "out")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    return {"work": root / "work", "out": root / "out", "done": done}


def test_the_snapshot_is_staged_by_the_weights_role_into_the_lab_layout(staged: dict) -> None:
    work, out = staged["work"], staged["out"]
    origin, lab = work / "models" / "tiny-glm5-fp8", work / "lab" / "opt" / "mlafleet" / "models" / "tiny-glm5-fp8"
    record = json.loads((out / "fp8-block-staging.json").read_text())
    assert record["served"] == str(lab) and record["written"] == str(origin)
    assert record["staged_by"].startswith("the weights role")
    assert record["manifest"]["model"] == "tiny-glm5-fp8" and record["manifest"]["revision"] is None
    assert record["manifest"]["weight_block_size"] == [128, 128] and record["manifest"]["fp8_weights"] == 26
    names = sorted(p.name for p in origin.iterdir())
    assert sorted(p.name for p in lab.iterdir() if not p.name.startswith(".")) == names
    for name in names:
        assert (lab / name).read_bytes() == (origin / name).read_bytes(), name
    assert check.check_snapshot(str(lab), names)["fp8_weights"] == 26
    log = (out / "fp8-block-staging.log").read_text()
    assert f"all 9 of 9 files verified in {lab}" in log and "failed=0" in log
    assert f"== serving {lab} (staged by the weights role" in staged["done"].stdout


def test_every_run_is_planned_on_the_staged_snapshot(staged: dict) -> None:
    lab = staged["work"] / "lab" / "opt" / "mlafleet" / "models" / "tiny-glm5-fp8"
    planned = plans(staged["done"].stdout)
    assert list(planned) == RUNS
    for name, plan in planned.items():
        assert plan["llm"]["model"] == plan["llm"]["tokenizer"] == str(lab), name
        assert plan["weights"] == "fp8-block safetensors" and plan["throughput"] is False
        assert plan["llm"]["enforce_eager"] is True and plan["llm"]["tensor_parallel_size"] == 1
        assert plan["llm"]["kv_cache_dtype"] == name.rsplit("-", 1)[1]
        assert max(plan["prompt_lengths"]) > plan["index_topk"] == 2048  # the indexer selects
        ours = "-ours" in name
        assert plan["llm"]["attention_config"] == {"backend": "TRITON_MLA_SPARSE" if ours else "FLASHMLA_SPARSE"}
        assert plan["env"] == ({"MLAFLEET_INDEXER_FALLBACK": "1", "MLAFLEET_INDEXER_TOPK": "triton"} if ours
                               else {"MLAFLEET_INDEXER_FALLBACK": None})
        assert plan["deep_gemm"] is ("nodg" not in name)
        # DeepGEMM's warm-up (3412 shapes JIT-compiled on the H100's fresh machine) ran past a run's cap
        assert plan["deep_gemm_warmup"] == "skip", name
    assert "== dry run: no engine ran" in staged["done"].stdout
    assert not list((staged["work"] / "results").glob("*.json"))


def test_a_second_call_changes_nothing(staged: dict, tmp_path: Path) -> None:
    origin = staged["work"] / "models" / "tiny-glm5-fp8"
    before = {p.name: p.stat().st_mtime_ns for p in origin.iterdir()}
    done = dry_run(staged["work"], tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "snapshot written" not in done.stdout  # written once
    assert {p.name: p.stat().st_mtime_ns for p in origin.iterdir()} == before
    assert "changed=0" in (tmp_path / "out" / "fp8-block-staging.log").read_text()
    assert list(plans(done.stdout)) == RUNS


def test_a_callers_deep_gemm_warmup_is_kept(staged: dict, tmp_path: Path) -> None:
    done = dry_run(staged["work"], tmp_path / "out", VLLM_DEEP_GEMM_WARMUP="full")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    planned = plans(done.stdout)
    assert list(planned) == RUNS and all(plan["deep_gemm_warmup"] == "full" for plan in planned.values())


def test_without_the_role_the_written_directory_is_served_and_says_so(staged: dict, tmp_path: Path) -> None:
    done = dry_run(staged["work"], tmp_path / "out", E2E_ANSIBLE_PLAYBOOK="false")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    origin = staged["work"] / "models" / "tiny-glm5-fp8"
    record = json.loads((tmp_path / "out" / "fp8-block-staging.json").read_text())
    assert record["served"] == str(origin) and record["staged_by"].startswith("none: the weights role failed")
    assert all(plan["llm"]["model"] == str(origin) for plan in plans(done.stdout).values())


def test_a_machine_without_setup_is_named(tmp_path: Path) -> None:
    done = dry_run(tmp_path / "work", tmp_path / "out", E2E_PYTHON=str(tmp_path / "none" / "python"))
    assert done.returncode == 3 and "no setup on this machine" in done.stderr
    usage = subprocess.run(["bash", str(SCRIPT), "nope", str(tmp_path)], capture_output=True, text=True, check=False,
                           env={**os.environ, "E2E_WORK": str(tmp_path / "work"), "E2E_PYTHON": sys.executable})
    assert usage.returncode == 2 and "fp8-block|" in usage.stderr
