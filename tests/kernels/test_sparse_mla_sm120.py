"""Every config the sparse-MLA launcher can choose fits SM120: compiled for sm_120, no GPU.

The compilation runs in one child Python without TRITON_INTERPRET (this suite interprets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlafleet.kernels.sparse_mla import CONFIGS
from sm120 import SM120_MAX_SHARED_BYTES, sparse_mla_specs

CHILD = """
import dataclasses, json
from sm120 import compile_for_sm120, sparse_mla_specs
for spec in sparse_mla_specs():
    report = compile_for_sm120(**spec)
    print("REPORT", json.dumps({**dataclasses.asdict(report), "constexprs": spec["constexprs"]}))
"""


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[len("REPORT "):]) for line in proc.stdout.splitlines()
            if line.startswith("REPORT ")]


def test_every_config_is_compiled(reports: list[dict]) -> None:
    # each config for its cache dtype x {final, partial} (an fp8 config also for the plain
    # fp8 cache: ROPE_E4M3) x {untrimmed, trimmed key loop} where the config trims, and the merge kernel
    assert len(reports) == len(sparse_mla_specs())
    main = [r for r in reports if r["name"] == "_sparse_mla_kernel"]
    want = {(dtype, c.block_h, c.block_n, c.num_warps, c.num_stages, c.scale_logits, plain, partial, trim)
            for (dtype, _), c in CONFIGS.items() for plain in ((False, True) if dtype == "fp8" else (False,))
            for partial in (False, True) for trim in ((False, True) if c.trim_tail else (False,))}
    assert len(main) == len(want)
    seen = {("fp8" if r["constexprs"]["FP8"] else "bf16", r["constexprs"]["BLOCK_H"], r["constexprs"]["BLOCK_N"],
             r["num_warps"], r["num_stages"], r["constexprs"]["SCALE_LOGITS"], r["constexprs"]["ROPE_E4M3"],
             r["constexprs"]["PARTIAL"], r["constexprs"]["TRIM_TAIL"]) for r in main}
    assert seen == want
    assert any(k[-1] for k in seen) and not all(k[-1] for k in seen)
    # and the fp8_ds_mla prefill workspace's kernels, once each
    names = [r["name"] for r in reports]
    assert names.count("_fp8_ds_mla_context_kernel") == 1 and names.count("_workspace_rows_kernel") == 1


def test_every_config_fits_sm120(reports: list[dict]) -> None:
    too_big = [r for r in reports if r["shared_bytes"] > SM120_MAX_SHARED_BYTES]
    spilled = [r for r in reports if r["spill_store_bytes"] + r["spill_load_bytes"] > 0]
    assert not too_big, f"over {SM120_MAX_SHARED_BYTES} bytes of shared memory: {too_big}"
    assert not spilled, f"register spills: {spilled}"
    assert all(0 < r["registers"] <= 255 for r in reports)
    assert all(r["shared_bytes"] > 0 for r in reports if r["name"] == "_sparse_mla_kernel")


def test_triton_kernels_wait_for_the_grid_before(reports: list[dict]) -> None:
    # on SM12x the launcher launches the split and merge kernels with programmatic dependent launch
    # (sparse_mla._pdl): each must wait (griddepcontrol.wait) before it reads what the kernel before
    # it wrote (q and the indices; the partials), or it could read them unwritten
    triton_kernels = [r for r in reports if r["name"] in ("_sparse_mla_kernel", "_merge_splits_kernel")]
    assert {r["name"] for r in triton_kernels} == {"_sparse_mla_kernel", "_merge_splits_kernel"}
    assert all(r["constexprs"]["PDL"] and r["grid_dependency_wait"] for r in triton_kernels)
    assert not any(r["grid_dependency_wait"] for r in reports if r["name"] == "sparse_mla_fp8_grouped")


def test_gluon_kernel_fits_two_programs_an_sm(reports: list[dict]) -> None:
    # the Gluon fp8_ds_mla kernel (SM12x's fp8_ds_mla prefill path): final and partial outputs, each
    # with and without the trimmed key loop; its point is two programs an sm_120 SM, in shared
    # memory (2 x 49 KB of 99 KB) and in registers (2 x 4 warps x 32 threads x registers of 64K)
    from mlafleet.kernels.sparse_mla import GLUON_FP8

    gluon = [r for r in reports if r["name"] == "sparse_mla_fp8_grouped"]
    assert {(r["constexprs"]["PARTIAL"], r["constexprs"]["TRIM_TAIL"]) for r in gluon} == {
        (p, t) for p in (False, True) for t in (False, True)}
    for r in gluon:
        assert r["constexprs"]["STAGES"] == GLUON_FP8.num_stages and r["num_warps"] == 4
        assert 2 * r["shared_bytes"] <= SM120_MAX_SHARED_BYTES, r
        assert 2 * 128 * r["registers"] <= 65536, r
