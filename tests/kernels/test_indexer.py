"""The DSA indexer's DeepGEMM-free kernels against their float64 references (CPU, Triton interpreter).

Inputs follow vLLM 0.20.2's layouts: fp8 q [tokens, heads, 128], fp8 k with a per-token
float32 scale, float32 weights of mixed sign, per-query [ks, ke) key ranges, and the paged
indexer cache (per block: block_size * 128 fp8 values, then block_size float32 scales) read
through a shuffled block table with random bytes in unused blocks and between blocks.
"""

from __future__ import annotations

import os

import torch

# Without a GPU the kernels run through Triton's interpreter, which must be chosen before
# triton is first imported (its own library functions are decorated at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from mlafleet.kernels import indexer as ix  # noqa: E402
from oracles import mqa_logits_reference, paged_mqa_logits_reference, top_k_per_row_reference  # noqa: E402

if not torch.cuda.is_available() and not isinstance(ix._mqa_logits_kernel, InterpretedFunction):
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: "
                       "run pytest with TRITON_INTERPRET=1 in the environment")

# triton 3.6's interpreter converts 1-element arrays with int(): numpy 2.x warns (2.4 refuses).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FP8_MAX = 448.0
D = 128
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------- data


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> fp8 [N, D] and float32 scale [N], x ~= fp8 * scale (as vLLM's cache insert)."""
    scale = x.abs().amax(dim=-1).float().clamp_min(1e-4) / FP8_MAX
    return (x / scale[:, None]).to(ix.FP8), scale


def random_q(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 2).to(ix.FP8)


def random_k(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(torch.randn((n, D), generator=gen) * (0.5 + torch.rand((n, 1), generator=gen)))


def random_weights(gen: torch.Generator, m: int, h: int) -> torch.Tensor:
    # Mixed signs: a kernel that weighted before the relu, or dropped the relu, differs.
    return torch.randn((m, h), generator=gen) / h ** 0.5


def paged_cache(gen: torch.Generator, k: torch.Tensor, k_scale: torch.Tensor, lens: list[int],
                block_size: int, pad_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter each request's keys (back to back in k) into shuffled blocks of a paged cache.

    Returns the uint8 cache [num_blocks, block_size, D + 4] (blocks pad_bytes apart beyond
    their size) and the int32 block table; unused table entries are -7 (never read).
    """
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_req) + 3
    block_bytes = block_size * (D + 4)
    pitch = block_bytes + pad_bytes
    storage = torch.randint(0, 256, (num_blocks * pitch,), generator=gen, dtype=torch.uint8) & 0x77
    cache = torch.as_strided(storage, (num_blocks, block_size, D + 4), (pitch, D + 4, 1))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(per_req + [1]) + 1), -7, dtype=torch.int32)
    first = 0
    for b, n in enumerate(lens):
        for i in range(per_req[b]):
            phys = perm.pop()
            table[b, i] = phys
            block = storage[phys * pitch: phys * pitch + block_bytes]
            for off in range(min(block_size, n - i * block_size)):
                t = first + i * block_size + off
                block[off * D:(off + 1) * D] = k[t].view(torch.uint8)
                block[block_size * D + 4 * off: block_size * D + 4 * off + 4] = k_scale[t:t + 1].view(torch.uint8)
        first += n
    return cache, table


def assert_logits_match(out: torch.Tensor, ref: torch.Tensor, clean: bool) -> None:
    inside = torch.isfinite(ref)
    assert inside.any()
    scale = ref[inside].abs().max()
    err = (out[inside] - ref[inside]).abs().max() / scale
    assert err < 1e-5, f"relative error {err}"
    if clean:
        assert (out[~inside] == NEG_INF).all(), "positions outside the key ranges must be -inf"


def prefill_ranges(req_lens: list[int], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's prefill ranges: requests' keys back to back; a request's query token at position
    p of its context sees its own keys [start, start + p + 1) (the last query_len positions)."""
    ks, ke, start = [], [], 0
    for n, nq in zip(req_lens, query_lens):
        for p in range(n - nq, n):
            ks.append(start)
            ke.append(start + p + 1)
        start += n
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


# --------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("heads", [32, 64, 24])
@pytest.mark.parametrize("clean", [True, False])
def test_mqa_logits_ragged_causal_ranges(heads: int, clean: bool) -> None:
    gen = torch.Generator().manual_seed(heads + clean)
    ks, ke = prefill_ranges([70, 5, 131], [9, 5, 7])
    n, m = 206, ks.shape[0]
    q = random_q(gen, (m, heads, D))
    k, k_scale = random_k(gen, n)
    w = random_weights(gen, m, heads)
    out = ix.mqa_logits(q, k, k_scale, w, ks, ke, clean_logits=clean)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_logits_match(out, mqa_logits_reference(q, k, k_scale, w, ks, ke), clean)


def test_mqa_logits_empty_and_edge_ranges_and_splits() -> None:
    gen = torch.Generator().manual_seed(1)
    m, n, heads = 6, 200, 32
    ks = torch.tensor([0, 10, 100, 199, 50, 150], dtype=torch.int32)
    ke = torch.tensor([1, 200, 100, 200, 50, 151], dtype=torch.int32)  # rows 2 and 4 are empty
    ks[5], ke[5] = 191, 193     # a range that starts on the last key of a 64-key block
    q = random_q(gen, (m, heads, D))
    k, k_scale = random_k(gen, n)
    w = random_weights(gen, m, heads)
    ref = mqa_logits_reference(q, k, k_scale, w, ks, ke)
    for splits in (1, 3):
        out = ix.mqa_logits(q, k, k_scale, w, ks, ke, clean_logits=True, num_splits=splits)
        assert_logits_match(out, ref, clean=True)
        assert (out[2] == NEG_INF).all() and (out[4] == NEG_INF).all()


def test_mqa_logits_non_contiguous_views() -> None:
    gen = torch.Generator().manual_seed(2)
    m, n, heads = 5, 90, 32
    q_big = random_q(gen, (m, heads + 8, D + 64))
    q = q_big[:, 4:4 + heads, 32:32 + D]                      # strided over tokens and heads
    k_big, s_big = random_k(gen, 2 * n)
    k, k_scale = k_big[::2], s_big[::2]                     # every other key
    w = random_weights(gen, heads, m).t()                   # column-major weights
    ks = torch.zeros(m, dtype=torch.int32)
    ke = torch.tensor([90, 1, 45, 89, 60], dtype=torch.int32)
    out = ix.mqa_logits(q, k, k_scale, w, ks, ke, clean_logits=True)
    assert_logits_match(out, mqa_logits_reference(q, k, k_scale, w, ks, ke), clean=True)
    # rows padded to LOGITS_ROW_ALIGN floats (one specialisation of the stride, whatever n is),
    # and the top-k reads them through that stride
    assert out.shape == (m, n) and out.stride() == (96, 1)
    assert torch.equal(ix.top_k_per_row(out, ks, ke, 8), ix.top_k_per_row(out.contiguous(), ks, ke, 8))


def test_mqa_logits_reference_is_the_deepgemm_formula() -> None:
    """The reference itself, by hand on one entry: relu per head, weighted sum, then k's scale."""
    q = torch.zeros((1, 2, D))
    q[0, 0, 0], q[0, 1, 0] = 2.0, -1.0
    k = torch.zeros((1, D))
    k[0, 0] = 3.0
    w = torch.tensor([[0.5, 7.0]])
    out = mqa_logits_reference(q.to(ix.FP8), k.to(ix.FP8), torch.tensor([0.25]), w,
                                  torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    # head 0: relu(6) * 0.5 = 3; head 1: relu(-3) * 7 = 0; times scale 0.25
    assert out.item() == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("heads", [32, 64])
def test_paged_mqa_logits_block_table_indirection(heads: int) -> None:
    gen = torch.Generator().manual_seed(heads)
    lens = [1, 63, 64, 200, 130]                  # block boundaries of a 64-token block
    k, k_scale = random_k(gen, sum(lens))
    cache, table = paged_cache(gen, k, k_scale, lens, 64, pad_bytes=16)
    b = len(lens)
    q = random_q(gen, (b, 1, heads, D))
    w = random_weights(gen, b, heads)
    ctx = torch.tensor(lens, dtype=torch.int32)[:, None]    # vLLM 0.20.2 passes [B, next_n]
    ref = paged_mqa_logits_reference(q, cache, w, ctx, table, 256)
    for clean in (True, False):
        out = ix.paged_mqa_logits(q, cache.unsqueeze(-2), w, ctx, table, 256, clean_logits=clean)
        assert out.shape == (b, 256)
        assert_logits_match(out, ref, clean)
    # the reference reads the layout the plain way: row 3 equals prefill logits on the request's own keys
    first = sum(lens[:3])
    own = mqa_logits_reference(q[3:4, 0], k[first:first + 200], k_scale[first:first + 200], w[3:4],
                                  torch.tensor([0], dtype=torch.int32), torch.tensor([200], dtype=torch.int32))
    torch.testing.assert_close(ref[3:4, :200], own)


@pytest.mark.parametrize("ctx_2d", [True, False])
def test_paged_mqa_logits_next_n(ctx_2d: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    lens, next_n, heads = [3, 129, 70], 2, 32
    k, k_scale = random_k(gen, sum(lens))
    cache, table = paged_cache(gen, k, k_scale, lens, 64)
    b = len(lens)
    q = random_q(gen, (b, next_n, heads, D))
    w = random_weights(gen, b * next_n, heads)
    per_req = torch.tensor(lens, dtype=torch.int32)
    # per token: token j of the last next_n sees L - next_n + j + 1 keys
    ctx = torch.stack([per_req - 1, per_req], dim=1).to(torch.int32) if ctx_2d else per_req
    ref = paged_mqa_logits_reference(q, cache, w, ctx, table, 192)
    assert torch.isfinite(ref).sum(dim=1).tolist() == [2, 3, 128, 129, 69, 70]
    out = ix.paged_mqa_logits(q, cache, w, ctx, table, 192, clean_logits=True, num_splits=2)
    assert_logits_match(out, ref, clean=True)


def test_paged_mqa_logits_empty_context_row() -> None:
    gen = torch.Generator().manual_seed(8)
    lens = [0, 65]
    k, k_scale = random_k(gen, 65)
    cache, table = paged_cache(gen, k, k_scale, lens, 64)
    q = random_q(gen, (2, 1, 32, D))
    w = random_weights(gen, 2, 32)
    out = ix.paged_mqa_logits(q, cache, w, torch.tensor(lens, dtype=torch.int32), table, 128, clean_logits=True)
    assert (out[0] == NEG_INF).all()
    assert_logits_match(out[1:], paged_mqa_logits_reference(q, cache, w, torch.tensor(lens, dtype=torch.int32),
                                                              table, 128)[1:], clean=True)


# ----------------------------------------------------------------------------------------- top-k


TOPK_IMPLS = {
    "triton": ix.top_k_per_row,
    "triton-split": lambda *a, **kw: ix.top_k_per_row(*a, splits=3, **kw),   # the few-long-rows path
    "triton-streaming": lambda *a, **kw: ix.top_k_per_row(*a, one_block=False, **kw),  # rows over one block
    "torch": ix.top_k_per_row_torch,
}


@pytest.mark.parametrize("impl", TOPK_IMPLS)
def test_top_k_per_row_ranges_short_rows_and_fill(impl: str) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, n, topk = 5, 300, 16
    logits = torch.randn((rows, n), generator=gen)
    starts = torch.tensor([0, 100, 20, 299, 7], dtype=torch.int32)
    ends = torch.tensor([300, 250, 30, 299, 7 + 16], dtype=torch.int32)  # 300, 150, 10 (< topk), 0, exactly topk
    # outside the ranges: garbage (clean_logits=False), NaN and +inf included
    garbage = torch.full_like(logits, float("inf"))
    garbage[:, ::3] = float("nan")
    cols = torch.arange(n)
    inside = (cols[None] >= starts[:, None].long()) & (cols[None] < ends[:, None].long())
    logits = torch.where(inside, logits, garbage)
    out = TOPK_IMPLS[impl](logits, starts, ends, topk)
    want = top_k_per_row_reference(logits, starts, ends, topk)
    for r in range(rows):
        got = out[r].tolist()
        valid = [i for i in got if i != -1]
        assert set(valid) == want[r] and len(valid) == len(want[r])
        assert got[len(valid):] == [-1] * (topk - len(valid)), "the -1 fill must follow the valid entries"
    assert sorted(out[2].tolist()[:10]) == list(range(10))           # short row: every position, relative to start
    assert out[3].tolist() == [-1] * topk                            # empty range


@pytest.mark.parametrize("impl", TOPK_IMPLS)
def test_top_k_per_row_decode_rows_more_topk_than_columns(impl: str) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn((6, 40), generator=gen)
    ends = ix.decode_row_ends(torch.tensor([40, 5, 12], dtype=torch.int32), next_n=2)
    assert ends.tolist() == [39, 40, 4, 5, 11, 12]
    out = torch.full((8, 64), 99, dtype=torch.int32)                 # a larger buffer, as vLLM's
    TOPK_IMPLS[impl](logits, None, ends, 64, out=out[:6])
    want = top_k_per_row_reference(logits, None, ends, 64)
    for r in range(6):
        assert {i for i in out[r].tolist() if i != -1} == want[r]
        assert (out[r] == -1).sum() == 64 - int(ends[r])
    assert (out[6:] == 99).all(), "rows past the logits must stay untouched"


def test_decode_pipeline_topk_2048_at_real_size() -> None:
    """64 heads, topk 2048, a context longer and one shorter than topk: the top-k of the
    kernel's logits selects what the reference logits rank highest."""
    gen = torch.Generator().manual_seed(5)
    lens, heads, topk = [3000, 1000], 64, 2048
    k, k_scale = random_k(gen, sum(lens))
    cache, table = paged_cache(gen, k, k_scale, lens, 64)
    q = random_q(gen, (2, 1, heads, D))
    w = random_weights(gen, 2, heads)
    ctx = torch.tensor(lens, dtype=torch.int32)[:, None]
    logits = ix.paged_mqa_logits(q, cache, w, ctx, table, 4096, clean_logits=False)
    idx = ix.top_k_per_row(logits, None, ix.decode_row_ends(ctx, 1), topk)
    ref = paged_mqa_logits_reference(q, cache, w, ctx, table, 4096).double()
    chosen = idx[0].long()
    assert (chosen >= 0).all() and chosen.unique().numel() == topk
    rest = torch.ones(3000, dtype=torch.bool)
    rest[chosen] = False
    margin = 1e-5 * ref[0, :3000].abs().max()
    assert ref[0, chosen].min() >= ref[0, :3000][rest].max() - margin
    assert sorted(idx[1, :1000].tolist()) == list(range(1000)) and (idx[1, 1000:] == -1).all()


def assert_is_a_top_k(got: list[int], vals: torch.Tensor, topk: int) -> None:
    """A valid top-k whatever the tie order: distinct, everything above the k-th value, the
    rest at it."""
    assert len(got) == len(set(got)) == topk and min(got) >= 0
    kth = torch.sort(vals, descending=True).values[topk - 1]
    chosen = torch.zeros(len(vals), dtype=torch.bool)
    chosen[got] = True
    assert (vals[chosen] >= kth).all() and chosen[vals > kth].all()


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_top_k_radix_select_exact(splits: int) -> None:
    """Long rows (several 4096-blocks), both signs, +-inf, values that share their high bytes,
    and ties at the k-th value (one program a row: taken at the lowest positions, as the stable
    reference does; split rows: any of them)."""
    gen = torch.Generator().manual_seed(9)
    rows, n, topk = 4, 9000, 2048
    logits = torch.randn((rows, n), generator=gen)
    logits[0, :3000] = 1.0 + torch.rand(3000, generator=gen) * 1e-6     # same top 16 bits
    logits[1] = -logits[1].abs()                                       # all negative
    logits[1, 5] = float("-inf")
    logits[2, 100:4100] = 0.5                                          # 4000 ties around the k-th
    logits[2, 8000:8100] = float("inf")
    logits[3, ::2] = logits[3, 1::2]                                   # pairwise ties everywhere
    starts = torch.tensor([0, 1, 50, 0], dtype=torch.int32)
    ends = torch.tensor([9000, 8999, 9000, 8001], dtype=torch.int32)
    out = ix.top_k_per_row(logits, starts, ends, topk, splits=splits)
    want = top_k_per_row_reference(logits, starts, ends, topk)
    for r in range(rows):
        assert_is_a_top_k(out[r].tolist(), logits[r, int(starts[r]):int(ends[r])], topk)
        if splits == 1:
            assert set(out[r].tolist()) == want[r], f"row {r}"


def test_top_k_per_row_triton_and_torch_agree_on_kernel_logits() -> None:
    gen = torch.Generator().manual_seed(10)
    ks, ke = prefill_ranges([3000, 2500], [3, 2])
    q = random_q(gen, (5, 32, D))
    k, k_scale = random_k(gen, 5500)
    w = random_weights(gen, 5, 32)
    logits = ix.mqa_logits(q, k, k_scale, w, ks, ke)
    a = ix.top_k_per_row(logits, ks, ke, 2048)
    b = ix.top_k_per_row_torch(logits, ks, ke, 2048)
    assert [set(r) for r in a.tolist()] == [set(r) for r in b.tolist()]


# ------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named() -> None:
    gen = torch.Generator().manual_seed(6)
    q = random_q(gen, (2, 32, D))
    k, s = random_k(gen, 10)
    w = random_weights(gen, 2, 32)
    ks = torch.zeros(2, dtype=torch.int32)
    ke = torch.full((2,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ix.mqa_logits(q.to(torch.bfloat16), k, s, w, ks, ke)
    with pytest.raises(ValueError, match="weights"):
        ix.mqa_logits(q, k, s, w[:, :16], ks, ke)
    with pytest.raises(ValueError, match="ke must be int32"):
        ix.mqa_logits(q, k, s, w, ks, ke.long())
    cache = torch.zeros((4, 64, D + 4), dtype=torch.uint8)
    table = torch.zeros((2, 4), dtype=torch.int32)
    qd = random_q(gen, (2, 1, 32, D))
    ctx = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        ix.paged_mqa_logits(qd, cache[..., :D], w, ctx, table, 64)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ix.paged_mqa_logits(qd, torch.zeros((4, 48, D + 4), dtype=torch.uint8), w, ctx, table, 64)
    with pytest.raises(ValueError, match="context_lens"):
        ix.paged_mqa_logits(qd, cache, w, torch.ones(3, dtype=torch.int32), table, 64)
    with pytest.raises(ValueError, match="ends must be"):
        ix.top_k_per_row(torch.zeros((2, 5)), None, torch.ones(3, dtype=torch.int32), 4)


def test_gpus_without_fp8_tensor_cores_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """SM8.0/8.6 (A100, A10) cannot run the fp8 dots: a clear error, not a compiler trace."""
    monkeypatch.setattr(ix, "_fp8_dot_capable", lambda index: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 6))
    with pytest.raises(RuntimeError, match=r"compute capability 8.9 or newer\); this GPU is 8.6"):
        ix._check_device(torch.device("cuda", 0), "paged_mqa_logits")
    ix._check_device(torch.device("cpu"), "paged_mqa_logits")  # the interpreter: no check


@pytest.mark.parametrize("one_block,early_stop", [(True, True), (True, False), (False, True)])
def test_triton_top_k_one_block_rows_exact(one_block: bool, early_stop: bool) -> None:
    """Rows that fit one 4096-block (decode up to 4096 tokens), kept in registers across the
    passes (stopping once the chosen bin is taken whole, or all four) or read five times: the
    same sets as the stable reference, ties at the lowest positions."""
    gen = torch.Generator().manual_seed(11)
    rows, n, topk = 5, ix.TOPK_BLOCK, 2048
    logits = torch.randn((rows, n), generator=gen)
    logits[0, :3000] = -2.0 - torch.rand(3000, generator=gen) * 1e-6    # negative, same top 16 bits
    logits[1, 10:2500] = 0.25                                           # 2490 ties across the k-th
    logits[2, 7] = float("inf")
    logits[2, 8] = float("-inf")
    logits[3, ::2] = logits[3, 1::2]                                    # pairwise ties everywhere
    starts = torch.tensor([0, 3, 96, 0, 1000], dtype=torch.int32)
    ends = torch.tensor([4096, 4000, 4096, 2049, 3049], dtype=torch.int32)  # 2049: one to drop; 2049 again
    out = ix.top_k_per_row(logits, starts, ends, topk, one_block=one_block, early_stop=early_stop)
    want = top_k_per_row_reference(logits, starts, ends, topk)
    for r in range(rows):
        assert set(out[r].tolist()) == want[r], f"row {r}"
        assert_is_a_top_k(out[r].tolist(), logits[r, int(starts[r]):int(ends[r])], topk)


@pytest.mark.parametrize("topk", [1, 37, 2048])
def test_triton_top_k_early_stop_at_every_pass(topk: int) -> None:
    """Rows whose k-th bin is taken whole after the first, second, third or fourth byte (and
    one where it never is: ties across the k-th): the early stop takes exactly the top-k set."""
    gen = torch.Generator().manual_seed(5)
    n = 3000
    rows = [torch.randn(n, generator=gen),                                     # stops after byte 2-3
            torch.randn(n, generator=gen) * 1e-30,                             # tiny values
            torch.arange(n, dtype=torch.float32) * 2.0 ** 20,                  # spread exponents: byte 1
            (torch.randn(n, generator=gen) * 1e-7 + 1.0),                      # one exponent: bytes 3-4
            torch.where(torch.arange(n) % 2 == 0, torch.tensor(0.5), torch.randn(n, generator=gen))]  # ties
    logits = torch.stack(rows)
    ends = torch.full((len(rows),), n, dtype=torch.int32)
    want = top_k_per_row_reference(logits, None, ends, topk)
    for early_stop in (True, False):
        out = ix.top_k_per_row(logits, None, ends, topk, one_block=True, early_stop=early_stop)
        for r in range(len(rows)):
            got = out[r].tolist()
            assert -1 not in got and len(set(got)) == topk, f"row {r}, early_stop={early_stop}"
            assert set(got) == want[r], f"row {r}, early_stop={early_stop}"


def test_triton_top_k_short_ranges_of_long_rows() -> None:
    """Prefill's rows: as long as the chunk's keys, each token's range a slice of them. Ranges
    of at most one block take the register path at run time, longer ones stream, in one launch;
    both give the reference's sets, ties at the lowest positions, as the streaming passes do."""
    gen = torch.Generator().manual_seed(17)
    n, topk = 3 * ix.TOPK_BLOCK + 100, 2048
    starts = torch.tensor([0, 5000, 9000, 4096, 100, 12000, 7000], dtype=torch.int32)
    ends = torch.tensor([3000, 9096, 12388, 4096 + 2049, 8197, 12388, 7000 + 4097], dtype=torch.int32)
    logits = torch.randn((len(starts), n), generator=gen)
    logits[3, 4100:6000] = 0.5                                          # ties across the k-th, short range
    logits[4, 200:7000] = 0.5                                           # the same in a long range (8097)
    want = top_k_per_row_reference(logits, starts, ends, topk)
    for one_block in (None, False):  # None: short ranges at run time; False: all streaming
        out = ix.top_k_per_row(logits, starts, ends, topk, one_block=one_block)
        for r in range(len(starts)):
            got, length = out[r].tolist(), int(ends[r] - starts[r])
            if length < topk:  # the whole range, then -1
                assert got == list(range(length)) + [-1] * (topk - length), f"row {r}, one_block={one_block}"
                continue
            assert set(got) == want[r], f"row {r}, one_block={one_block}"
            assert_is_a_top_k(got, logits[r, int(starts[r]):int(ends[r])], topk)


def test_triton_top_k_one_block_refuses_longer_rows() -> None:
    with pytest.raises(ValueError, match="one_block needs rows of at most 4096, got 4097"):
        ix.top_k_per_row(torch.zeros((1, 4097)), None, torch.tensor([4097], dtype=torch.int32), 8, one_block=True)
