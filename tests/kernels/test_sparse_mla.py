"""Triton sparse-MLA kernels against the float32 torch references (oracles.py), on the CPU (interpreter).

Every cache row that no index names is NaN, so a kernel that reads a row it should not
(padding, an invalid index, a masked tile) fails loudly. Shapes are small but each case of
issue 3 is covered: invalid indices, topk and head counts, duplicates, large logits,
strided q, split/unsplit, the fp8_ds_mla layout, and the plain fp8 layout (vLLM's `fp8`
MLA cache: e4m3 values and one scale).
"""

from __future__ import annotations

import math

import pytest
import torch

from mlafleet.kernels.sparse_mla import (
    CONFIGS,
    FP8_TOKEN_BYTES,
    GLUON_FP8,
    _gluon_unfit,
    _merge_block_d,
    choose_config,
    choose_num_splits,
    sparse_mla_fwd,
    sparse_mla_fwd_fp8,
    sparse_mla_fwd_fp8_e4m3,
)
from oracles import (
    dequantize_fp8_ds_mla,
    quantize_fp8_ds_mla,
    quantize_fp8_e4m3,
    reference_sparse_mla,
    reference_sparse_mla_fp8,
    reference_sparse_mla_fp8_e4m3,
)

SCALE = 1.0 / math.sqrt(256)  # GLM-5's softmax scale
# triton 3.6's interpreter converts 1-element arrays to ints, which numpy deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_cache(gen: torch.Generator, s_kv: int, indices: torch.Tensor) -> torch.Tensor:
    """bf16 kv [s_kv, 1, 576]: random where an index names the row, NaN everywhere else."""
    kv = torch.full((s_kv, 1, 576), float("nan"), dtype=torch.bfloat16)
    named = indices[(indices >= 0) & (indices < s_kv)].long().unique()
    kv[named] = torch.randn(len(named), 1, 576, generator=gen).bfloat16()
    return kv


def make_fp8_cache(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The fp8_ds_mla cache [num_blocks, 64, 1, 656] of kv; unnamed rows are NaN bytes (0xff)."""
    s_kv = kv.shape[0]
    assert s_kv % 64 == 0, "same slot count as kv, so the same indices are out of range"
    blocks = s_kv // 64
    cache = torch.full((s_kv, FP8_TOKEN_BYTES), 0xFF, dtype=torch.uint8)
    named = indices[(indices >= 0) & (indices < s_kv)].long().unique()
    cache[named] = quantize_fp8_ds_mla(kv[named, 0])
    return cache.view(blocks, 64, 1, FP8_TOKEN_BYTES)


def make_plain_fp8_cache(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The plain fp8 cache [s_kv, 1, 576] of kv and its scale; unnamed rows are NaN (0x7f)."""
    named = indices[(indices >= 0) & (indices < kv.shape[0])].long().unique()
    x, scale = quantize_fp8_e4m3(kv[named])
    cache = torch.full(kv.shape, 0x7F, dtype=torch.uint8)
    cache[named] = x.view(torch.uint8)
    return cache.view(torch.float8_e4m3fn), scale


def check_plain_fp8(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, **kw) -> None:
    """The plain fp8 kernel against its reference, with the scale as a device tensor."""
    cache, scale = make_plain_fp8_cache(kv, indices)
    check(*sparse_mla_fwd_fp8_e4m3(q, cache, indices, SCALE, torch.tensor([scale]), **kw),
          *reference_sparse_mla_fp8_e4m3(q, cache, indices, SCALE, scale))


def random_indices(gen: torch.Generator, s_q: int, topk: int, s_kv: int) -> torch.Tensor:
    return torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)


def check(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """bf16-operand tolerance, row by row; rows with no valid index exactly 0 with LSE +inf."""
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isposinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty)
    assert torch.all(out[empty] == 0)
    assert torch.allclose(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-3)
    diff = (out.float() - ref_out)[~empty].norm(dim=-1)
    rel = diff / ref_out[~empty].norm(dim=-1)
    assert rel.numel() == 0 or rel.max() < 1e-2, f"max row error {rel.max():.3e}"


def run_both(gen: torch.Generator, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
             sm_scale: float = SCALE, **kw) -> None:
    """The bf16 kernel against its reference, and the fp8 kernel against its own."""
    check(*sparse_mla_fwd(q, kv, indices, sm_scale, **kw), *reference_sparse_mla(q, kv, indices, sm_scale))
    cache = make_fp8_cache(kv, indices)
    check(*sparse_mla_fwd_fp8(q, cache, indices, sm_scale, **kw),
          *reference_sparse_mla_fp8(q, cache, indices, sm_scale))


@pytest.mark.parametrize("topk", [1, 64, 1000, 2047, 2048])
def test_topk(gen: torch.Generator, topk: int) -> None:
    s_kv = 4096
    s_q = 1 if topk > 1000 else 2
    idx = random_indices(gen, s_q, topk, s_kv)
    q = torch.randn(s_q, 16, 576, generator=gen).bfloat16()
    run_both(gen, q, make_cache(gen, s_kv, idx), idx)


# GLM-5's 64 heads per GPU at tensor parallel 8/4/2/1 are 8/16/32/64; 128 is DeepSeek-V3.2's.
@pytest.mark.parametrize("h_q", [1, 8, 16, 24, 32, 64, 128])
def test_heads(gen: torch.Generator, h_q: int) -> None:
    s_kv = 512
    idx = random_indices(gen, 2, 80, s_kv)
    idx[1, 0, ::7] = -1
    q = torch.randn(2, h_q, 576, generator=gen).bfloat16()
    run_both(gen, q, make_cache(gen, s_kv, idx), idx)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_every_config(gen: torch.Generator, key: tuple[str, str]) -> None:
    # each config the launcher can choose, explicitly (the launcher picks some only at sizes
    # too large for the interpreter): a partial last head block, invalid indices, split/unsplit
    dtype, _ = key
    cfg = CONFIGS[key]
    s_kv = 512
    idx = random_indices(gen, 2, 80, s_kv)
    idx[1, 0, ::5] = -1
    idx[0, 0, 3] = s_kv
    q = torch.randn(2, cfg.block_h + 8, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    for num_splits in (1, 3):
        if dtype == "bf16":
            check(*sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits, config=cfg),
                  *reference_sparse_mla(q, kv, idx, SCALE))
        else:
            cache = make_fp8_cache(kv, idx)
            check(*sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=num_splits, config=cfg),
                  *reference_sparse_mla_fp8(q, cache, idx, SCALE))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_all_indices_invalid(gen: torch.Generator, num_splits: int) -> None:
    s_kv = 256
    idx = torch.full((3, 1, 100), -1, dtype=torch.int32)
    kv = torch.full((s_kv, 1, 576), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(3, 24, 576, generator=gen).bfloat16()
    out, lse = sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    cache = torch.full((4, 64, 1, FP8_TOKEN_BYTES), 0xFF, dtype=torch.uint8)
    out, lse = sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=num_splits)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_trimmed_tails_exact(gen: torch.Generator, num_splits: int, monkeypatch) -> None:
    """Prefill-sized batches (TRIM_TAIL: the key loop ends at each row's last valid index): rows
    of a valid prefix and a -1 tail as the indexer writes them for a prompt's first topk
    tokens, a valid index after a run of -1, a row with nothing valid; the same outputs
    as the reference, and bit for bit those of the untrimmed loop. The trim starts at 8 query
    tokens here (TRIM_TAIL_MIN_TOKENS, 64 in use: a host-side switch, the kernel is the same),
    so the interpreter runs 8 rows, not 64."""
    import mlafleet.kernels.sparse_mla as sm

    monkeypatch.setattr(sm, "TRIM_TAIL_MIN_TOKENS", 8)
    s_q, topk, s_kv = sm.TRIM_TAIL_MIN_TOKENS, 192, 512
    idx = random_indices(gen, s_q, topk, s_kv)
    for t in range(s_q):
        idx[t, 0, (t * 37) % (topk + 1):] = -1           # valid prefixes of 0 to topk entries
    idx[5, 0, :] = -1
    idx[5, 0, topk - 1] = 17                              # the only valid index is the last
    idx[6, 0, 40:] = -1
    idx[6, 0, 150] = s_kv + 3                             # out of range after the tail: still none
    q = torch.randn(s_q, 16, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    run_both(gen, q, kv, idx, num_splits=num_splits)
    trimmed = sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits)
    monkeypatch.setattr(sm, "TRIM_TAIL_MIN_TOKENS", 10**9)
    untrimmed = sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits)
    assert torch.equal(trimmed[0], untrimmed[0]) and torch.equal(trimmed[1], untrimmed[1])
    assert torch.isposinf(trimmed[1][0]).all()            # row 0: an empty prefix


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_invalid(gen: torch.Generator, num_splits: int) -> None:
    s_kv = 320
    idx = random_indices(gen, 4, 128, s_kv)
    idx[0, 0, ::2] = -1
    idx[1, 0, 1::3] = s_kv  # first slot past the end
    idx[1, 0, 2::5] = 2**31 - 1
    idx[2] = -1  # a row with nothing valid, beside rows with something
    idx[3, 0, :100] = -1  # whole tiles (and whole splits) with nothing valid
    idx[3, 0, 100:] = torch.where(idx[3, 0, 100:] % 2 == 0, s_kv + 7, idx[3, 0, 100:])
    q = torch.randn(4, 16, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    run_both(gen, q, kv, idx, num_splits=num_splits)
    _, lse = sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits)
    assert torch.all(torch.isposinf(lse[2])) and torch.isfinite(lse[[0, 1, 3]]).all()


def test_duplicate_and_unsorted_indices(gen: torch.Generator) -> None:
    s_kv = 128
    base = torch.randperm(s_kv, generator=gen)[:40].to(torch.int32)
    idx = torch.cat([base, base.flip(0), base[:17]]).view(1, 1, -1).repeat(2, 1, 1)  # each row: 97
    idx[1, 0] = idx[1, 0, torch.randperm(97, generator=gen)]
    q = torch.randn(2, 8, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    run_both(gen, q, kv, idx)
    # duplicates count as many times as they appear: not the same as the deduplicated set
    once, _ = reference_sparse_mla(q, kv, base.view(1, 1, -1).repeat(2, 1, 1), SCALE)
    twice, _ = sparse_mla_fwd(q, kv, idx, SCALE)
    assert (twice.float() - once).abs().max() > 1e-2


def test_nan_rows_never_read(gen: torch.Generator) -> None:
    s_kv = 1024
    idx = random_indices(gen, 3, 96, s_kv)
    idx[0, 0, 5::9] = -1
    kv = make_cache(gen, s_kv, idx)
    assert kv.isnan().any(dim=-1).sum() > s_kv // 2  # most of the cache is NaN
    q = torch.randn(3, 24, 576, generator=gen).bfloat16()
    for num_splits in (1, 2):
        run_both(gen, q, kv, idx, num_splits=num_splits)


def test_large_logits(gen: torch.Generator) -> None:
    s_kv = 448
    idx = random_indices(gen, 2, 150, s_kv)
    q = (torch.randn(2, 16, 576, generator=gen) * 30).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    ref_out, ref_lse = reference_sparse_mla(q, kv, idx, 1.0)
    assert ref_lse.abs().max() > 1000  # exp() of these logits overflows float32 without the max
    check(*sparse_mla_fwd(q, kv, idx, 1.0, num_splits=1), ref_out, ref_lse)
    check(*sparse_mla_fwd(q, kv, idx, 1.0, num_splits=3), ref_out, ref_lse)


def test_noncontiguous_q(gen: torch.Generator) -> None:
    s_kv = 320
    idx = random_indices(gen, 3, 70, s_kv)
    kv = make_cache(gen, s_kv, idx)
    wide = torch.full((3, 40, 576), float("nan")).bfloat16()
    wide[:, ::2] = torch.randn(3, 20, 576, generator=gen).bfloat16()
    every_other_head = wide[:, ::2]  # head stride 2*576, NaN between the heads
    transposed = torch.randn(576, 20, 3, generator=gen).bfloat16().permute(2, 1, 0)  # dim stride != 1
    for q in (every_other_head, transposed, wide[:, 0:40:2][:, :19]):
        assert not q.is_contiguous()
        run_both(gen, q, kv, idx)


def test_q_halves_read_in_place(gen: torch.Generator) -> None:
    """q as vLLM's MLA layer hands it over (latent and RoPE halves in separate, strided
    tensors) gives the bits of the concatenated q, for every cache layout; a bad pair is named."""
    s_kv, s_q, h = 320, 3, 12
    idx = random_indices(gen, s_q, 70, s_kv)
    kv = make_cache(gen, s_kv, idx)
    q = torch.randn(s_q, h, 576, generator=gen).bfloat16()
    latent = torch.full((h, s_q, 512), float("nan")).bfloat16()
    latent.copy_(q[..., :512].transpose(0, 1))
    latent = latent.transpose(0, 1)  # [s_q, h, 512], head stride s_q * 512 (a bmm's output)
    wide = torch.full((s_q, h, 100), float("nan")).bfloat16()
    wide[..., 20:84] = q[..., 512:]
    rope = wide[..., 20:84]  # a slice of a wider tensor, NaN around it
    fp8 = make_fp8_cache(kv, idx)
    plain, kv_scale = make_plain_fp8_cache(kv, idx)
    for splits in (1, 3):
        for run in (lambda qq: sparse_mla_fwd(qq, kv, idx, SCALE, num_splits=splits),
                    lambda qq: sparse_mla_fwd_fp8(qq, fp8, idx, SCALE, num_splits=splits),
                    lambda qq: sparse_mla_fwd_fp8_e4m3(qq, plain, idx, SCALE, kv_scale, num_splits=splits)):
            out, lse = run(q)
            out2, lse2 = run((latent, rope))
            assert torch.equal(out, out2) and torch.equal(lse, lse2)
    with pytest.raises(ValueError, match="RoPE q must be"):
        sparse_mla_fwd((latent, rope[:, :5]), kv, idx, SCALE)
    with pytest.raises(ValueError, match="latent q must be"):
        sparse_mla_fwd((q, rope), kv, idx, SCALE)
    with pytest.raises(ValueError, match="q's halves differ"):
        sparse_mla_fwd((latent, rope.float()), kv, idx, SCALE)
    with pytest.raises(TypeError, match="latent, rope"):
        sparse_mla_fwd((latent, rope, rope), kv, idx, SCALE)


def test_split_and_unsplit_agree(gen: torch.Generator) -> None:
    s_kv = 5120
    idx = random_indices(gen, 2, 700, s_kv)
    idx[0, 0, 600:] = -1
    q = torch.randn(2, 24, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    cache = make_fp8_cache(kv, idx)
    ref_out, ref_lse = reference_sparse_mla(q, kv, idx, SCALE)
    for fwd, cache_in in ((sparse_mla_fwd, kv), (sparse_mla_fwd_fp8, cache)):
        base_out, base_lse = fwd(q, cache_in, idx, SCALE, num_splits=1)
        for num_splits in (2, 5, 22):
            out, lse = fwd(q, cache_in, idx, SCALE, num_splits=num_splits)
            assert torch.allclose(lse, base_lse, rtol=1e-5, atol=1e-5)
            assert (out.float() - base_out.float()).abs().max() < 2e-2
        if fwd is sparse_mla_fwd:
            check(base_out, base_lse, ref_out, ref_lse)


def test_fp8_layout_exact(gen: torch.Generator) -> None:
    x = torch.randn(70, 576, generator=gen) * torch.logspace(-3, 3, 70).unsqueeze(1)
    x[3, 128:256] = 0.0  # a group of zeros still gets a finite scale
    x[4, :128] = 448.0  # amax exactly representable: scale 1
    packed = quantize_fp8_ds_mla(x)
    assert packed.dtype == torch.uint8 and packed.shape == (70, 656)
    scales = packed[:, 512:528].contiguous().view(torch.float32)  # [70, 4]
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    amax = x[:, :512].reshape(70, 4, 128).abs().amax(-1).clamp_min(1e-4)
    assert torch.all(scales * 448 >= amax) and torch.all(scales * 224 < amax)  # the smallest such
    assert scales[4, 0] == 1.0
    fp8 = (x[:, :512].reshape(70, 4, 128) / scales[..., None]).to(torch.float8_e4m3fn).reshape(70, 512)
    assert torch.equal(packed[:, :512], fp8.view(torch.uint8))
    assert torch.equal(packed[:, 528:], x[:, 512:].bfloat16().contiguous().view(torch.uint8))
    back = dequantize_fp8_ds_mla(packed)
    assert torch.equal(back[:, :512], (fp8.float().reshape(70, 4, 128) * scales[..., None]).reshape(70, 512))
    assert torch.equal(back[:, 512:], x[:, 512:].bfloat16().float())
    assert ((back[:, :512] - x[:, :512]).abs() <= amax.repeat_interleave(128, 1) / 16).all()


def test_fp8_layout_round_trip(gen: torch.Generator) -> None:
    """A packed token whose every group reaches 448 * scale unpacks and repacks byte for byte."""
    codes = torch.randint(0, 256, (30, 512), generator=gen).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    codes[:, ::128] = 0x7E  # 448: each group's amax is 448 * its scale
    scales = torch.exp2(torch.randint(-12, 6, (30, 4), generator=gen).float())
    rope = torch.randn(30, 64, generator=gen).bfloat16()
    packed = torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)
    assert torch.equal(quantize_fp8_ds_mla(dequantize_fp8_ds_mla(packed)), packed)


def test_fp8_cache_views_agree(gen: torch.Generator) -> None:
    s_kv = 256
    idx = random_indices(gen, 2, 90, s_kv)
    q = torch.randn(2, 16, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    cache = make_fp8_cache(kv, idx)
    out4, lse4 = sparse_mla_fwd_fp8(q, cache, idx, SCALE)
    for view in (cache.view(-1, 656), cache.view(4, 64, 656)):
        out, lse = sparse_mla_fwd_fp8(q, view, idx, SCALE)
        assert torch.equal(out, out4) and torch.equal(lse, lse4)
    # the fp8 reference is the bf16 reference over the dequantised cache
    deq = dequantize_fp8_ds_mla(cache.view(-1, 656)).nan_to_num(0).bfloat16().unsqueeze(1)
    ref8, lse8 = reference_sparse_mla_fp8(q, cache, idx, SCALE)
    ref16, lse16 = reference_sparse_mla(q, deq, idx, SCALE)
    assert torch.allclose(ref8, ref16, atol=1e-5) and torch.allclose(lse8, lse16, atol=1e-5)


def test_reference_is_dense_softmax(gen: torch.Generator) -> None:
    """The reference itself, against dense attention over the gathered rows, token by token."""
    kv = torch.randn(50, 1, 576, generator=gen).bfloat16()
    q = torch.randn(3, 4, 576, generator=gen).bfloat16()
    idx = torch.randint(-1, 60, (3, 1, 20), generator=gen, dtype=torch.int32)
    out, lse = reference_sparse_mla(q, kv, idx, SCALE)
    for t in range(3):
        keep = idx[t, 0][(idx[t, 0] >= 0) & (idx[t, 0] < 50)].long()
        k = kv[keep, 0].float()
        scores = q[t].float() @ k.T * SCALE
        assert torch.allclose(out[t], torch.softmax(scores, -1) @ k[:, :512], atol=1e-5)
        assert torch.allclose(lse[t], torch.logsumexp(scores, -1), atol=1e-5)


def test_bad_inputs_are_named(gen: torch.Generator) -> None:
    q = torch.randn(2, 8, 576).bfloat16()
    kv = torch.randn(10, 1, 576).bfloat16()
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="d_v must be 512"):
        sparse_mla_fwd(q, kv, idx, SCALE, d_v=256)
    with pytest.raises(ValueError, match="q must be"):
        sparse_mla_fwd(q[..., :512], kv, idx, SCALE)
    with pytest.raises(TypeError, match="indices must be int32"):
        sparse_mla_fwd(q, kv, idx.long(), SCALE)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_mla_fwd(q, kv, idx[:1], SCALE)
    with pytest.raises(ValueError, match="kv must be"):
        sparse_mla_fwd(q, kv[:, :, :512], idx, SCALE)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        sparse_mla_fwd(q.half(), kv, idx, SCALE)
    with pytest.raises(TypeError, match="kv_cache must be uint8"):
        sparse_mla_fwd_fp8(q, kv, idx, SCALE)
    with pytest.raises(ValueError, match="656"):
        sparse_mla_fwd_fp8(q, torch.zeros(10, 600, dtype=torch.uint8), idx, SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        sparse_mla_fwd(q, kv, idx, SCALE, num_splits=0)
    with pytest.raises(ValueError, match="last dim must be 576"):
        quantize_fp8_ds_mla(torch.zeros(3, 512))


def test_launcher_choices() -> None:
    for h_q in range(1, 257):
        for fp8 in (False, True):
            assert choose_config(h_q, fp8) in CONFIGS.values()
    # bf16: 64 keys a step over 4 warps with the lazy rescale, the indices prefetched, the trimmed loop
    # for prefill rows, at every head count (and ptxas's own register choice on SM12x); fp8: scales on
    # the keys, beyond 16 heads with the indices prefetched at 3 stages
    assert choose_config(8) == choose_config(16) == choose_config(17) == choose_config(128)
    wide = choose_config(64)
    assert wide.block_n == 64 and wide.num_warps == 4 and wide.lazy_rescale and wide.sm12x_maxnreg is None
    assert wide.prefetch_idx and wide.trim_tail
    assert not choose_config(16, fp8=True).scale_logits and not choose_config(32, fp8=True).scale_logits
    assert not choose_config(16, fp8=True).prefetch_idx and choose_config(32, fp8=True).prefetch_idx
    assert choose_config(32, fp8=True).num_stages == 3
    # decode at batch 1 on 132 SMs: split topk 2048 into many programs; prefill: no split
    assert choose_num_splits(1, 1, 2048, 32, 132) == 32  # at least 64 keys per split
    assert choose_num_splits(1, 1, 2048, 64, 132) == 32
    assert choose_num_splits(4096, 4, 2048, 32, 132) == 1
    assert choose_num_splits(1, 1, 1, 32, 132) == 1
    # about two programs per SM, rounded up, then down to a power of two
    assert choose_num_splits(64, 1, 2048, 32, 132) == 4  # 5 wanted
    assert choose_num_splits(64, 2, 2048, 32, 132) == 2  # 3 wanted
    assert choose_num_splits(8, 1, 2048, 32, 132) == 32  # 33 wanted
    assert choose_num_splits(8, 4, 2048, 32, 132) == 8  # 9 wanted
    assert choose_num_splits(64, 4, 2048, 32, 132) == 1  # a full wave already: no split
    assert choose_num_splits(33, 4, 2048, 32, 132) == 1 and choose_num_splits(32, 4, 2048, 32, 132) == 2
    assert choose_num_splits(64, 1, 2048, 32, 132, 1, round_up=False) == 2  # floor(2.06)
    for s_q in range(1, 300):
        n = choose_num_splits(s_q, 1, 2048, 32, 132)
        assert n & (n - 1) == 0 and 1 <= n <= 32
    # SM12x, fp8_ds_mla: the Gluon kernel from s_q x 16-head blocks >= a quarter of the SMs on (188:
    # RTX PRO 6000), the Triton kernel below (decode) and on every other GPU, and never for bf16
    assert choose_config(8, True, s_q=47, num_sms=188, sm12x=True) is GLUON_FP8
    assert choose_config(32, True, s_q=24, num_sms=188, sm12x=True) is GLUON_FP8  # 2 head blocks
    assert choose_config(32, True, s_q=23, num_sms=188, sm12x=True) == choose_config(32, True)
    assert choose_config(8, True, s_q=46, num_sms=188, sm12x=True) == choose_config(8, True)
    assert choose_config(8, True, s_q=8, num_sms=48, sm12x=True) == choose_config(8, True)  # GB10: 48 SMs
    assert choose_config(8, True, s_q=12, num_sms=48, sm12x=True) is GLUON_FP8
    assert choose_config(8, True, s_q=4096, num_sms=132, sm12x=False) == choose_config(8, True)
    assert choose_config(8, False, s_q=4096, num_sms=188, sm12x=True) == choose_config(8, False)
    assert choose_config(8, True, s_q=4096, num_sms=188, sm12x=True) not in CONFIGS.values()
    # decode where one 16-key tile a program fills at most one wave: one token at up to 16 heads,
    # topk 2048 on 132 SMs (H200) or 188 (RTX PRO 6000), then 128 splits of 16 keys
    for fp8 in (False, True):
        decode = CONFIGS[("fp8" if fp8 else "bf16", "h16n16-decode")]
        assert decode.block_n == 16 and decode.min_split_tokens == 16
        assert choose_config(8, fp8, s_q=1, num_sms=132, topk=2048) is decode
        assert choose_config(16, fp8, s_q=1, num_sms=188, sm12x=True, topk=2048) is decode
        assert choose_config(17, fp8, s_q=1, num_sms=188, topk=2048) == choose_config(17, fp8)  # 256 programs
        assert choose_config(8, fp8, s_q=2, num_sms=132, topk=2048) == choose_config(8, fp8)
        assert choose_config(8, fp8, s_q=1, num_sms=48, topk=2048) == choose_config(8, fp8)  # GB10
        assert choose_config(8, fp8, s_q=1, num_sms=132, topk=4096) == choose_config(8, fp8)
        assert choose_config(8, fp8, s_q=1, num_sms=132) == choose_config(8, fp8)  # topk unknown
    assert choose_num_splits(1, 1, 2048, 16, 132, min_split_tokens=16) == 128
    assert choose_num_splits(1, 1, 2000, 16, 132, min_split_tokens=16) == 64  # 125 tiles: a power of two
    # the merge: 32 output dims a program where 64 would leave SMs idle or over 64 splits, else 64
    assert _merge_block_d(1, 8, 128, 132) == 32 and _merge_block_d(1, 16, 32, 132) == 32
    assert _merge_block_d(8, 8, 32, 132) == 64 and _merge_block_d(1, 64, 32, 132) == 64
    assert _merge_block_d(1, 64, 128, 132) == 32


@pytest.mark.parametrize("n_split", [3, 128])
def test_merge_block_d_agrees(gen: torch.Generator, n_split: int) -> None:
    """The merge at the GPU's 32 and 64 output dims a program gives bit for bit what the
    interpreter's one program a head (512 dims) gives, empty splits (LSE -inf) included."""
    import mlafleet.kernels.sparse_mla as sm

    part_out = torch.randn(2, n_split, 3, 512, generator=gen)
    part_lse = torch.randn(2, n_split, 3, generator=gen) * 4
    part_lse[0, 1::2] = float("-inf")
    part_lse[1, :, 2] = float("-inf")                    # a head with nothing valid in any split
    results = []
    for block_d in (512, 64, 32):
        out, lse = torch.empty(2, 3, 512, dtype=torch.bfloat16), torch.empty(2, 3)
        sm._merge_splits(part_out, part_lse, out, lse, block_d)
        results.append((out, lse))
    weights = torch.softmax(torch.nan_to_num(part_lse[0, :, 0], neginf=-1e30), 0)
    torch.testing.assert_close(results[0][0][0, 0].float(), (weights[:, None] * part_out[0, :, 0]).sum(0),
                               rtol=1e-2, atol=1e-2)
    assert torch.isposinf(results[0][1][1, 2])
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_gluon_kernel_refusals(gen: torch.Generator) -> None:
    # forced where it cannot run, the Gluon config says why, before anything is launched
    s_kv = 128
    idx = random_indices(gen, 2, 64, s_kv)
    q = torch.randn(2, 16, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    cache = make_fp8_cache(kv, idx)
    with pytest.raises(ValueError, match="interpreter cannot run Gluon"):
        sparse_mla_fwd_fp8(q, cache, idx, SCALE, config=GLUON_FP8)
    plain, scale = make_plain_fp8_cache(kv, idx)
    with pytest.raises(ValueError, match="not an fp8_ds_mla cache"):
        sparse_mla_fwd_fp8_e4m3(q, plain, idx, SCALE, scale, config=GLUON_FP8)
    with pytest.raises(ValueError, match="not an fp8_ds_mla cache"):
        sparse_mla_fwd(q, kv, idx, SCALE, config=GLUON_FP8)
    # what it cannot read as it lies (the launcher's own choice then falls back to Triton's kernel)
    rows = cache.reshape(-1, FP8_TOKEN_BYTES)
    latent, rope = q[..., :512], q[..., 512:]
    assert _gluon_unfit(latent, rope, rows, idx, GLUON_FP8) is None
    assert "q's dims" in _gluon_unfit(q.transpose(1, 2).contiguous().transpose(1, 2)[..., :512], rope, rows, idx,
                                      GLUON_FP8)
    assert "indices are not contiguous" in _gluon_unfit(latent, rope, rows, idx[..., ::2], GLUON_FP8)
    assert "topk 48 is not a multiple of 32" in _gluon_unfit(latent, rope, rows, idx[..., :48], GLUON_FP8)
    wide = torch.zeros(s_kv, FP8_TOKEN_BYTES + 4, dtype=torch.uint8)[:, :FP8_TOKEN_BYTES]  # rows 660 bytes apart
    assert "16-byte boundaries" in _gluon_unfit(latent, rope, wide, idx, GLUON_FP8)


def test_fp8_kernel_override(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    # MLAFLEET_SPARSE_MLA_FP8_KERNEL: triton (and auto) run the Triton kernel; gluon forces the Gluon
    # one (refused here: the interpreter); any other value is refused by name; bf16 ignores it
    s_kv = 128
    idx = random_indices(gen, 2, 64, s_kv)
    q = torch.randn(2, 8, 576, generator=gen).bfloat16()
    kv = make_cache(gen, s_kv, idx)
    cache = make_fp8_cache(kv, idx)
    for value in ("triton", "auto", " Triton ", ""):
        monkeypatch.setenv("MLAFLEET_SPARSE_MLA_FP8_KERNEL", value)
        check(*sparse_mla_fwd_fp8(q, cache, idx, SCALE), *reference_sparse_mla_fp8(q, cache, idx, SCALE))
    monkeypatch.setenv("MLAFLEET_SPARSE_MLA_FP8_KERNEL", "gluon")
    with pytest.raises(ValueError, match="interpreter cannot run Gluon"):
        sparse_mla_fwd_fp8(q, cache, idx, SCALE)
    check(*sparse_mla_fwd(q, kv, idx, SCALE), *reference_sparse_mla(q, kv, idx, SCALE))
    monkeypatch.setenv("MLAFLEET_SPARSE_MLA_FP8_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"MLAFLEET_SPARSE_MLA_FP8_KERNEL='fast' is not one of auto, triton, gluon"):
        sparse_mla_fwd_fp8(q, cache, idx, SCALE)


@pytest.mark.parametrize("h_q, topk, num_splits", [(8, 64, 1), (24, 1000, None), (16, 200, 3)])
def test_plain_fp8(gen: torch.Generator, h_q: int, topk: int, num_splits: int | None) -> None:
    s_kv = 640
    idx = random_indices(gen, 3, topk, s_kv)
    idx[1, 0, ::4] = -1
    idx[2, 0, 1::3] = s_kv + 1
    q = torch.randn(3, h_q, 576, generator=gen).bfloat16()
    check_plain_fp8(q, make_cache(gen, s_kv, idx), idx, num_splits=num_splits)


@pytest.mark.parametrize("key", sorted(k for k in CONFIGS if k[0] == "fp8"))
def test_plain_fp8_every_config(gen: torch.Generator, key: tuple[str, str]) -> None:
    cfg = CONFIGS[key]
    s_kv = 256
    idx = random_indices(gen, 2, 80, s_kv)
    idx[1, 0, ::5] = -1
    q = torch.randn(2, cfg.block_h + 8, 576, generator=gen).bfloat16()
    check_plain_fp8(q, make_cache(gen, s_kv, idx), idx, num_splits=2, config=cfg)


def test_plain_fp8_scale_applies(gen: torch.Generator) -> None:
    # the same fp8 bytes with twice the scale are twice the keys: the logits double and the
    # output is the mix of twice the values (a kernel that ignored the scale fails here)
    s_kv = 128
    idx = random_indices(gen, 2, 48, s_kv)
    q = torch.randn(2, 8, 576, generator=gen).bfloat16()
    cache, scale = make_plain_fp8_cache(make_cache(gen, s_kv, idx), idx)
    for factor in (1.0, 2.0, 0.37):
        check(*sparse_mla_fwd_fp8_e4m3(q, cache, idx, SCALE, scale * factor),
              *reference_sparse_mla_fp8_e4m3(q, cache, idx, SCALE, scale * factor))
    out1, _ = sparse_mla_fwd_fp8_e4m3(q, cache, idx, SCALE, scale)
    out2, _ = sparse_mla_fwd_fp8_e4m3(q, cache, idx, SCALE, 2 * scale)
    assert not torch.allclose(out1.float() * 2, out2.float(), rtol=1e-2)  # the logits changed too


def test_plain_fp8_all_invalid_and_bad_inputs(gen: torch.Generator) -> None:
    q = torch.randn(2, 16, 576, generator=gen).bfloat16()
    idx = torch.full((2, 1, 70), -1, dtype=torch.int32)
    cache = torch.full((64, 1, 576), 0x7F, dtype=torch.uint8)
    out, lse = sparse_mla_fwd_fp8_e4m3(q, cache, idx, SCALE, 1.0, num_splits=2)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    with pytest.raises(ValueError, match="576 values of a token"):
        sparse_mla_fwd_fp8_e4m3(q, torch.zeros(64, 1, 656, dtype=torch.uint8), idx, SCALE, 1.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        sparse_mla_fwd_fp8_e4m3(q, torch.zeros(64, 1, 576, dtype=torch.bfloat16), idx, SCALE, 1.0)
    with pytest.raises(ValueError, match="one value"):
        sparse_mla_fwd_fp8_e4m3(q, cache, idx, SCALE, torch.ones(2))


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_lazy_rescale(gen: torch.Generator, key: tuple[str, str]) -> None:
    # LAZY_RESCALE moves the reference max only when a row's max passes it by 2^8: logits whose
    # max grows slowly along the row (within 2^8: no rescale), in jumps (rescales), a first tile
    # with nothing valid, and large logits; against the reference, unsplit and split
    import dataclasses
    dtype, _ = key
    cfg = dataclasses.replace(CONFIGS[key], lazy_rescale=True)
    s_kv, topk = 512, 200
    idx = random_indices(gen, 3, topk, s_kv)
    idx[:, 0, :40] = -1
    kv = make_cache(gen, s_kv, idx).float()
    # the key named at position j grows with j: the logits' max rises tile by tile
    pos = torch.arange(topk, dtype=torch.float32)
    growth = torch.stack([1 + pos / 50, 1 + (pos // 64) * 3, 1 + pos / 400])  # [3 tokens, topk]
    for t in range(3):
        named = idx[t, 0].long()
        ok = named >= 0
        kv[named[ok], 0] = kv[named[ok], 0] * growth[t, ok][:, None]
    kv = kv.bfloat16()
    q = (torch.randn(3, 16, 576, generator=gen) * 4).bfloat16()
    for num_splits in (1, 3):
        if dtype == "bf16":
            ref = reference_sparse_mla(q, kv, idx, SCALE)
            check(*sparse_mla_fwd(q, kv, idx, SCALE, num_splits=num_splits, config=cfg), *ref)
        else:
            cache = make_fp8_cache(kv, idx)
            ref = reference_sparse_mla_fp8(q, cache, idx, SCALE)
            check(*sparse_mla_fwd_fp8(q, cache, idx, SCALE, num_splits=num_splits, config=cfg), *ref)
    assert ref[1].max() - ref[1].min() > 20  # the rows' scales differ widely
