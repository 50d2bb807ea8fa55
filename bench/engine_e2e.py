"""The patched vLLM engine on a GPU, one configuration per process: what it computed, how fast.

    python bench/engine_e2e.py run OUT.json --model DIR --backend TRITON_MLA_SPARSE \\
        --kv fp8_ds_mla --indexer fallback [--gguf] [--tp 2]
    python bench/engine_e2e.py compare OUT_DIR/*.json     # a markdown report on stdout
    python bench/engine_e2e.py tokens OUT.json RUN.json...  # each run's greedy tokens beside its reference's
    python bench/engine_e2e.py profile RUN.json TRACE_DIR  # (re)read a run's --profile trace into RUN.json

The model is the project's tiny GLM-5 (`mlafleet.lab.tinymodel.write_tiny_glm5`: GLM-5's attention
and indexer geometry, 2 layers, random weights) loaded from its safetensors or, with --gguf,
from its 3 GGUF shards through the patch set's glm-dsa loader; a block-FP8 snapshot
(`write_tiny_glm5_fp8`) loads the same way as safetensors, vLLM reading its quantization_config
(the run's `weights` says "fp8-block safetensors"). Prompts are token ids.

1. Correctness: 4 prompts (3000 and 2100 tokens, so the indexer's top-2048 selection drops
   tokens; 700 and 40 tokens), prompt log-probabilities (the prefill path), 32 greedy tokens
   with their top-2 log-probabilities (the decode path).
2. Throughput at batch 1 and 32 (3000-token prompts, prefix caching off): the same batch once
   with 1 output token (prefill) and once with 65 (ignore_eos); decode tok/s = batch x 64 /
   (t65 - t1), output tok/s = batch x 65 / t65. Each batch size gets an untimed pass at the timed
   shapes first (kernels compile per shape on first use); each timing is the fastest of two
   (--repeats N: of N).
   The engine runs eagerly unless --graphs (vLLM's default torch.compile + CUDA graphs), the same for every backend.

3. With --profile DIR, a profile of the decode steps at batch 32 (--profile-batch N: N; 3000-token
   prompts): vLLM's own torch profiler in the engine's worker, started PROFILE_DELAY engine steps
   into the batch (past its prefill chunks) for PROFILE_STEPS steps; the GPU kernels' time per
   step, by kernel, and the host's side (step interval, annotated scopes, CUDA API calls), from
   the trace it writes to DIR (`compare` prints the runs' profiles side by side). With
   --profile-phase prefill instead: the same batch with one output token, every step of it
   profiled (its prefill chunks), the kernels' time per step and in all (`prefill_profile`).

--correctness-only skips 2. (the greedy tokens are what a comparison of backends needs); --dry-run
parses the arguments, reads the model's config.json and prints what the run would pass to vLLM
(imports neither vLLM nor torch: bench/engine_gpu.sh's DRY_RUN=1 runs it on the CPU).

--indexer fallback sets MLAFLEET_INDEXER_FALLBACK=1 (the DeepGEMM-free indexer) and
MLAFLEET_INDEXER_TOPK (default triton: the top-k that 8.x, and SM120 on 0.20.2, run); deepgemm leaves vLLM's own
DeepGEMM indexer. bench/engine_gpu.sh keeps each run's log and prints the engine's lines naming
the indexer path, so a report shows what really ran.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time

PROMPT_LENGTHS = [3000, 2100, 700, 40]
GREEDY_TOKENS = 32
BATCHES = (1, 32)
THROUGHPUT_PROMPT = 3000
DECODE_TOKENS = 64
PROFILE_BATCH = 32
# engine steps before the profile starts: the batch's prefill (32 x 3000 tokens) is done in
# ceil(96000 / max_num_batched_tokens) steps, at most 47 for vLLM's smallest default (2048)
PROFILE_DELAY = 48
PROFILE_STEPS = 16
PREFILL_PROFILE_STEPS = 64  # more than a batch's prefill steps; the profile stops with the batch
# vLLM's host-side annotation of each engine step: the forward scope of gpu_model_runner.py (with
# VLLM_CUSTOM_SCOPES_FOR_PROFILING=1), or, from the CUDA worker of 0.32.0, one scope a step named
# after the batch ("execute_context_0(0)_generation_32(32)": no prefill, 32 decode requests)
FORWARD_SCOPE = "gpu_model_runner: forward"
STEP_SCOPE_PREFIX = "execute_context_"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the host's CUDA API calls (launches, copies, syncs)


def _prompts(lengths: list[int], seed: int, vocab: int) -> list:
    import torch
    from vllm.inputs import TokensPrompt

    gen = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (n,), generator=gen).tolist()) for n in lengths]


def weights_kind(config: dict, gguf: bool) -> str:
    """What the run loads: "gguf", "safetensors" (bf16) or "fp8-block safetensors" (a quantization_config
    with quant_method fp8 and weight_block_size, as GLM-5's FP8 checkpoints have)."""
    if gguf:
        return "gguf"
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        return "fp8-block safetensors"
    return "safetensors"


def _engine_env(args: argparse.Namespace) -> dict[str, str | None]:
    """The environment the run sets for vLLM and the patch set (None: removed)."""
    env: dict[str, str | None] = ({"MLAFLEET_INDEXER_FALLBACK": "1", "MLAFLEET_INDEXER_TOPK": args.topk}
                                  if args.indexer == "fallback" else {"MLAFLEET_INDEXER_FALLBACK": None})
    if args.profile:  # vLLM's per-step scopes (the step count of a profile)
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    return env


def _deep_gemm_warmup() -> str:
    """vLLM's DeepGEMM warm-up at engine start (VLLM_DEEP_GEMM_WARMUP: skip, full, relax; relax when unset)."""
    return os.environ.get("VLLM_DEEP_GEMM_WARMUP", "").strip() or "relax"


def _llm_kwargs(args: argparse.Namespace) -> dict:
    """What the run passes to vllm.LLM."""
    model = sorted(glob.glob(os.path.join(args.model, "*-00001-of-*.gguf")))[0] if args.gguf else args.model
    return dict(model=model, tokenizer=args.model, dtype="bfloat16", enforce_eager=not args.graphs, max_model_len=4096,
                seed=0, gpu_memory_utilization=0.45, kv_cache_dtype=args.kv, enable_prefix_caching=False,
                tensor_parallel_size=args.tp, disable_custom_all_reduce=True, max_num_seqs=64,
                **({} if args.backend == "auto" else {"attention_config": {"backend": args.backend}}),
                **({"max_num_batched_tokens": args.chunk} if args.chunk else {}),
                **({"profiler_config": _profiler_config(args.profile, args.profile_phase)} if args.profile else {}))


def run(args: argparse.Namespace) -> None:
    config = json.load(open(os.path.join(args.model, "config.json")))
    if args.dry_run:
        print(json.dumps({"out": args.out, "weights": weights_kind(config, args.gguf), "env": _engine_env(args),
                          "llm": _llm_kwargs(args), "prompt_lengths": PROMPT_LENGTHS,
                          "greedy_tokens": GREEDY_TOKENS, "index_topk": config.get("index_topk"),
                          "deep_gemm": os.environ.get("VLLM_USE_DEEP_GEMM", "").strip() != "0",
                          "deep_gemm_warmup": _deep_gemm_warmup(),
                          "throughput": not args.correctness_only}), flush=True)
        return
    for key, value in _engine_env(args).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from vllm import LLM, SamplingParams

    vocab = config["vocab_size"]
    start = time.perf_counter()
    llm = LLM(**_llm_kwargs(args))
    result = {"backend": args.backend, "kv_cache_dtype": args.kv, "indexer": args.indexer,
              "topk": args.topk if args.indexer == "fallback" else "vllm", "weights": weights_kind(config, args.gguf),
              "tp": args.tp, "heads": config["num_attention_heads"], "layers": config["num_hidden_layers"],
              "chunk": args.chunk, "graphs": args.graphs, "engine_start_s": round(time.perf_counter() - start, 1),
              # VLLM_USE_DEEP_GEMM=0: no DeepGEMM anywhere (block-FP8 GEMMs then on vLLM's next kernel: CUTLASS, Triton)
              "deep_gemm": os.environ.get("VLLM_USE_DEEP_GEMM", "").strip() != "0",
              "deep_gemm_warmup": _deep_gemm_warmup(),
              # the sparse-MLA launcher's fp8_ds_mla kernel override (bench/engine_gpu.sh heads8-gluon-fp8)
              "fp8_kernel": os.environ.get("MLAFLEET_SPARSE_MLA_FP8_KERNEL", "").strip().lower() or "auto",
              # the 0.32.0 backend's fp8_ds_mla prefill workspace switch (bench/engine_gpu.sh prefill-ws)
              "prefill_workspace": (os.environ.get("MLAFLEET_SPARSE_MLA_PREFILL_WORKSPACE", "").strip().lower()
                                    or "auto")}

    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=2,
                            prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(_prompts(PROMPT_LENGTHS, 0, vocab), greedy, use_tqdm=False)
    result["requests"] = []
    for output in outputs:
        completion = output.outputs[0]
        steps = []
        for token, candidates in zip(completion.token_ids, completion.logprobs):
            ranked = sorted(candidates.items(), key=lambda kv: kv[1].rank)
            steps.append({"token": token, "logprob": candidates[token].logprob,
                          "top2": [[t, lp.logprob] for t, lp in ranked[:2]]})
        result["requests"].append({
            "prompt_len": len(output.prompt_token_ids), "tokens": list(completion.token_ids), "steps": steps,
            "prompt_logprobs": [next(iter(d.values())).logprob if d else None for d in output.prompt_logprobs],
        })

    # Timing: per batch size, one untimed pass at exactly the timed shapes first (Triton and
    # DeepGEMM compile per shape on first use), then each measurement twice, keeping the faster
    # (every run is recorded, with a third prefill-only run after the 65-token runs, and the
    # kernels Triton compiled while the runs were timed).
    result["throughput"] = []
    for batch in () if args.correctness_only else BATCHES:
        def timed(n_out: int, seed: int) -> float:
            prompts = _prompts([THROUGHPUT_PROMPT] * batch, seed, vocab)
            params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == n_out for o in outs)
            return elapsed

        timed(DECODE_TOKENS + 1, 99)
        compiled_before = _triton_cache_entries()
        runs1 = [timed(1, 1000 + batch + r) for r in range(args.repeats)]
        runs65 = [timed(DECODE_TOKENS + 1, 2000 + batch + r) for r in range(args.repeats)]
        runs1.append(timed(1, 1000 + args.repeats + batch))  # once more after the 65-token runs: order effects show
        t1, t65 = min(runs1), min(runs65)
        result["throughput"].append({
            "batch": batch, "prefill_s": round(t1, 3), "total_s": round(t65, 3),
            "prefill_runs_s": [round(t, 3) for t in runs1], "total_runs_s": [round(t, 3) for t in runs65],
            "triton_compiled_timed": _kernel_names(_triton_cache_entries() - compiled_before),
            "prefill_tok_s": round(batch * THROUGHPUT_PROMPT / t1),
            "decode_tok_s": round(batch * DECODE_TOKENS / (t65 - t1), 1),
            "output_tok_s": round(batch * (DECODE_TOKENS + 1) / t65, 1)})
    with open(args.out, "w") as handle:  # written before the profile, which may fail on its own
        json.dump(result, handle)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}), flush=True)
    if args.profile:
        key = f"{args.profile_phase}_profile"
        prompts = _prompts([THROUGHPUT_PROMPT] * args.profile_batch, 3000, vocab)
        n_out = 1 if args.profile_phase == "prefill" else PROFILE_DELAY + PROFILE_STEPS + 8
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
        before = set(_traces(args.profile))
        llm.start_profile()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        llm.stop_profile()  # a no-op where the profile stopped itself after its steps
        written = sorted(set(_traces(args.profile)) - before, key=os.path.getmtime)
        if not written:
            raise SystemExit(f"--profile: no trace written to {args.profile}")
        result[key] = profile_summary(written[-1])
        result[key]["trace"] = os.path.basename(written[-1])
        result[key]["batch"] = args.profile_batch
        if args.profile_phase == "prefill":  # the batch's wall time, profiler on (its overhead included)
            result[key]["batch_wall_s"] = round(elapsed, 3)
        scheduler = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
        result[key]["max_num_batched_tokens"] = getattr(scheduler, "max_num_batched_tokens", None)
        with open(args.out, "w") as handle:
            json.dump(result, handle)
        print(json.dumps(result[key])[:2000], flush=True)


def _triton_cache_entries() -> set[str]:
    """Kernels in Triton's on-disk cache (one directory each, shared with the engine's processes):
    the set grows when a timed run compiles."""
    directory = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return {os.path.join(directory, d) for d in os.listdir(directory)} if os.path.isdir(directory) else set()


def _kernel_names(entries: set[str]) -> list[str]:
    """The kernels compiled into these cache entries (each holds <kernel name>.json beside its binary)."""
    names = []
    for entry in sorted(entries):
        names += [f[:-5] for f in os.listdir(entry) if f.endswith(".json") and not f.startswith("__grp__")]
    return sorted(names)


def _profiler_config(directory: str, phase: str = "decode") -> dict:
    """vLLM's torch profiler in the worker only: PROFILE_STEPS engine steps after PROFILE_DELAY
    (decode), or every step from the start (prefill)."""
    delay, steps = (PROFILE_DELAY, PROFILE_STEPS) if phase == "decode" else (0, PREFILL_PROFILE_STEPS)
    return {"profiler": "torch", "torch_profiler_dir": os.path.abspath(directory), "ignore_frontend": True,
            "torch_profiler_with_stack": False, "delay_iterations": delay, "max_iterations": steps}


def _traces(directory: str) -> list[str]:
    return glob.glob(os.path.join(directory, "**", "*.pt.trace.json*"), recursive=True)


def _kernel_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list, at most 90 characters."""
    short = name.removeprefix("void ").split("<", 1)[0].split("(", 1)[0].strip()
    return (short or name)[:90]


def profile_summary(path: str, top: int = 30) -> dict:
    """GPU time per engine step, by kernel, and the host's side of a step, from one torch profiler
    trace (Chrome trace JSON, gzip or not).

    Steps are counted by vLLM's step scopes (FORWARD_SCOPE, else STEP_SCOPE_PREFIX); GPU busy is the sum of kernel, copy and set
    durations; span is from the first GPU activity's start to the last one's end (the gaps in
    it are time the GPU waited for the host). The host: the step interval (from one step
    scope's start to the next one's, the wall time of a step as the worker sees it), the time
    per step in each host-side scope vLLM annotates (the scheduler's, the model runner's; the
    STEP_SCOPE_PREFIX scopes together as one), and the CUDA API calls per step by name (a
    synchronising call there is where the host waits for the GPU)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    annotations = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    scopes = [e.get("name", "") for e in annotations]
    steps = scopes.count(FORWARD_SCOPE) or sum(n.startswith(STEP_SCOPE_PREFIX) for n in scopes)
    batches = sorted({n for n in scopes if n.startswith(STEP_SCOPE_PREFIX)})
    by_name: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}
    start, end = float("inf"), float("-inf")
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in RUNTIME_CATEGORIES:
            total = runtime.setdefault(e.get("name", "?"), [0.0, 0])
            total[0] += e.get("dur", 0.0)
            total[1] += 1
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        total = by_name.setdefault(_kernel_name(e["name"]), [0.0, 0])
        total[0] += e.get("dur", 0.0)
        total[1] += 1
        start, end = min(start, e["ts"]), max(end, e["ts"] + e.get("dur", 0.0))
    if not steps or not by_name:
        raise ValueError(f"{path}: {steps} step scopes ('{FORWARD_SCOPE}' or '{STEP_SCOPE_PREFIX}...') and "
                         f"{len(by_name)} GPU activities: not a profile of engine steps")
    busy = sum(t for t, _ in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    step_name = FORWARD_SCOPE if scopes.count(FORWARD_SCOPE) else None
    starts = sorted(e["ts"] for e in annotations
                    if (e["name"] == step_name if step_name else e["name"].startswith(STEP_SCOPE_PREFIX)))
    phases: dict[str, float] = {}
    for e in annotations:
        phase = STEP_SCOPE_PREFIX + "* (the step)" if e["name"].startswith(STEP_SCOPE_PREFIX) else e["name"]
        phases[phase] = phases.get(phase, 0.0) + e.get("dur", 0.0)
    calls = sorted(runtime.items(), key=lambda kv: -kv[1][0])
    return {"steps": steps, "step_scopes": batches, "gpu_busy_us_per_step": round(busy / steps, 1),
            "span_us_per_step": round((end - start) / steps, 1),
            "kernels": [{"name": n, "us_per_step": round(t / steps, 2), "calls_per_step": round(c / steps, 2)}
                        for n, (t, c) in ranked[:top]],
            "host": {"step_interval_us": (round((starts[-1] - starts[0]) / (len(starts) - 1), 1)
                                          if len(starts) > 1 else None),
                     "phases_us_per_step": {n: round(t / steps, 1) for n, t in sorted(phases.items())},
                     "cuda_calls": [{"name": n, "us_per_step": round(t / steps, 2), "calls_per_step": round(c / steps, 2)}
                                    for n, (t, c) in calls[:top]]}}


def attach_profile(run_path: str, directory: str) -> None:
    """Read the newest trace under `directory` into the run's decode_profile (for a run whose
    profile was written but not read, e.g. by an older version of this script)."""
    traces = sorted(_traces(directory), key=os.path.getmtime)
    if not traces:
        raise SystemExit(f"no torch profiler trace (*.pt.trace.json*) under {directory}")
    with open(run_path) as handle:
        run = json.load(handle)
    run["decode_profile"] = dict(profile_summary(traces[-1]), trace=os.path.basename(traces[-1]))
    with open(run_path, "w") as handle:
        json.dump(run, handle)
    print(f"{run_path}: {run['decode_profile']['steps']} steps, "
          f"{run['decode_profile']['gpu_busy_us_per_step']} us of GPU time a step")


def compare_profiles(runs: list[dict], phase: str = "decode") -> None:
    """The runs' decode-step (or prefill-step) profiles side by side: us per step for every
    kernel that takes at least 2% of some run's GPU time."""
    key = f"{phase}_profile"
    runs = [r for r in runs if r.get(key)]
    if not runs:
        return
    names: list[str] = []
    for r in runs:
        p = r[key]
        for k in p["kernels"]:
            if k["us_per_step"] >= 0.02 * p["gpu_busy_us_per_step"] and k["name"] not in names:
                names.append(k["name"])
    batch = "/".join(sorted({str(r[key].get("batch", PROFILE_BATCH)) for r in runs}))
    what = (f"Decode steps at batch {batch}" if phase == "decode" else
            f"Prefill steps of {batch} x {THROUGHPUT_PROMPT}-token prompts (one output token)")
    print()
    print(f"{what} on the GPU, us per step (kernel time; calls per step in brackets):")
    print()
    print("| kernel | " + " | ".join(_label(r) for r in runs) + " |")
    print("| --- |" + " ---: |" * len(runs))
    for field, title in (("span_us_per_step", "step span (first to last GPU activity)"),
                         ("gpu_busy_us_per_step", "GPU busy")):
        print(f"| {title} | " + " | ".join(f"{r[key][field]:,.1f}" for r in runs) + " |")
    print("| steps profiled | " + " | ".join(str(r[key]["steps"]) for r in runs) + " |")
    if phase == "prefill":
        print("| batch wall time, profiler on (s) | " + " | ".join(str(r[key].get("batch_wall_s", "-")) for r in runs) + " |")
    for name in names:
        cells = []
        for r in runs:
            k = next((k for k in r[key]["kernels"] if k["name"] == name), None)
            cells.append("-" if k is None else f"{k['us_per_step']:,.1f} ({k['calls_per_step']:g})")
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    _compare_host(runs, key)


def _compare_host(runs: list[dict], key: str) -> None:
    """The host's side of the profiled steps (profiles that have it), us per step: the step
    interval, the annotated host scopes, and every CUDA API call taking at least 2% of some
    run's step interval (calls per step in brackets)."""
    runs = [r for r in runs if r[key].get("host")]
    if not runs:
        return
    hosts = [r[key]["host"] for r in runs]
    print()
    print("The host's side of the same steps, us per step (CUDA API calls: calls per step in brackets):")
    print()
    print("| host | " + " | ".join(_label(r) for r in runs) + " |")
    print("| --- |" + " ---: |" * len(runs))
    print("| step interval (one step scope's start to the next) | "
          + " | ".join("-" if h["step_interval_us"] is None else f"{h['step_interval_us']:,.1f}" for h in hosts) + " |")
    for phase in sorted({p for h in hosts for p in h["phases_us_per_step"]}):
        print(f"| scope `{phase}` | "
              + " | ".join(f"{h['phases_us_per_step'][phase]:,.1f}" if phase in h["phases_us_per_step"] else "-"
                           for h in hosts) + " |")
    names: list[str] = []
    for h in hosts:
        floor = 0.02 * (h["step_interval_us"] or 0.0)
        names += [c["name"] for c in h["cuda_calls"] if c["us_per_step"] >= floor and c["name"] not in names]
    for name in names:
        cells = []
        for h in hosts:
            c = next((c for c in h["cuda_calls"] if c["name"] == name), None)
            cells.append("-" if c is None else f"{c['us_per_step']:,.1f} ({c['calls_per_step']:g})")
        print(f"| `{name}` | " + " | ".join(cells) + " |")


def _label(r: dict) -> str:
    backend = "vLLM's own choice" if r["backend"] == "auto" else r["backend"]
    return (f"{backend} + {'DeepGEMM' if r['indexer'] == 'deepgemm' else 'DeepGEMM-free (' + r['topk'] + ' top-k)'}"
            f" indexer, {r['kv_cache_dtype']}, {r['weights']}, TP{r['tp']}, {r['heads']} heads"
            + (f", {r['layers']} layers" if r.get("layers", 2) != 2 else "")
            + (f", prefill chunks of {r['chunk']} tokens" if r.get("chunk") else "")
            + (f", {r['fp8_kernel'].capitalize()} fp8 kernel forced" if r.get("fp8_kernel", "auto") != "auto" else "")
            + (", prefill workspace off" if r.get("prefill_workspace", "auto") == "off" else "")
            + (", no DeepGEMM (VLLM_USE_DEEP_GEMM=0)" if not r.get("deep_gemm", True) else "")
            + (", compiled + CUDA graphs" if r.get("graphs") else ", eager"))


def _pair(ref: dict, run: dict) -> dict:
    """Token-by-token agreement of `run` with `ref` (same model, prompts and KV dtype)."""
    rows = []
    for a, b in zip(ref["requests"], run["requests"]):
        pa = [x for x in a["prompt_logprobs"] if x is not None]
        pb = [x for x in b["prompt_logprobs"] if x is not None]
        diffs = [abs(x - y) for x, y in zip(pa, pb)]
        first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        row = {"prompt_len": a["prompt_len"], "equal": sum(x == y for x, y in zip(a["tokens"], b["tokens"])),
               "of": len(a["tokens"]), "first_divergence": first,
               "prompt_lp_max_diff": max(diffs), "prompt_lp_mean_diff": sum(diffs) / len(diffs),
               "gen_lp_max_diff": max(abs(x["logprob"] - y["logprob"]) for x, y in
                                      zip(a["steps"][:first], b["steps"][:first])) if first != 0 else None}
        if first is not None:  # how close the reference's top-2 were where the runs parted
            top = a["steps"][first]["top2"]
            row["ref_top2_margin_at_divergence"] = top[0][1] - top[1][1] if len(top) > 1 else None
            row["run_token_in_ref_top2"] = b["tokens"][first] in [t for t, _ in top]
        rows.append(row)
    return rows


def _pairs(runs: list[dict]):
    """(reference, run) for every run and each reference of its configuration.

    References: vLLM's own path at the default prefill chunking; a reference run with other
    chunking (--chunk) is compared with it too: the size of differences vLLM has with itself.
    A run with the prefill workspace off is the reference of the same configuration with it on.
    """
    refs = [r for r in runs if r["backend"] in ("FLASHMLA_SPARSE", "auto") and r["indexer"] == "deepgemm"
            and not r.get("chunk")] + [r for r in runs if r.get("prefill_workspace") == "off"]
    for run in runs:
        for ref in refs:
            same = all(run.get(k, d) == ref.get(k, d) for k, d in (("kv_cache_dtype", None), ("weights", None),
                                                                    ("tp", None), ("heads", None),
                                                                    ("graphs", None), ("layers", 2)))
            if ref.get("prefill_workspace") == "off":  # only against the same backend and indexer with it on
                same = same and run.get("prefill_workspace", "auto") == "auto" and all(
                    run[k] == ref[k] for k in ("backend", "indexer"))
            if run is ref or not same:
                continue
            yield ref, run


def compare(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    print("| configuration | engine start s | batch | prefill tok/s | decode tok/s | output tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        for t in r["throughput"]:
            print(f"| {_label(r)} | {r['engine_start_s']} | {t['batch']} | {t['prefill_tok_s']} | "
                  f"{t['decode_tok_s']} | {t['output_tok_s']} |")
    print()
    print("| reference | compared | prompt len | greedy tokens equal | first divergence | "
          "ref top-2 margin there | prompt logprob max / mean abs diff | generated logprob max abs diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ref, run in _pairs(runs):
        for row in _pair(ref, run):
            margin = row.get("ref_top2_margin_at_divergence")
            gen = row["gen_lp_max_diff"]
            print(f"| {_label(ref)} | {_label(run)} | {row['prompt_len']} | {row['equal']}/{row['of']} | "
                  f"{'-' if row['first_divergence'] is None else row['first_divergence']} | "
                  f"{'-' if margin is None else f'{margin:.4f}'} | "
                  f"{row['prompt_lp_max_diff']:.4f} / {row['prompt_lp_mean_diff']:.5f} | "
                  f"{'-' if gen is None else f'{gen:.4f}'} |")
    compare_profiles(runs, "decode")
    compare_profiles(runs, "prefill")


def tokens(out: str, paths: list[str]) -> dict:
    """Each run's greedy tokens beside its reference's (the pairs `compare` tabulates), written to
    `out` as JSON: per pair and prompt both token lists, how many are equal at equal positions
    and the first position where they differ (null: none)."""
    runs = {p: json.load(open(p)) for p in paths}
    names = {id(r): os.path.splitext(os.path.basename(p))[0] for p, r in runs.items()}
    pairs = []
    for ref, run in _pairs(list(runs.values())):
        prompts = [{"prompt_len": row["prompt_len"], "reference_tokens": a["tokens"], "tokens": b["tokens"],
                    "equal": row["equal"], "of": row["of"], "first_divergence": row["first_divergence"],
                    "ref_top2_margin_at_divergence": row.get("ref_top2_margin_at_divergence")}
                   for row, a, b in zip(_pair(ref, run), ref["requests"], run["requests"])]
        pairs.append({"reference": names[id(ref)], "run": names[id(run)], "reference_label": _label(ref),
                      "label": _label(run), "kv_cache_dtype": run["kv_cache_dtype"], "weights": run["weights"],
                      "equal": sum(p["equal"] for p in prompts), "of": sum(p["of"] for p in prompts),
                      "prompts": prompts})
    summary = {"pairs": pairs, "runs": sorted(names.values())}
    with open(out, "w") as handle:
        json.dump(summary, handle, indent=1)
    for pair in pairs:
        firsts = [p["first_divergence"] for p in pair["prompts"]]
        print(f"{pair['run']} vs {pair['reference']}: {pair['equal']}/{pair['of']} greedy tokens equal; "
              f"first divergence per prompt ({', '.join(str(p['prompt_len']) for p in pair['prompts'])} tokens): "
              f"{', '.join('-' if f is None else str(f) for f in firsts)}")
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        compare(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "tokens":
        if len(sys.argv) < 4:
            raise SystemExit("usage: engine_e2e.py tokens OUT.json RUN.json...")
        tokens(sys.argv[2], sys.argv[3:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "profile":
        if len(sys.argv) != 4:
            raise SystemExit("usage: engine_e2e.py profile RUN.json TRACE_DIR")
        attach_profile(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["run"])
    parser.add_argument("out")
    parser.add_argument("--model", required=True, help="the tiny GLM-5 folder (config, tokenizer, weights)")
    parser.add_argument("--backend", required=True, choices=["TRITON_MLA_SPARSE", "FLASHMLA_SPARSE", "auto"],
                        help="auto: no attention backend named, vLLM's own choice for the GPU (its log names it)")
    parser.add_argument("--kv", default="auto", choices=["auto", "fp8_ds_mla", "fp8"],
                        help="fp8: the operator's usual flag, which the MLA layer turns into fp8_ds_mla")
    parser.add_argument("--indexer", default="deepgemm", choices=["deepgemm", "fallback"])
    parser.add_argument("--topk", default="triton", choices=["triton", "vllm", "torch"])
    parser.add_argument("--gguf", action="store_true", help="load the GGUF shards instead of safetensors")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--graphs", action="store_true", help="vLLM's default compilation and CUDA graphs "
                        "instead of eager mode")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per batch and length (the fastest counts)")
    parser.add_argument("--correctness-only", action="store_true",
                        help="the greedy tokens and log-probabilities only, no throughput runs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be passed to vLLM (arguments, environment, model) and stop")
    parser.add_argument("--chunk", type=int, help="max_num_batched_tokens (prefill chunking; default vLLM's)")
    parser.add_argument("--profile", metavar="DIR", help="after the measurements, profile decode steps at batch "
                        f"--profile-batch with vLLM's torch profiler, traces in DIR")
    parser.add_argument("--profile-batch", type=int, default=PROFILE_BATCH,
                        help=f"requests in the profiled batch (default {PROFILE_BATCH})")
    parser.add_argument("--profile-phase", choices=["decode", "prefill"], default="decode",
                        help="what --profile records: decode steps (default) or the batch's prefill steps")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
