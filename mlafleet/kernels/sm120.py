"""Static resource check of a Triton kernel for SM120 (Blackwell workstation GPUs), no GPU needed.

Triton compiles a @triton.jit function for a named target without a device; ptxas (shipped
with Triton) then reports registers and spills. A kernel that fits the H200 (227 KB of shared
memory per block) may not fit an RTX PRO 6000 (SM120: 99 KB), and the failure only shows at
launch on the fleet. Tests call `compile_for_sm120` for every config a launcher can choose and
assert `report.fits()`.

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
             "from mlafleet.kernels.sm120 import compile_for_sm120\n"
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
