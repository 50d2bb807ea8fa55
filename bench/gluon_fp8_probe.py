"""A compile-only study for issue 16's fp8_ds_mla path: the sparse-MLA key loop written in Gluon
(Triton's explicit-layout dialect, `triton.experimental.gluon`, Triton 3.7.1), compiled offline
for sm_120 (and sm_90), its shared memory, registers, spills and instruction mix printed.

Nothing runs on a GPU and nothing is checked for correctness: the question is whether Gluon can
express the loop that Triton's tl.dot cannot (docs/perf-kernels.md, "Fourth pass": the fp8
tile's conversion sits between the gather and the first tensor-core instruction) within
sm_120's 99 KB. One query token, 16 heads, the 512 latent dims (the 64 RoPE dims left out),
BLOCK_N keys a step gathered with cp.async into a ring of STAGES raw 656-byte rows, an online
softmax, two variants:

  staged: every key tile converted (fp8 bytes -> bf16 x 2^-120, integer bit moves) into a
          double-buffered bf16 tile in shared memory, tile i+1's conversion issued between
          tile i's Q.K and P.V with no barrier between (the pipelining tl.dot cannot express);
  direct: Q.K reads the raw bytes straight into the tensor-core B-operand layout (k_width 4:
          four consecutive key bytes per 32-bit shared load) and converts them in registers,
          so Q.K needs no bf16 staging; only P.V's operand (keys along its reduction) is
          converted into one bf16 tile.

    PYTHONPATH=<triton 3.7.1> python bench/gluon_fp8_probe.py [--cap 120] [--cap 90]
"""
import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp, mma_v2

PTX = gl.constexpr("""{
    .reg .b32 a<2>;
    prmt.b32 a0, $2, 0, 0x9180;
    prmt.b32 a1, $2, 0, 0xB3A2;
    shl.b32 a0, a0, 4;
    shl.b32 a1, a1, 4;
    and.b32 $0, a0, 0x87F087F0;
    and.b32 $1, a1, 0x87F087F0;
}""")


@gluon.jit
def _convert(raw_smem, dst_smem, RAW_L: gl.constexpr):
    raw = raw_smem.load(RAW_L)
    v = gl.inline_asm_elementwise(PTX, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)
    dst_smem.store(v)


@gluon.jit
def _cvt_regs(raw):
    return gl.inline_asm_elementwise(PTX, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def probe_kernel(Q, KV, IDX, OUT, topk, qk_scale,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, num_warps: gl.constexpr):
    TOK: gl.constexpr = 656
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    A_OP4: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_OP4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
    ROW_L: gl.constexpr = gl.SliceLayout(1, RAW_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, RAW_L)
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    SWZ: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])

    tok = gl.program_id(0).to(gl.int64)
    hq = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_L))
    dq = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
    q_base = Q + tok * (16 * 576) + hq[:, None] * 576 + dq[None, :]
    QL: gl.constexpr = A_OP4 if DIRECT else A_OP
    # q staged once in shared memory, read into the A-operand layout at each tile's Q.K
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, 16, 128], SWZ)
    q_smem.index(0).store(gl.load(q_base + 0))
    q_smem.index(1).store(gl.load(q_base + 128))
    q_smem.index(2).store(gl.load(q_base + 256))
    q_smem.index(3).store(gl.load(q_base + 384))

    raw = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], PLAIN)
    cvt = gl.allocate_shared_memory(gl.bfloat16, [1 if DIRECT else 2, BLOCK_N, 512], SWZ)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_N], SWZ)

    rows = gl.arange(0, BLOCK_N, layout=ROW_L)
    cols = gl.arange(0, 512, layout=COL_L)
    idx_base = IDX + tok * topk
    n_tiles = topk // BLOCK_N
    # prologue: STAGES - 1 gathers in flight
    for st in gl.static_range(STAGES - 1):
        slot = gl.load(idx_base + st * BLOCK_N + rows).to(gl.int64)
        cp.async_copy_global_to_shared(raw.index(st), KV + slot[:, None] * TOK + cols[None, :])
        cp.commit_group()
    cp.wait_group(STAGES - 2)
    gl.barrier()
    if not DIRECT:
        _convert(raw.index(0), cvt.index(0), RAW_L)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc0 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc1 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc2 = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc3 = gl.zeros([16, 128], gl.float32, layout=MMA)
    for i in range(n_tiles):
        # the next gather
        nxt = i + STAGES - 1
        slot = gl.load(idx_base + (nxt % n_tiles) * BLOCK_N + rows).to(gl.int64)
        cp.async_copy_global_to_shared(raw.index(nxt % STAGES), KV + slot[:, None] * TOK + cols[None, :])
        cp.commit_group()
        cp.wait_group(STAGES - 2)
        gl.barrier()
        # tile i's dots (its converted keys in cvt[i % 2]) and tile i+1's conversion, no barrier between
        if DIRECT:
            r = raw.index(i % STAGES)
            k = cvt.index(0)
            s = mma_v2(q_smem.index(0).load(QL), _cvt_regs(r.slice(0, 128, dim=1).permute([1, 0]).load(B_OP4)), gl.zeros([16, BLOCK_N], gl.float32, MMA))
            s = mma_v2(q_smem.index(1).load(QL), _cvt_regs(r.slice(128, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            s = mma_v2(q_smem.index(2).load(QL), _cvt_regs(r.slice(256, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            s = mma_v2(q_smem.index(3).load(QL), _cvt_regs(r.slice(384, 128, dim=1).permute([1, 0]).load(B_OP4)), s)
            _convert(r, k, RAW_L)
        else:
            k = cvt.index(i % 2)
            s = mma_v2(q_smem.index(0).load(QL), k.slice(0, 128, dim=1).permute([1, 0]).load(B_OP), gl.zeros([16, BLOCK_N], gl.float32, MMA))
            s = mma_v2(q_smem.index(1).load(QL), k.slice(128, 128, dim=1).permute([1, 0]).load(B_OP), s)
            s = mma_v2(q_smem.index(2).load(QL), k.slice(256, 128, dim=1).permute([1, 0]).load(B_OP), s)
            s = mma_v2(q_smem.index(3).load(QL), k.slice(384, 128, dim=1).permute([1, 0]).load(B_OP), s)
            _convert(raw.index((i + 1) % STAGES), cvt.index((i + 1) % 2), RAW_L)
        s = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        gl.barrier()
        pa = p_smem.load(A_OP)
        acc0 = mma_v2(pa, k.slice(0, 128, dim=1).load(B_OP), acc0 * alpha[:, None])
        acc1 = mma_v2(pa, k.slice(128, 128, dim=1).load(B_OP), acc1 * alpha[:, None])
        acc2 = mma_v2(pa, k.slice(256, 128, dim=1).load(B_OP), acc2 * alpha[:, None])
        acc3 = mma_v2(pa, k.slice(384, 128, dim=1).load(B_OP), acc3 * alpha[:, None])
    cp.wait_group(0)
    ho = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    do = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    o = OUT + tok * (16 * 512) + ho[:, None] * 512 + do[None, :]
    inv = 1.0 / l_i
    gl.store(o, (acc0 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 128, (acc1 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 256, (acc2 * inv[:, None]).to(gl.bfloat16))
    gl.store(o + 384, (acc3 * inv[:, None]).to(gl.bfloat16))


def compile_variant(cap: int, block_n: int, stages: int, direct: bool) -> dict:
    sig = {"Q": "*bf16", "KV": "*u8", "IDX": "*i32", "OUT": "*bf16", "topk": "i32", "qk_scale": "fp32",
           "BLOCK_N": "constexpr", "STAGES": "constexpr", "DIRECT": "constexpr", "num_warps": "constexpr"}
    an = list(probe_kernel.arg_names)
    attrs = {(an.index(n),): [["tt.divisibility", 16]] for n in ("Q", "KV", "IDX", "OUT")}
    src = gluon._runtime.GluonASTSource(fn=probe_kernel, signature=sig,
                                        constexprs={"BLOCK_N": block_n, "STAGES": stages, "DIRECT": direct, "num_warps": 4},
                                        attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as t:
        Path(t, "k.cubin").write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", f"{t}/k.cubin"], capture_output=True, text=True).stdout
        res = subprocess.run([str(cuobjdump), "-res-usage", f"{t}/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    reg = re.search(r"REG:([0-9]+)", res)
    stack = re.search(r"STACK:([0-9]+)", res)
    return {"shared": int(k.metadata.shared), "registers": int(reg.group(1)) if reg else None,
            "stack": int(stack.group(1)) if stack else 0, "ops": {o: ops[o] for o in OPS}}


OPS = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "BAR")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, action="append", help="compute capability x 10 (default: 120)")
    args = parser.parse_args()
    print("| target | variant | BLOCK_N | raw stages | shared bytes | fits 101376 | registers | stack (spills) | "
          + " | ".join(OPS) + " |")
    print("|---|---|---:|---:|---:|---|---:|---:|" + "---:|" * len(OPS))
    for cap in args.cap or [120]:
        for direct, block_n, stages in ((False, 32, 3), (True, 32, 3), (True, 32, 2)):
            r = compile_variant(cap, block_n, stages, direct)
            print(f"| sm_{cap} | {'direct' if direct else 'staged'} | {block_n} | {stages} | {r['shared']} | "
                  f"{'yes' if r['shared'] <= 101376 else 'no'} | {r['registers']} | {r['stack']} | "
                  + " | ".join(str(r["ops"][o]) for o in OPS) + " |", flush=True)


if __name__ == "__main__":
    main()
