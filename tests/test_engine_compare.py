"""bench/engine_e2e.py's comparison of engine runs (what docs/e2e-h200.md's tables come from)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "engine_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("engine_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(backend="FLASHMLA_SPARSE", indexer="deepgemm", kv="auto", chunk=None):
    requests = []
    for n, base in ((3000, 100), (40, 900)):
        tokens = [base + i for i in range(8)]
        steps = [{"token": t, "logprob": -5.0 - i / 100, "top2": [[t, -5.0 - i / 100], [t + 1, -5.25 - i / 100]]}
                 for i, t in enumerate(tokens)]
        requests.append({"prompt_len": n, "tokens": tokens, "steps": steps,
                         "prompt_logprobs": [None] + [-6.0 - (i % 7) / 10 for i in range(n - 1)]})
    return {"backend": backend, "indexer": indexer, "topk": "triton", "kv_cache_dtype": kv, "weights": "safetensors",
            "tp": 1, "heads": 64, "chunk": chunk, "graphs": False, "engine_start_s": 10.0, "requests": requests,
            "throughput": [{"batch": 1, "prefill_s": 0.01, "total_s": 0.5, "prefill_tok_s": 300000,
                            "decode_tok_s": 130.0, "output_tok_s": 128.0}]}


def _written(tmp_path, runs: dict) -> list[str]:
    """Each run as NAME.json, the way bench/engine_gpu.sh leaves them for `compare`."""
    paths = []
    for name, run in runs.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    return [str(p) for p in paths]


def test_identical_runs_agree_everywhere(e2e):
    ref = _run()
    rows = e2e._pair(ref, copy.deepcopy(ref))
    assert [(r["equal"], r["of"], r["first_divergence"]) for r in rows] == [(8, 8, None), (8, 8, None)]
    assert all(r["prompt_lp_max_diff"] == 0 and r["gen_lp_max_diff"] == 0 for r in rows)


def test_divergence_is_located_and_explained_by_the_reference_margin(e2e):
    ref, run = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    req = run["requests"][0]
    req["tokens"][5] = ref["requests"][0]["steps"][5]["top2"][1][0]  # the reference's runner-up
    req["steps"][2]["logprob"] += 0.03
    req["prompt_logprobs"][10] += 0.2
    row = e2e._pair(ref, run)[0]
    assert (row["equal"], row["first_divergence"]) == (7, 5)
    assert row["ref_top2_margin_at_divergence"] == pytest.approx(0.25)
    assert row["run_token_in_ref_top2"] is True
    assert row["gen_lp_max_diff"] == pytest.approx(0.03)
    assert row["prompt_lp_max_diff"] == pytest.approx(0.2)
    assert row["prompt_lp_mean_diff"] == pytest.approx(0.2 / 2999)
    req["tokens"][5] = 4242  # not among the reference's two best
    assert e2e._pair(ref, run)[0]["run_token_in_ref_top2"] is False


def test_compare_pairs_runs_with_their_own_reference_only(e2e, tmp_path, capsys):
    runs = {"ref": _run(), "ref-fp8": _run(kv="fp8_ds_mla"), "ours": _run("TRITON_MLA_SPARSE", "fallback"),
            "ours-fp8": _run("TRITON_MLA_SPARSE", "fallback", kv="fp8_ds_mla"), "chunked": _run(chunk=2048)}
    runs["ours-fp8"]["requests"][1]["tokens"][0] = 1
    e2e.compare(_written(tmp_path, runs))
    out = capsys.readouterr().out
    pairs = [line for line in out.splitlines() if line.startswith("| FLASHMLA_SPARSE + DeepGEMM indexer") and "| 3000 |" in line]
    # ours against ref, ours-fp8 against ref-fp8, the chunked reference against ref: never across KV dtypes
    assert len(pairs) == 3
    assert all(("fp8_ds_mla" in p.split("|")[1]) == ("fp8_ds_mla" in p.split("|")[2]) for p in pairs)
    assert "prefill chunks of 2048 tokens" in out
    assert "| 40 | 7/8 | 0 | 0.2500 |" in out  # ours-fp8's first token on the short prompt
    assert out.count("| 300000 |") == 5  # one throughput row per run


def test_prefill_workspace_off_is_the_reference_of_on(e2e, tmp_path, capsys):
    off = dict(_run("TRITON_MLA_SPARSE", "fallback", kv="fp8_ds_mla"), prefill_workspace="off")
    on = dict(_run("TRITON_MLA_SPARSE", "fallback", kv="fp8_ds_mla"), prefill_workspace="auto")
    on["requests"][0]["tokens"][3] = 7
    other = _run("TRITON_MLA_SPARSE", "fallback", kv="fp8_ds_mla")  # no switch recorded: an older run
    other["heads"] = 8
    e2e.compare(_written(tmp_path, {"off": off, "on": on, "other": other}))
    out = capsys.readouterr().out
    pairs = [line for line in out.splitlines()  # the comparison table's rows (8 columns) with the "off" reference
             if line.count("|") == 9 and "prefill workspace off" in line.split("|")[1]]
    assert len(pairs) == 2  # on against off, both prompts; not off against itself, nor the 8-head run
    assert all("prefill workspace off" not in p.split("|")[2] for p in pairs)
    assert "| 3000 | 7/8 | 3 |" in out


def test_compare_pairs_runs_of_one_model_depth_only(e2e, tmp_path, capsys):
    # heads8-deep: the same 8 heads over 16 layers and over the usual 2 (older runs name no depth:
    # 2); a 16-layer run is compared with the 16-layer reference only, and its label says so
    deep_ref, deep = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    deep_ref["layers"] = deep["layers"] = 16
    runs = {"ref": _run(), "ours": _run("TRITON_MLA_SPARSE", "fallback"), "ref16": deep_ref, "ours16": deep}
    e2e.compare(_written(tmp_path, runs))
    pairs = [line.split("|") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| FLASHMLA_SPARSE + DeepGEMM indexer") and "| 3000 |" in line]
    assert len(pairs) == 2
    assert sorted(("16 layers" in p[1], "16 layers" in p[2]) for p in pairs) == [(False, False), (True, True)]


def test_vllms_own_backend_choice_is_a_reference_too(e2e, tmp_path, capsys):
    # 0.32.0 on SM90: the reference names no backend (--backend auto), vLLM picks its own
    runs = {"auto": _run("auto"), "ours": _run("TRITON_MLA_SPARSE", "fallback"),
            "mixed": _run("auto", "fallback")}
    runs["ours"]["requests"][0]["tokens"][3] = 7
    e2e.compare(_written(tmp_path, runs))
    out = capsys.readouterr().out
    pairs = [line for line in out.splitlines() if line.startswith("| vLLM's own choice + DeepGEMM indexer")
             and "/8 |" in line]
    # ours and the mixed run (vLLM's attention, our indexer) against it; never itself
    assert len(pairs) == 4 and sum("TRITON_MLA_SPARSE + DeepGEMM-free" in p for p in pairs) == 2
    assert "| 3000 | 7/8 | 3 |" in out


def _trace(tmp_path, steps: int, kernels: dict[str, float], gap_us: float = 5.0,
           scope: str = "gpu_model_runner: forward", host: dict[str, float] | None = None,
           calls: dict[str, float] | None = None):
    """A torch profiler trace (Chrome trace JSON, gzip) of `steps` engine steps: vLLM's step
    scope on the host and, on the GPU, each kernel once a step taking the given microseconds;
    `host`: host scopes (gpu_model_runner: NAME) and `calls`: CUDA API calls, once a step each."""
    import gzip

    events, ts = [{"ph": "M", "name": "process_name", "args": {"name": "python"}}], 1000.0
    for _ in range(steps):
        events.append({"ph": "X", "cat": "user_annotation", "name": scope, "ts": ts, "dur": 50.0})
        events.append({"ph": "X", "cat": "user_annotation", "name": "schedule: allocate_slots", "ts": ts, "dur": 1.0})
        for name, dur in (host or {}).items():
            events.append({"ph": "X", "cat": "user_annotation", "name": f"gpu_model_runner: {name}", "ts": ts, "dur": dur})
        for name, dur in (calls or {}).items():
            events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur})
        for name, dur in kernels.items():
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur})
            ts += dur
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 999.0})  # not GPU time
        events.append({"ph": "f", "cat": "ac2g", "name": "flow", "ts": ts})
        ts += gap_us
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    return str(path)


def test_profile_summary_gives_gpu_time_per_step_by_kernel(e2e, tmp_path):
    path = _trace(tmp_path, 4, {"void flash_fwd_kernel<cutlass::bfloat16_t, 64>(Params)": 30.0,
                                "_sparse_mla_decode": 12.0, "Memcpy DtoD (Device -> Device)": 1.0})
    p = e2e.profile_summary(path)
    assert p["steps"] == 4
    assert p["gpu_busy_us_per_step"] == 43.0
    # 4 steps of 43 us of kernels and 5 us gaps, less the last gap
    assert p["span_us_per_step"] == round((4 * 48 - 5) / 4, 1)
    assert [(k["name"], k["us_per_step"], k["calls_per_step"]) for k in p["kernels"]] == [
        ("flash_fwd_kernel", 30.0, 1), ("_sparse_mla_decode", 12.0, 1), ("Memcpy DtoD", 1.0, 1)]


def test_profile_summary_gives_the_host_side_of_a_step(e2e, tmp_path):
    scope = "execute_context_0(0)_generation_1(1)"
    path = _trace(tmp_path, 4, {"k": 10.0}, gap_us=90.0, scope=scope,
                  host={"preprocess": 120.0, "sample": 30.0},
                  calls={"cudaGraphLaunch": 8.0, "cudaStreamSynchronize": 400.0})
    h = e2e.profile_summary(path)["host"]
    # each step: 10 us of kernel and a 90 us gap, so one step scope starts 100 us after the last
    assert h["step_interval_us"] == 100.0
    assert h["phases_us_per_step"] == {"execute_context_* (the step)": 50.0, "schedule: allocate_slots": 1.0,
                                       "gpu_model_runner: preprocess": 120.0, "gpu_model_runner: sample": 30.0}
    assert [(c["name"], c["us_per_step"], c["calls_per_step"]) for c in h["cuda_calls"]] == [
        ("cudaStreamSynchronize", 400.0, 1), ("cudaGraphLaunch", 8.0, 1)]


def test_compare_prints_the_host_side_beside_the_kernels(e2e, tmp_path, capsys):
    ref, ours = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    ref["decode_profile"] = dict(e2e.profile_summary(_trace(
        tmp_path, 2, {"flash_mla_kernel": 20.0}, gap_us=980.0, host={"preprocess": 100.0},
        calls={"cudaGraphLaunch": 30.0, "cudaMemcpyAsync": 1.0})), batch=1)
    ours["decode_profile"] = dict(e2e.profile_summary(_trace(
        tmp_path, 2, {"_sparse_mla_decode": 10.0}, gap_us=1490.0, host={"preprocess": 600.0, "bookkeep": 5.0},
        calls={"cudaGraphLaunch": 30.0, "cudaStreamSynchronize": 450.0})), batch=1)
    e2e.compare(_written(tmp_path, {"ref": ref, "ours": ours}))
    out = capsys.readouterr().out
    assert "Decode steps at batch 1 " in out
    assert "| step interval (one step scope's start to the next) | 1,000.0 | 1,500.0 |" in out
    assert "| scope `gpu_model_runner: preprocess` | 100.0 | 600.0 |" in out
    assert "| scope `gpu_model_runner: bookkeep` | - | 5.0 |" in out
    assert "| `cudaStreamSynchronize` | - | 450.0 (1) |" in out
    assert "| `cudaGraphLaunch` | 30.0 (1) | 30.0 (1) |" in out
    assert "`cudaMemcpyAsync`" not in out  # under 2% of every run's step interval


def test_profile_summary_refuses_a_trace_without_steps_or_gpu_work(e2e, tmp_path):
    cpu_only = _trace(tmp_path, 3, {})
    with pytest.raises(ValueError, match="3 step scopes .* and 0 GPU activities"):
        e2e.profile_summary(cpu_only)


def test_compare_prints_the_profiles_side_by_side(e2e, tmp_path, capsys):
    ref, ours = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    ref["decode_profile"] = e2e.profile_summary(_trace(tmp_path, 2, {"flash_mla_kernel": 20.0, "tiny": 0.1}))
    ours["decode_profile"] = e2e.profile_summary(_trace(tmp_path, 2, {"_sparse_mla_decode": 30.0, "tiny": 0.1}))
    e2e.compare(_written(tmp_path, {"ref": ref, "ours": ours}))
    out = capsys.readouterr().out
    assert "| GPU busy | 20.1 | 30.1 |" in out
    assert "| `flash_mla_kernel` | 20.0 (1) | - |" in out
    assert "| `_sparse_mla_decode` | - | 30.0 (1) |" in out
    assert "`tiny`" not in out  # under 2% of every run's GPU time


def test_profile_summary_counts_the_step_scopes_of_vllm_0_32_cuda_worker(e2e, tmp_path):
    path = _trace(tmp_path, 5, {"k": 2.0}, scope="execute_context_0(0)_generation_32(32)")
    p = e2e.profile_summary(path)
    assert (p["steps"], p["step_scopes"], p["gpu_busy_us_per_step"]) == (5, ["execute_context_0(0)_generation_32(32)"], 2.0)


def test_compare_prints_prefill_profiles_apart_from_decode(e2e, tmp_path, capsys):
    ref, ours = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    scope = "execute_context_32(96000)_generation_0(0)"
    ref["prefill_profile"] = dict(e2e.profile_summary(_trace(tmp_path, 3, {"deep_gemm_fp8_mqa": 90.0}, scope=scope)),
                                  batch_wall_s=0.15)
    ours["prefill_profile"] = dict(e2e.profile_summary(_trace(tmp_path, 3, {"_mqa_logits_kernel": 300.0}, scope=scope)),
                                   batch_wall_s=0.2)
    e2e.compare(_written(tmp_path, {"ref": ref, "ours": ours}))
    out = capsys.readouterr().out
    assert "Prefill steps of 32 x 3000-token prompts" in out and "Decode steps" not in out
    assert "| batch wall time, profiler on (s) | 0.15 | 0.2 |" in out
    assert "| `_mqa_logits_kernel` | - | 300.0 (1) |" in out


def test_profiler_config_by_phase(e2e, tmp_path):
    decode = e2e._profiler_config(str(tmp_path))
    prefill = e2e._profiler_config(str(tmp_path), "prefill")
    assert (decode["delay_iterations"], decode["max_iterations"]) == (e2e.PROFILE_DELAY, e2e.PROFILE_STEPS)
    assert (prefill["delay_iterations"], prefill["max_iterations"]) == (0, e2e.PREFILL_PROFILE_STEPS)
    assert prefill["torch_profiler_dir"] == str(tmp_path)


def test_weights_kind_names_a_block_fp8_snapshot(e2e):
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert e2e.weights_kind(fp8, False) == "fp8-block safetensors"
    assert e2e.weights_kind({}, False) == "safetensors"
    assert e2e.weights_kind({"quantization_config": {"quant_method": "fp8"}}, False) == "safetensors"
    assert e2e.weights_kind(fp8, True) == "gguf"


def test_tokens_writes_both_runs_tokens_and_where_they_part(e2e, tmp_path):
    """The fp8-block phase's JSON: ours against vLLM's own path per KV dtype, never across weights."""
    ref, ours = _run(), _run("TRITON_MLA_SPARSE", "fallback")
    ref_fp8, ours_fp8 = _run(kv="fp8_ds_mla"), _run("TRITON_MLA_SPARSE", "fallback", kv="fp8_ds_mla")
    for run in (ref, ours, ref_fp8, ours_fp8):
        run["weights"] = "fp8-block safetensors"
    ours_fp8["requests"][0]["tokens"][5] = 1
    nodg = dict(copy.deepcopy(ours), deep_gemm=False)
    bf16 = _run("TRITON_MLA_SPARSE", "fallback")  # the bf16 checkpoint's run: no fp8-block reference
    paths = _written(tmp_path, {"fp8-ref-auto": ref, "fp8-ours-auto": ours, "fp8-ref-fp8_ds_mla": ref_fp8,
                                "fp8-ours-fp8_ds_mla": ours_fp8, "fp8-oursnodg-auto": nodg, "bf16-ours": bf16})
    out = tmp_path / "tokens.json"
    summary = e2e.tokens(str(out), paths)
    assert json.loads(out.read_text()) == summary
    pairs = {(p["run"], p["reference"]): p for p in summary["pairs"]}
    assert sorted(pairs) == [("fp8-ours-auto", "fp8-ref-auto"), ("fp8-ours-fp8_ds_mla", "fp8-ref-fp8_ds_mla"),
                             ("fp8-oursnodg-auto", "fp8-ref-auto")]
    same = pairs[("fp8-ours-auto", "fp8-ref-auto")]
    assert (same["equal"], same["of"]) == (16, 16) and same["weights"] == "fp8-block safetensors"
    assert [p["first_divergence"] for p in same["prompts"]] == [None, None]
    parted = pairs[("fp8-ours-fp8_ds_mla", "fp8-ref-fp8_ds_mla")]
    assert (parted["equal"], parted["prompts"][0]["first_divergence"]) == (15, 5)
    assert parted["prompts"][0]["tokens"][5] == 1 and parted["prompts"][0]["reference_tokens"][5] == 105
    assert parted["prompts"][0]["prompt_len"] == 3000
    assert "no DeepGEMM (VLLM_USE_DEEP_GEMM=0)" in pairs[("fp8-oursnodg-auto", "fp8-ref-auto")]["label"]
    assert "fp8-block safetensors" in parted["label"] and "fp8_ds_mla" in parted["reference_label"]


def test_a_dry_run_parses_the_arguments_and_reads_the_model_without_vllm(tmp_path):
    import subprocess
    import sys

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 2048, "index_topk": 2048, "num_attention_heads": 64,
                                                   "quantization_config": {"quant_method": "fp8",
                                                                           "weight_block_size": [128, 128]}}))
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "r.json"), "--model", str(model),
                           "--backend", "TRITON_MLA_SPARSE", "--indexer", "fallback", "--kv", "fp8_ds_mla",
                           "--correctness-only", "--dry-run"], capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin"})  # no PYTHONPATH: neither vLLM nor the repository needed
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["weights"] == "fp8-block safetensors" and plan["throughput"] is False
    assert plan["env"] == {"MLAFLEET_INDEXER_FALLBACK": "1", "MLAFLEET_INDEXER_TOPK": "triton"}
    assert plan["llm"]["attention_config"] == {"backend": "TRITON_MLA_SPARSE"}
    assert plan["llm"]["kv_cache_dtype"] == "fp8_ds_mla" and plan["llm"]["model"] == str(model)
    assert max(plan["prompt_lengths"]) > plan["index_topk"]  # the indexer's selection drops tokens
    assert not (tmp_path / "r.json").exists()
    bad = subprocess.run([sys.executable, str(SCRIPT), "run", "x.json", "--model", str(model), "--backend", "NOPE",
                          "--dry-run"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "invalid choice: 'NOPE'" in bad.stderr


FAKE_VLLM = '''
import json, os
from types import SimpleNamespace as NS

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class LLM:
    def __init__(self, **kw):
        self.kw = kw
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"llm": {k: str(v) for k, v in kw.items()},
                                "fallback": os.environ.get("MLAFLEET_INDEXER_FALLBACK")}) + "\\n")

    def generate(self, prompts, params, use_tqdm=False):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"generate": len(prompts), "max_tokens": params.kw["max_tokens"]}) + "\\n")
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            tokens = [(ids[-1] + i) % 2048 for i in range(params.kw["max_tokens"])]
            lps = [{t: NS(logprob=-1.0, rank=1), t + 1: NS(logprob=-2.0, rank=2)} for t in tokens]
            outs.append(NS(prompt_token_ids=ids, prompt_logprobs=[None] + [{i: NS(logprob=-3.0)} for i in ids[1:]],
                           outputs=[NS(token_ids=tokens, logprobs=lps)]))
        return outs
'''


def test_a_correctness_only_run_records_the_tokens_and_no_timings(tmp_path):
    """engine_e2e.py run --correctness-only against a stand-in `vllm` module (LLM, SamplingParams,
    TokensPrompt): one generate call of the 4 prompts, the run's JSON as fp8-block's `tokens` reads it."""
    import subprocess
    import sys

    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                    "    return {'prompt_token_ids': prompt_token_ids}\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "vocab_size": 2048, "num_attention_heads": 64, "num_hidden_layers": 2,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    log, out = tmp_path / "vllm.log", tmp_path / "run.json"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fake.parent), "FAKE_VLLM_LOG": str(log),
           "VLLM_USE_DEEP_GEMM": "0"}
    done = subprocess.run([sys.executable, str(SCRIPT), "run", str(out), "--model", str(model), "--backend",
                           "TRITON_MLA_SPARSE", "--indexer", "fallback", "--correctness-only"],
                          capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["fallback"] == "1" and calls[0]["llm"]["attention_config"] == "{'backend': 'TRITON_MLA_SPARSE'}"
    assert calls[1:] == [{"generate": 4, "max_tokens": 32}]  # the greedy pass only: no timed batches
    run = json.loads(out.read_text())
    assert run["throughput"] == [] and run["weights"] == "fp8-block safetensors" and run["deep_gemm"] is False
    assert run["deep_gemm_warmup"] == "relax"  # vLLM's default, VLLM_DEEP_GEMM_WARMUP unset
    assert [r["prompt_len"] for r in run["requests"]] == [3000, 2100, 700, 40]
    assert all(len(r["tokens"]) == 32 and len(r["steps"]) == 32 for r in run["requests"])
