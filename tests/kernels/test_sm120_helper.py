"""The SM120 static check itself: it must see both ways a kernel can fail on SM120."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl

from mlafleet.kernels.sm120 import SM120_MAX_SHARED_BYTES, compile_for_sm120


@triton.jit
def _matmul(A, B, C, K: tl.constexpr, M: tl.constexpr, N: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, BK)
    acc = tl.zeros([M, N], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(B + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(C + rm[:, None] * N + rn[None, :], acc)


SIG = {"A": "*bf16", "B": "*bf16", "C": "*fp32"}


def test_limit_is_sm120_99kb() -> None:
    assert SM120_MAX_SHARED_BYTES == 101376 == 99 * 1024


def test_small_tile_fits() -> None:
    r = compile_for_sm120(_matmul, SIG, {"K": 256, "M": 64, "N": 64, "BK": 64},
                          num_warps=4, num_stages=2, aligned=SIG)
    assert 0 < r.shared_bytes <= SM120_MAX_SHARED_BYTES
    assert r.spills == 0 and 0 < r.registers <= 255
    assert r.fits()


def test_oversized_tile_is_caught() -> None:
    # 64x512 by 512x64 bf16 operands, 3 stages: 262144 bytes, fine on an H200, not on SM120
    r = compile_for_sm120(_matmul, SIG, {"K": 1024, "M": 64, "N": 64, "BK": 512},
                          num_warps=4, num_stages=3, aligned=SIG)
    assert r.shared_bytes > SM120_MAX_SHARED_BYTES
    assert not r.fits()


def test_register_spills_are_caught() -> None:
    # a 128x256 float32 accumulator in one warp: 1024 registers a thread, far over 255
    r = compile_for_sm120(_matmul, SIG, {"K": 64, "M": 128, "N": 256, "BK": 16},
                          num_warps=1, num_stages=1, aligned=SIG)
    assert r.spills > 0
    assert not r.fits()


def test_launcher_register_limit_is_applied() -> None:
    # maxnreg (Triton's option, PTX .maxnreg) as a launcher passes it: the same tile, compiled
    # with a limit below what it needs, uses at most that many registers and spills
    tile = {"K": 256, "M": 64, "N": 128, "BK": 64}
    free = compile_for_sm120(_matmul, SIG, tile, num_warps=4, num_stages=2, aligned=SIG)
    capped = compile_for_sm120(_matmul, SIG, tile, num_warps=4, num_stages=2, aligned=SIG, maxnreg=64)
    assert free.registers > 64 >= capped.registers and free.spills == 0
    assert capped.spills > 0 and not capped.fits()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="needs types or values"):
        compile_for_sm120(_matmul, {"A": "*bf16"}, {"K": 64, "M": 16, "N": 16, "BK": 16}, 4, 1)
    with pytest.raises(ValueError, match="no arguments"):
        compile_for_sm120(_matmul, {**SIG, "Z": "i32"}, {"K": 64, "M": 16, "N": 16, "BK": 16}, 4, 1)
    with pytest.raises(TypeError, match="not a @triton.jit"):
        compile_for_sm120(lambda: None, {}, {}, 4, 1)


def test_a_second_process_reuses_the_compilation_and_the_ptxas_report(tmp_path) -> None:
    """compile_for_sm120 in fresh processes with different hash seeds (set iteration order) hits
    Triton's cache and the ptxas report cache: no new entry after the first. The aligned
    arguments once went into Triton's cache key in a per-process order, so every CI run compiled
    every config again (minutes under the interpreter's suite)."""
    import os
    import subprocess
    import sys

    child = ("from mlafleet.kernels.sm120 import compile_for_sm120\n"
             "from mlafleet.kernels.sparse_mla import sm120_compile_specs\n"
             "spec = next(s for s in sm120_compile_specs() if len(s.get('aligned', ())) >= 3)\n"
             "print(compile_for_sm120(**spec).registers)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), MLAFLEET_CACHE=str(tmp_path / "mlafleet"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def entries() -> int:
        return sum(len(files) for _, _, files in os.walk(tmp_path))

    counts, outputs = [], []
    for seed in ("1", "2", "3", "4"):
        done = subprocess.run([sys.executable, "-c", child], env={**env, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=False, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout.strip())
        counts.append(entries())
    assert counts[0] > 0 and len(set(counts)) == 1, counts
    assert len(set(outputs)) == 1
    assert len(os.listdir(tmp_path / "mlafleet" / "ptxas-usage")) == 1
