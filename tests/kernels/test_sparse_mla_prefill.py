"""fp8_ds_mla prefill through a bf16 workspace (sparse_mla.attend_prefill_fp8_ds_mla), on the CPU.

The workspace must hold exactly the values the fp8 kernel attends over (fp8 x scale rounded to
bf16), read through each request's block table from a paged cache whose unread rows are NaN
bytes; the attention over it must equal the float32 reference over the same cache rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlafleet.kernels.sparse_mla import (
    FP8_TOKEN_BYTES,
    PREFILL_WS_MIN_TOKENS,
    PREFILL_WS_ROWS_PER_TOKEN,
    attend_prefill_fp8_ds_mla,
    dequantize_context_fp8_ds_mla,
    prefill_segment_rows,
    use_prefill_workspace,
)
from oracles import dequantize_fp8_ds_mla, quantize_fp8_ds_mla, reference_sparse_mla_fp8

SCALE = 1.0 / math.sqrt(256)
PAGE = 64
ROWS_PER_BLOCK = 96  # another layer's rows between this cache's blocks (vLLM's shared pages)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def paged_cache(gen: torch.Generator, num_blocks: int, raw_bytes: bool) -> torch.Tensor:
    """uint8 rows [num_blocks * ROWS_PER_BLOCK, 656]: every block's 64 token rows filled, the rows
    between blocks NaN bytes (0xff). raw_bytes: random float8 bytes (subnormals, -0 included, no
    NaN) and random float32 scales, else quantize_fp8_ds_mla of random values."""
    rows = torch.full((num_blocks * ROWS_PER_BLOCK, FP8_TOKEN_BYTES), 0xFF, dtype=torch.uint8)
    n = num_blocks * PAGE
    if raw_bytes:
        vals = torch.randint(0, 256, (n, 512), generator=gen, dtype=torch.uint8)
        vals[(vals & 0x7F) == 0x7F] = 0x80  # no NaN: -0 instead
        scales = (torch.rand((n, 4), generator=gen) * 3 + 1e-3).float()
        rope = torch.randn((n, 64), generator=gen).bfloat16()
        token = torch.cat([vals, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)
    else:
        token = quantize_fp8_ds_mla(torch.randn((n, 576), generator=gen))
    slots = (torch.arange(num_blocks)[:, None] * ROWS_PER_BLOCK + torch.arange(PAGE)).reshape(-1)
    rows[slots] = token
    return rows


@pytest.mark.parametrize("raw_bytes", [True, False])
def test_context_dequantised_bitwise(gen: torch.Generator, raw_bytes: bool) -> None:
    rows = paged_cache(gen, 8, raw_bytes)
    seq_lens = torch.tensor([70, 0, 129], dtype=torch.int32)
    block_table = torch.tensor([[5, 2, 0], [1, 1, 1], [7, 3, 6]], dtype=torch.int32)
    seg = prefill_segment_rows(int(seq_lens.max()))
    assert seg == 192
    ws = torch.full((3 * seg + 5, 576), 7.0, dtype=torch.bfloat16)
    dequantize_context_fp8_ds_mla(rows, ROWS_PER_BLOCK, block_table, seq_lens, ws, seg)
    for j, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        slots = block_table[j, pos // PAGE].long() * ROWS_PER_BLOCK + pos % PAGE
        want = dequantize_fp8_ds_mla(rows[slots]).bfloat16()
        got = ws[j * seg: j * seg + n]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"request {j}"
        assert bool((ws[j * seg + n: (j + 1) * seg] == 7.0).all()), f"request {j}: rows past its context written"
    assert bool((ws[3 * seg:] == 7.0).all())


def test_prefill_through_workspace_matches_reference(gen: torch.Generator) -> None:
    rows = paged_cache(gen, 8, raw_bytes=False)
    seq_lens = torch.tensor([100, 130], dtype=torch.int32)
    block_table = torch.tensor([[6, 0, 4], [3, 7, 1]], dtype=torch.int32)
    seg_of_token = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    topk, heads = 128, 16
    pos = torch.full((5, topk), -1, dtype=torch.int32)
    for t, j in enumerate(seg_of_token.tolist()):
        chosen = torch.randperm(int(seq_lens[j]), generator=gen)[: topk - 20 - 3 * t]
        pos[t, : len(chosen)] = chosen.to(torch.int32)
    pos[1, -1] = int(seq_lens[0])  # past its context: none (never the next request's rows)
    pos[2, -2] = 5000
    q = (torch.randn((5, heads, 576), generator=gen) * 0.5).bfloat16()
    seg = prefill_segment_rows(130)
    ws = torch.full((2 * seg, 576), float("nan"), dtype=torch.bfloat16)
    out = attend_prefill_fp8_ds_mla((q[..., :512], q[..., 512:]), rows, ROWS_PER_BLOCK, block_table, seq_lens,
                                    seg_of_token, pos.view(5, 1, topk), SCALE, ws, seg)
    # the reference over the same cache rows: global slots by hand, past the context -1
    j = seg_of_token.long()[:, None]
    inside = (pos >= 0) & (pos < seq_lens.long()[j])
    p = pos.clamp(min=0).long()
    slots = block_table.long()[j, (p // PAGE).clamp(max=2)] * ROWS_PER_BLOCK + p % PAGE
    slots = torch.where(inside, slots, -1).to(torch.int32).view(5, 1, topk)
    ref, _ = reference_sparse_mla_fp8(q, rows.view(-1, 1, FP8_TOKEN_BYTES), slots, SCALE)
    assert out.shape == (5, heads, 512) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    err = ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-2, err


def test_use_prefill_workspace_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE", raising=False)
    seg = prefill_segment_rows(4000)
    assert seg == 4032
    assert use_prefill_workspace(4096, 1, 4000, 65536)
    assert use_prefill_workspace(PREFILL_WS_MIN_TOKENS, 1, 4000, 65536)
    assert not use_prefill_workspace(PREFILL_WS_MIN_TOKENS - 1, 1, 4000, 65536)  # too few tokens
    assert not use_prefill_workspace(4096, 0, 4000, 65536)  # no prefill request
    assert not use_prefill_workspace(4096, 17, 4000, 65536)  # 17 contexts of 4032 rows: over 65536
    assert use_prefill_workspace(4096, 16, 4000, 65536)
    rows_cap = PREFILL_WS_ROWS_PER_TOKEN * 64
    assert use_prefill_workspace(64, 1, rows_cap, 1 << 20)
    assert not use_prefill_workspace(64, 1, rows_cap + 1, 1 << 20)  # a long context for 64 tokens
    # the operator's switch in the server's environment
    monkeypatch.setenv("MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE", "off")
    assert not use_prefill_workspace(4096, 1, 4000, 65536)
    monkeypatch.setenv("MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE", " Auto ")
    assert use_prefill_workspace(4096, 1, 4000, 65536)
    monkeypatch.setenv("MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE", "no")
    with pytest.raises(ValueError, match=r"MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE='no' is not one of auto, off"):
        use_prefill_workspace(4096, 1, 4000, 65536)


def test_bad_operands_named(gen: torch.Generator) -> None:
    rows = paged_cache(gen, 2, raw_bytes=False)
    seq_lens = torch.tensor([10], dtype=torch.int32)
    bt = torch.tensor([[1]], dtype=torch.int32)
    ws = torch.empty((64, 576), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_table must be int32"):
        dequantize_context_fp8_ds_mla(rows, ROWS_PER_BLOCK, bt.long(), seq_lens, ws, 64)
    with pytest.raises(ValueError, match="seg_rows 32 must be a multiple of 64"):
        dequantize_context_fp8_ds_mla(rows, ROWS_PER_BLOCK, bt, seq_lens, ws, 32)
    with pytest.raises(ValueError, match="seg_rows 128 must be a multiple of 64 within the block table's 1"):
        dequantize_context_fp8_ds_mla(rows, ROWS_PER_BLOCK, bt, seq_lens,
                                      torch.empty((128, 576), dtype=torch.bfloat16), 128)
    with pytest.raises(ValueError, match="out must be bf16"):
        dequantize_context_fp8_ds_mla(rows, ROWS_PER_BLOCK, bt, seq_lens, ws.float(), 64)
    with pytest.raises(ValueError, match="rows must be uint8"):
        dequantize_context_fp8_ds_mla(rows[:, :600], ROWS_PER_BLOCK, bt, seq_lens, ws, 64)
    with pytest.raises(ValueError, match="positions must be int32"):
        attend_prefill_fp8_ds_mla(torch.zeros((1, 16, 576), dtype=torch.bfloat16), rows, ROWS_PER_BLOCK, bt,
                                  seq_lens, torch.zeros(1, dtype=torch.int32),
                                  torch.zeros((1, 1, 128), dtype=torch.int64), SCALE, ws, 64)
