"""Static resource check of a Triton kernel for SM120 (Blackwell workstation GPUs), no GPU needed.

Triton compiles a @triton.jit function for a named target without a device; ptxas (shipped
with Triton) then reports registers and spills. A kernel that fits the H200 (227 KB of shared
memory per block) may not fit an RTX PRO 6000 (SM120: 99 KB), and the failure only shows at
launch on the fleet. Tests call `compile_for_sm120` for every config a launcher can choose and
assert `report.fits()`; `sparse_mla_specs()` lists the sparse-MLA launcher's launches (the
indexer's test lists its own).

A test tool: nothing in mlafleet imports it, and the patch sets do not ship it.

    report = compile_for_sm120(my_kernel, {"X": "*bf16", "n": "i32"}, {"BLOCK": 64},
                               num_warps=4, num_stages=2)
    assert report.fits(), report
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import triton
from triton.backends.compiler import GPUTarget

SM120_CAPABILITY = 120
SM120_MAX_SHARED_BYTES = 101376  # 99 KB: the most dynamic shared memory one block may use on SM120
MAX_REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class Sm120Report:
    """What one compiled kernel needs on SM120."""

    name: str
    shared_bytes: int  # dynamic shared memory per block (Triton's metadata.shared)
    registers: int  # per thread, from ptxas
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int  # the stack frame; non-zero alone is not a spill
    num_warps: int
    num_stages: int
    grid_dependency_wait: bool = False  # waits for the grid before it (griddepcontrol.wait: PDL launches)

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def fits(self, max_shared_bytes: int = SM120_MAX_SHARED_BYTES) -> bool:
        return self.shared_bytes <= max_shared_bytes and self.spills == 0

    def __str__(self) -> str:
        return (f"{self.name} (warps={self.num_warps}, stages={self.num_stages}): "
                f"shared {self.shared_bytes} B of {SM120_MAX_SHARED_BYTES}, {self.registers} registers, "
                f"spills {self.spill_store_bytes} B stored / {self.spill_load_bytes} B loaded, "
                f"stack {self.stack_bytes} B")


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_for_sm120(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                      num_warps: int, num_stages: int, aligned: Iterable[str] = (),
                      capability: int = SM120_CAPABILITY, maxnreg: int | None = None) -> Sm120Report:
    """Compile `fn` (a @triton.jit or @gluon.jit function) for sm_120 and report its resources.

    signature: the runtime arguments, name -> Triton type ("*bf16", "*u8", "i32", "i64", "fp32").
    constexprs: the constexpr arguments, name -> value.
    aligned: runtime arguments the launcher guarantees divisible by 16 (pointers: 16-byte
    aligned), as Triton's JIT specialises them at launch; this changes vectorisation and so
    the resources.
    maxnreg: the register limit per thread the launcher passes on SM12x (Triton's `maxnreg`,
    PTX `.maxnreg`), if any.

    Under TRITON_INTERPRET=1 (the CPU test suite) Triton cannot compile in this process, so the
    compilation runs in a child Python without it; `fn` must then be a module-level function.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(fn, (triton.runtime.JITFunction, InterpretedFunction)):
        raise TypeError(f"compile_for_sm120: {fn!r} is not a @triton.jit function")
    names = list(fn.arg_names)
    gluon = _is_gluon(fn)
    if gluon and "num_warps" in names:  # a Gluon kernel takes num_warps as a constexpr argument
        constexprs = {**constexprs, "num_warps": num_warps}
    unknown = (set(signature) | set(constexprs)) - set(names)
    if unknown:
        raise ValueError(f"compile_for_sm120: {fn.__name__} has no arguments {sorted(unknown)}")
    missing = [n for n in names if n not in signature and n not in constexprs]
    if missing:
        raise ValueError(f"compile_for_sm120: {fn.__name__} needs types or values for {missing}")
    aligned = set(aligned)
    if aligned - set(signature):
        raise ValueError(f"compile_for_sm120: aligned names {sorted(aligned - set(signature))} "
                         "are not runtime arguments")

    if isinstance(fn, InterpretedFunction) or (gluon and os.environ.get("TRITON_INTERPRET")):
        return _compile_in_child(fn, signature, constexprs, num_warps, num_stages, aligned, capability,
                                 maxnreg)

    full_signature = {n: signature.get(n, "constexpr") for n in names}
    # sorted: a set iterates in a per-process order, and the attrs are part of Triton's cache key
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sorted(aligned)}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fn=fn, signature=full_signature, constexprs=constexprs, attrs=attrs)
    else:
        source = triton.compiler.ASTSource(fn=fn, signature=full_signature, constexprs=constexprs,
                                           attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    registers, stack, spill_st, spill_ld = _ptxas_usage(compiled.asm["ptx"], capability)
    return Sm120Report(name=fn.__name__, shared_bytes=int(compiled.metadata.shared),
                       registers=registers, spill_store_bytes=spill_st, spill_load_bytes=spill_ld,
                       stack_bytes=stack, num_warps=num_warps, num_stages=num_stages,
                       grid_dependency_wait="griddepcontrol.wait" in compiled.asm["ptx"])


def _is_gluon(fn: Any) -> bool:
    """A @gluon.jit function (Triton's explicit-layout dialect: triton.experimental.gluon)."""
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:  # a Triton without Gluon has no Gluon kernels either
        return False
    return isinstance(fn, GluonJITFunction)


def _usage_cache() -> Path:
    """Where ptxas -v reports are kept: $MLAFLEET_CACHE/ptxas-usage (default ~/.cache/mlafleet).
    A report is a pure function of the PTX, the target and the ptxas that Triton bundles, so it
    is looked up by their hash, as Triton caches its own compilations."""
    root = os.environ.get("MLAFLEET_CACHE") or os.path.join(Path.home(), ".cache", "mlafleet")
    return Path(root) / "ptxas-usage"


def _ptxas_usage(ptx: str, capability: int) -> tuple[int, int, int, int]:
    """Run Triton's ptxas with -v on the PTX: (registers, stack, spill stores, spill loads)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(capability)
    key = hashlib.sha256(f"{ptxas.version}\0{os.path.getsize(ptxas.path)}\0{capability}\0{ptx}".encode()).hexdigest()
    cached = _usage_cache() / f"{key}.json"
    try:
        return tuple(json.loads(cached.read_text()))  # type: ignore[return-value]
    except (OSError, ValueError):
        pass
    usage = _run_ptxas(ptxas.path, ptx, sm_arch_from_capability(capability), capability)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(usage))
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache only costs time
    return usage


def _run_ptxas(ptxas: str, ptx: str, arch: str, capability: int) -> tuple[int, int, int, int]:
    with tempfile.TemporaryDirectory(prefix="mlafleet-sm120-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}",
                               str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{capability}:\n{log[-2000:]}")
    usage, spills = _PTXAS_USAGE.search(log), _PTXAS_SPILLS.search(log)
    if usage is None or spills is None:
        raise RuntimeError(f"cannot read ptxas -v output:\n{log[-2000:]}")
    stack, spill_st, spill_ld = (int(g) for g in spills.groups())
    return int(usage.group(1)), stack, spill_st, spill_ld


def _compile_in_child(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int,
                      num_stages: int, aligned: Iterable[str], capability: int,
                      maxnreg: int | None) -> Sm120Report:
    """compile_for_sm120 in a Python without TRITON_INTERPRET, importing fn's module by name."""
    module, name = fn.fn.__module__, fn.fn.__name__
    request = {"module": module, "name": name, "signature": signature, "constexprs": constexprs,
               "num_warps": num_warps, "num_stages": num_stages, "aligned": sorted(aligned),
               "capability": capability, "maxnreg": maxnreg}
    child = ("import importlib, json, sys, dataclasses\n"
             f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
             "from sm120 import compile_for_sm120\n"
             "r = json.loads(sys.stdin.read())\n"
             "fn = getattr(importlib.import_module(r['module']), r['name'])\n"
             "rep = compile_for_sm120(fn, r['signature'], r['constexprs'], r['num_warps'],\n"
             "                        r['num_stages'], r['aligned'], r['capability'], r['maxnreg'])\n"
             "print('SM120REPORT ' + json.dumps(dataclasses.asdict(rep)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", child], input=json.dumps(request), env=env,
                          capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("SM120REPORT "):
            return Sm120Report(**json.loads(line[len("SM120REPORT "):]))
    raise RuntimeError(f"compile_for_sm120: compiling {module}.{name} in a child Python failed:\n"
                       f"{(proc.stdout + proc.stderr)[-3000:]}")


# --------------------------------------------------------------------------------------
# the sparse-MLA launcher's launches
# --------------------------------------------------------------------------------------

def sparse_mla_specs(configs: list[tuple[str, Any]] | None = None, merge: bool = True) -> list[dict]:
    """Everything the sparse-MLA launcher (mlafleet/kernels/sparse_mla.py) can launch, as arguments
    of compile_for_sm120.

    Each config in sparse_mla.CONFIGS (or `configs`: (cache dtype, config) pairs) for its cache dtype
    (an fp8 config for fp8_ds_mla and for a plain fp8 cache) and both output modes, plus the
    merge kernel, with the specialisations Triton's JIT makes
    at a typical launch (contiguous last dims are stride 1, token strides and pointers
    divisible by 16).
    """
    from mlafleet.kernels import sparse_mla as sm

    specs = []
    for dtype, cfg in configs or [*((dtype, cfg) for (dtype, _), cfg in sm.CONFIGS.items()), ("fp8", sm.GLUON_FP8)]:
        fp8 = dtype == "fp8"
        if cfg.gluon:
            specs.extend(gluon_specs(cfg))
            continue
        for partial, rope_e4m3, trim in [(p, r, t) for p in (False, True) for r in ((False, True) if fp8 else (False,))
                                         for t in ((False, True) if cfg.trim_tail else (False,))]:
            signature = {
                "Q": "*bf16", "stride_q_tok": "i32", "stride_q_head": "i32",
                "Q_ROPE": "*bf16", "stride_qr_tok": "i32", "stride_qr_head": "i32",
                "KV": "*u8" if fp8 else "*bf16", "stride_kv_tok": "i32", "n_slots": "i32",
                "IDX": "*i32", "stride_idx_tok": "i32",
                "OUT": "*fp32" if partial else "*bf16", "stride_out_tok": "i32",
                "stride_out_split": "i32", "stride_out_head": "i32",
                "LSE": "*fp32", "stride_lse_tok": "i32", "stride_lse_split": "i32",
                "stride_lse_head": "i32", "h_q": "i32", "topk": "i32", "tokens_per_split": "i32",
                "n_split": "i32", "n_head_blocks": "i32", "qk_scale_log2": "fp32",
                "KV_SCALE": "*fp32",
            }
            constexprs = {"stride_q_dim": 1, "stride_qr_dim": 1, "stride_idx_k": 1, "BLOCK_H": cfg.block_h,
                          "BLOCK_N": cfg.block_n, "FP8": fp8, "ROPE_E4M3": rope_e4m3, "PARTIAL": partial,
                          "SCALE_LOGITS": cfg.scale_logits,
                          "DOT_F32": False, "TRIM_TAIL": trim, "LAZY_RESCALE": cfg.lazy_rescale,
                          "PDL": True, "PREFETCH_IDX": cfg.prefetch_idx}  # SM12x launches with PDL (_pdl)
            aligned = ["Q", "Q_ROPE", "KV", "IDX", "OUT", "LSE", "stride_q_tok", "stride_q_head",
                       "stride_qr_tok", "stride_qr_head",
                       "stride_kv_tok", "stride_out_tok", "stride_out_head"]
            specs.append({"fn": sm._sparse_mla_kernel, "signature": signature, "constexprs": constexprs,
                          "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "aligned": aligned,
                          "maxnreg": cfg.sm12x_maxnreg})
    merge_sig = {"PART_OUT": "*fp32", "stride_po_tok": "i32", "stride_po_split": "i32",
                 "stride_po_head": "i32", "PART_LSE": "*fp32", "stride_pl_tok": "i32",
                 "stride_pl_split": "i32", "stride_pl_head": "i32", "OUT": "*bf16",
                 "stride_out_tok": "i32", "stride_out_head": "i32", "LSE": "*fp32",
                 "stride_lse_tok": "i32", "stride_lse_head": "i32", "h_q": "i32", "n_split": "i32"}
    merges = [(block_split, block_d) for block_split in (2, 4, 8, 16, 32, 64, 128) for block_d in sm.MERGE_BLOCK_DS
              if block_split <= 64 or block_d == 32]  # _merge_block_d's choices
    for block_split, block_d in merges if merge else ():  # next_power_of_2(num_splits)
        specs.append({"fn": sm._merge_splits_kernel, "signature": merge_sig,
                      "constexprs": {"BLOCK_SPLIT": block_split, "PDL": True, "BLOCK_D": block_d},
                      "num_warps": sm.MERGE_NUM_WARPS,
                      "num_stages": 1, "aligned": ["PART_OUT", "OUT", "LSE", "PART_LSE"]})
    if merge:  # and the fp8_ds_mla prefill workspace's two kernels (attend_prefill_fp8_ds_mla)
        specs.append({"fn": sm._fp8_ds_mla_context_kernel,
                      "signature": {"ROWS": "*u8", "stride_row": "i32", "BLOCK_TABLE": "*i32", "stride_bt": "i32",
                                    "SEQ_LENS": "*i32", "rows_per_block": "i32", "OUT": "*bf16", "stride_out": "i32",
                                    "seg_rows": "i32"},
                      "constexprs": {"BLOCK_R": sm.CONTEXT_BLOCK_R, "PAGE": sm.FP8_BLOCK_SIZE}, "num_warps": 4,
                      "num_stages": 1,
                      "aligned": ["ROWS", "stride_row", "BLOCK_TABLE", "SEQ_LENS", "OUT", "stride_out"]})
        specs.append({"fn": sm._workspace_rows_kernel,
                      "signature": {"POS": "*i32", "stride_pos": "i32", "SEG_OF_TOKEN": "*i32", "SEQ_LENS": "*i32",
                                    "OUT": "*i32", "topk": "i32", "seg_rows": "i32"},
                      "constexprs": {"BLOCK_K": sm.WS_ROWS_BLOCK_K}, "num_warps": 4, "num_stages": 1,
                      "aligned": ["POS", "stride_pos", "SEG_OF_TOKEN", "SEQ_LENS", "OUT", "topk"]})
    return specs


def gluon_specs(cfg: Any) -> list[dict]:
    """The Gluon fp8_ds_mla kernel's launches (cfg: a sparse_mla.KernelConfig), as sparse_mla_specs gives them: final and partial,
    untrimmed and trimmed."""
    from mlafleet.kernels import sparse_mla_gluon as glu

    signature = {n: "i32" for n in glu.sparse_mla_fp8_grouped.arg_names}
    signature.update({"Q": "*bf16", "Q_ROPE": "*bf16", "KV": "*u8", "KVH": "*bf16", "KVF": "*fp32",
                      "IDX": "*i32", "LSE": "*fp32", "qk_scale_log2": "fp32"})
    for name in ("BLOCK_N", "STAGES", "PARTIAL", "TRIM_TAIL", "num_warps", "PAD_KB"):
        del signature[name]
    aligned = ["Q", "Q_ROPE", "KV", "KVH", "KVF", "IDX", "OUT", "LSE", "stride_q_tok", "stride_q_head",
               "stride_qr_tok", "stride_qr_head", "stride_kv_tok", "stride_out_tok", "stride_out_head"]
    return [{"fn": glu.sparse_mla_fp8_grouped, "signature": {**signature, "OUT": "*fp32" if partial else "*bf16"},
             "constexprs": {"BLOCK_N": cfg.block_n, "STAGES": cfg.num_stages, "PARTIAL": partial, "TRIM_TAIL": trim,
                            "PAD_KB": 0},
             "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "aligned": aligned, "maxnreg": cfg.sm12x_maxnreg}
            for partial in (False, True) for trim in (False, True)]
