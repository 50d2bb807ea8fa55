"""The indexer's Triton kernels fit SM120 (RTX PRO 6000 class: 101376 bytes of shared memory a
block, no register spills): every configuration the launchers can choose for GLM-5 (32 index
heads) and DeepSeek-V3.2 (64), compiled for sm_120 without a GPU.

The compile runs in a child Python without TRITON_INTERPRET: under the interpreter (which the
CPU kernel tests need, chosen when triton is first imported) triton's own library functions
cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PREFILL = [{"heads": h, "clean": c} for h in (32, 64) for c in (False, True)]
TOPK = [{"starts": st} for st in (False, True)]
PAGED = [{"heads": h, "next_n": n, "clean": c, "ctx_2d": not c} for h in (32, 64) for n in (1, 2) for c in (False, True)]

SCRIPT = r'''
import json, sys
from mlafleet.kernels import indexer as ix
from sm120 import compile_for_sm120  # tests/kernels/sm120.py

PREFILL_SIG = {
    "q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "ks_ptr": "*i32", "ke_ptr": "*i32", "scale_ptr": "*fp32",
    "w_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "H": "i32",
    "stride_qm": "i32", "stride_qh": "i32", "stride_kn": "i32", "stride_wm": "i32", "stride_om": "i32",
    "SPLIT": "i32",
}
# Unit strides: Triton's JIT turns an int argument equal to 1 into a constant.
PREFILL_UNIT = {"stride_qd": 1, "stride_kd": 1, "stride_wh": 1, "stride_on": 1, "stride_scale": 1}
PAGED_SIG = {
    "q_ptr": "*fp8e4nv", "values_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "w_ptr": "*fp32", "ctx_ptr": "*i32",
    "bt_ptr": "*i32", "out_ptr": "*fp32", "H": "i32", "NEXT_N": "i32", "MAX_LEN": "i32", "SCALE_OFF": "i32",
    "stride_qb": "i32", "stride_qn": "i32", "stride_qh": "i32",
    "stride_vblk": "i32", "stride_sblk": "i32", "stride_wm": "i32",
    "stride_cb": "i32", "stride_btb": "i32", "stride_om": "i32", "SPLIT": "i32",
}
PAGED_UNIT = {"stride_qd": 1, "stride_wh": 1}
TOPK_SIG = {
    "logits_ptr": "*fp32", "starts_ptr": "*i32", "ends_ptr": "*i32", "out_ptr": "*i32", "N": "i32", "TOPK": "i32",
    "stride_lr": "i32", "stride_lc": "i32", "stride_or": "i32",
}
# What Triton's JIT sees at launch for vLLM's contiguous tensors: 16-byte aligned pointers and
# row strides that are multiples of 16, so the code compiled here is the code that runs.
PREFILL_ALIGNED = ("q_ptr", "k_ptr", "ks_ptr", "ke_ptr", "scale_ptr", "w_ptr", "out_ptr",
                   "stride_qm", "stride_qh", "stride_kn", "stride_wm")
PAGED_ALIGNED = ("q_ptr", "values_ptr", "scales_ptr", "w_ptr", "ctx_ptr", "bt_ptr", "out_ptr",
                 "stride_qb", "stride_qn", "stride_qh", "stride_vblk", "stride_sblk", "stride_wm")

def report(r):
    return {"fits": r.fits(), "shared": r.shared_bytes, "spills": r.spills, "registers": r.registers, "text": str(r)}

configs = json.loads(sys.argv[1])
out = {"prefill": [], "paged": []}
for c in configs["prefill"]:
    hp = c["heads"]
    out["prefill"].append(report(compile_for_sm120(
        ix._mqa_logits_kernel, PREFILL_SIG,
        {"BLOCK_M": ix._prefill_block_m(hp), "HP": hp, "D": 128, "BLOCK_N": ix.PREFILL_BLOCK_N, "CLEAN": c["clean"],
         "KEY_MAJOR": ix.PREFILL_KEY_MAJOR, **PREFILL_UNIT},
        num_warps=ix.PREFILL_WARPS, num_stages=ix.PREFILL_STAGES, aligned=PREFILL_ALIGNED,
        maxnreg=ix.SM12X_MAXNREG)))
for c in configs["paged"]:
    # context_lens [B, next_n] has a unit column stride; for [B] the launcher passes 0
    sig = {**PAGED_SIG, **({} if c["ctx_2d"] else {"stride_cn": "i32"})}
    unit = {**PAGED_UNIT, **({"stride_cn": 1} if c["ctx_2d"] else {})}
    out["paged"].append(report(compile_for_sm120(
        ix._paged_mqa_logits_kernel, sig,
        {"NP": c["next_n"], "HP": c["heads"], "D": 128, "BLOCK_SIZE": 64, "CTX_2D": c["ctx_2d"], "CLEAN": c["clean"],
         "KEY_MAJOR": ix.DECODE_KEY_MAJOR, **unit},
        num_warps=ix.DECODE_WARPS, num_stages=ix.DECODE_STAGES, aligned=PAGED_ALIGNED)))
out["topk"] = []
SPLIT_HIST_SIG = {"logits_ptr": "*fp32", "starts_ptr": "*i32", "ends_ptr": "*i32", "hist_ptr": "*i32",
                  "state_ptr": "*i32", "N": "i32", "TOPK": "i32", "stride_lr": "i32", "stride_lc": "i32", "SPLIT": "i32"}
SPLIT_SELECT_SIG = {"logits_ptr": "*fp32", "starts_ptr": "*i32", "ends_ptr": "*i32", "state_ptr": "*i32",
                    "count_ptr": "*i32", "out_ptr": "*i32", "N": "i32", "TOPK": "i32", "stride_lr": "i32",
                    "stride_lc": "i32", "stride_or": "i32", "SPLIT": "i32"}
for c in configs["topk"]:
    fit = []
    for one_block, short_ranges in ((False, True), (False, False), (True, True)):
        fit.append(report(compile_for_sm120(
            ix._topk_kernel, TOPK_SIG, {"HAS_STARTS": c["starts"], "BLOCK": ix.TOPK_BLOCK, "ONE_BLOCK": one_block,
                                        "EARLY_STOP": True, "SHORT_RANGES": short_ranges},
            num_warps=ix.TOPK_WARPS, num_stages=1, aligned=("logits_ptr", "out_ptr", "stride_or"))))
    for p in range(4):
        fit.append(report(compile_for_sm120(
            ix._topk_split_hist_kernel, SPLIT_HIST_SIG, {"PASS": p, "HAS_STARTS": c["starts"], "BLOCK": ix.TOPK_BLOCK},
            num_warps=ix.TOPK_WARPS, num_stages=1, aligned=("logits_ptr", "hist_ptr"))))
        fit.append(report(compile_for_sm120(
            ix._topk_split_choose_kernel, {"hist_ptr": "*i32", "state_ptr": "*i32", "TOPK": "i32"}, {"PASS": p},
            num_warps=1, num_stages=1, aligned=("hist_ptr",))))
    fit.append(report(compile_for_sm120(
        ix._topk_split_select_kernel, SPLIT_SELECT_SIG, {"HAS_STARTS": c["starts"], "BLOCK": ix.TOPK_BLOCK},
        num_warps=ix.TOPK_WARPS, num_stages=1, aligned=("logits_ptr", "out_ptr", "stride_or"))))
    out["topk"].append(fit)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def reports() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps({"prefill": PREFILL, "paged": PAGED, "topk": TOPK})],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(PREFILL)), ids=[f"{c['heads']}h-clean{c['clean']}" for c in PREFILL])
def test_prefill_kernel_fits_sm120(reports: dict, index: int) -> None:
    r = reports["prefill"][index]
    assert r["fits"], r["text"]
    assert r["shared"] > 0 and r["registers"] > 0  # fp8 tiles staged in shared memory for the dot


@pytest.mark.parametrize("index", range(len(TOPK)), ids=[f"starts{c['starts']}" for c in TOPK])
def test_topk_kernels_fit_sm120(reports: dict, index: int) -> None:
    # one program a row (short ranges at run time, streaming only, one block); the split path's
    # hist x4, choose x4, select
    kernels = reports["topk"][index]
    assert len(kernels) == 12
    for r in kernels:
        assert r["fits"], r["text"]
    assert kernels[0]["shared"] > 0 and kernels[1]["shared"] > 0 and kernels[2]["shared"] > 0  # the histograms


@pytest.mark.parametrize("index", range(len(PAGED)),
                         ids=[f"{c['heads']}h-next{c['next_n']}-clean{c['clean']}" for c in PAGED])
def test_paged_kernel_fits_sm120(reports: dict, index: int) -> None:
    r = reports["paged"][index]
    assert r["fits"], r["text"]
    assert r["shared"] > 0 and r["registers"] > 0
