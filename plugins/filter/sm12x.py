"""Filters for the sparse-MLA backend a host runs: its default, what vLLM logged, what to expect.

- `sm12x_triton_default(gpus)`: the default of `vllm_server_triton_sparse_mla` (and of preflight's
  view of it) from preflight's GPU facts: true on compute capability 12.1 (GB10, DGX Spark).
- `sm12x_backend_log(lines)`: what a vLLM server's journal says about its attention backend.
- `sm12x_expected_backend(facts)`: the backend the smoke test requires of a host.

Why 12.1 defaults to mlafleet's Triton kernels (docs/sm12x.md): vLLM 0.32.0 picks FlashInfer's
SM120 sparse-MLA kernels (FLASHINFER_MLA_SPARSE_SM120, fp8_ds_mla KV) and DeepGEMM's SM120 indexer
on 12.x. On GB10 (12.1) operators report a livelock under cold-prefill load that wedges whole
tensor-parallel clusters while /health answers 200 (vLLM RFC 48720, PR 49026, whose way out is a
Triton sparse-MLA backend), hangs fixed piecemeal in FlashInfer (its PRs 4732 and 5048, issue 5015)
and "server healthy, first request never returns" on two-node GB10 clusters. The same reports do
not name 12.0 (RTX PRO 6000, RTX 5090), which keeps vLLM's choice unless the operator switches.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

# Compute capabilities whose default is mlafleet's Triton sparse MLA and DeepGEMM-free indexer.
TRITON_BY_DEFAULT = ("12.1",)
OURS = "TRITON_MLA_SPARSE"
UPSTREAM_SM120 = "FLASHINFER_MLA_SPARSE_SM120"
# The CPU platform's one backend for standard attention: vLLM selects it without a log line.
CPU_STANDARD = "CPU_ATTN"
UNQUANTISED_KV = (None, "", "auto", "bfloat16", "float16")

_USING = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z0-9_]+) (?:attention )?backend")
_ENGINE = re.compile(r"Initializing a V1 LLM engine \(v([0-9][^)]*)\)")
_DEVICE = re.compile(r"device_config=([a-z]+)")
_ARGS = re.compile(r"non-default args: (\{.*\})")


def triton_default(gpus: Any) -> bool:
    """Whether a host with these GPUs (preflight_gpus) serves sparse MLA through mlafleet's Triton
    kernels by default: any GPU of compute capability 12.1."""
    return any(str((g or {}).get("compute_capability", "")).strip() in TRITON_BY_DEFAULT for g in (gpus or []))


def backend_log(lines: Any) -> dict[str, Any]:
    """{backends, device, version, args} from a vLLM server's journal lines.

    backends: every attention backend the server said it uses, in order ("Using
    AttentionBackendEnum.X backend.", "Using X attention backend out of potential backends: ...",
    the CPU platform's "Using CPU_MLA backend."); a server on the CPU platform that named none runs
    CPU_ATTN, the CPU platform's only backend for standard attention, which it selects silently.
    device and version: from vLLM's engine configuration line; args: the "non-default args" it logged.
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    backends: list[str] = []
    device = version = None
    args: dict[str, Any] = {}
    for line in lines or []:
        backends += _USING.findall(line)
        if m := _ENGINE.search(line):
            version = m.group(1)
        if m := _DEVICE.search(line):
            device = m.group(1)
        if m := _ARGS.search(line):
            try:
                parsed = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
    if not backends and device == "cpu":
        backends = [CPU_STANDARD]
    return {"backends": backends, "device": device, "version": version, "args": args}


def is_sparse_mla_model(config: Any) -> bool:
    """A DSA (sparse MLA) model: its config has index_topk, as vLLM decides (DeepSeek-V3.2, GLM-5)."""
    if isinstance(config, (str, bytes)):
        try:
            config = json.loads(config)
        except ValueError:
            return False
    if not isinstance(config, dict):
        return False
    return any(isinstance(c, dict) and "index_topk" in c for c in (config, config.get("text_config")))


def expected_backend(facts: dict[str, Any]) -> str:
    """The attention backend a host must report, "" where mlafleet expects nothing in particular.

    facts: gpus (preflight_gpus; None when unknown), line (the running vLLM's version), switch (the
    running release's MLAFLEET_TRITON_SPARSE_MLA), model_config (config.json text or dict), log
    (sm12x_backend_log's answer for the running server).
    - The operator named a backend (--attention-backend, in the logged arguments): that one.
    - The host's GPUs are unknown (preflight did not run): nothing.
    - A host without GPUs (the lab, vLLM's CPU build): CPU_ATTN for a standard-attention model.
    - A sparse-MLA (DSA) model on compute capability 8.x or 12.x: TRITON_MLA_SPARSE, except on the
      0.32.0 line on 12.x with an fp8 cache and the switch off, where the operator keeps upstream's
      FLASHINFER_MLA_SPARSE_SM120.
    - Anything else (9.x, 10.x, another model): upstream's choice, not checked.
    """
    log = facts.get("log") or {}
    args = log.get("args") or {}
    named = args.get("attention_backend")
    if named:
        return str(named).split(".")[-1]
    gpus = facts.get("gpus")
    if gpus is None:
        return ""
    sparse = is_sparse_mla_model(facts.get("model_config"))
    if not gpus:
        return "" if sparse else CPU_STANDARD
    if not sparse:
        return ""
    majors = {str((g or {}).get("compute_capability", "")).split(".")[0] for g in gpus}
    if "12" in majors:
        line = str(log.get("version") or facts.get("line") or "")
        fp8 = args.get("kv_cache_dtype") not in UNQUANTISED_KV
        if line.startswith("0.32.") and fp8 and not facts.get("switch"):
            return UPSTREAM_SM120
        return OURS
    if "8" in majors:
        return OURS
    return ""


def env_switch(text: Any) -> bool:
    """MLAFLEET_TRITON_SPARSE_MLA=1 in an environment file's text."""
    for line in str(text or "").splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key == "MLAFLEET_TRITON_SPARSE_MLA":
            return value.strip() == "1"
    return False


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"sm12x_triton_default": triton_default, "sm12x_backend_log": backend_log,
                "sm12x_expected_backend": expected_backend, "sm12x_env_switch": env_switch}
