"""Run a patched vLLM 0.20.2 engine on a GPU with one sparse-MLA backend and report what it computed.

    python bench/patchset_engine.py MODEL_DIR BACKEND KV_CACHE_DTYPE OUT.json

MODEL_DIR holds a GLM-5-architecture config.json (e.g. shared/notes/tiny-glm5); the weights are
vLLM's deterministic dummy weights (load_format="dummy"), so two runs with different attention
backends compute with the same model and their outputs can be compared token by token:
prompt log-probabilities over a 3000-token prefill (the prefill path) and 16 greedy tokens
with their log-probabilities (the decode path). No tokenizer: prompts are token ids.

Used on the H200 to compare TRITON_MLA_SPARSE (the mlafleet backend, allowed on SM90 when
named explicitly) with vLLM's own FLASHMLA_SPARSE, for bf16 and fp8_ds_mla KV caches.
"""

from __future__ import annotations

import json
import sys
import time


def main(model: str, backend: str, kv_cache_dtype: str, out_path: str) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    generator = torch.Generator().manual_seed(0)
    lengths = [3000, 40, 700]
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, 2048, (n,), generator=generator).tolist())
               for n in lengths]
    start = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", enforce_eager=True, max_model_len=4096,
              skip_tokenizer_init=True, seed=0, gpu_memory_utilization=0.5,
              kv_cache_dtype=kv_cache_dtype, attention_config={"backend": backend})
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    generated = time.perf_counter() - start
    result = {"backend": backend, "kv_cache_dtype": kv_cache_dtype, "engine_start_s": round(started, 1),
              "generate_s": round(generated, 2), "requests": []}
    for output in outputs:
        completion = output.outputs[0]
        prompt_lp = [next(iter(d.values())).logprob if d else None for d in output.prompt_logprobs]
        result["requests"].append({
            "prompt_len": len(output.prompt_token_ids),
            "tokens": list(completion.token_ids),
            "token_logprobs": [next(iter(d.values())).logprob for d in completion.logprobs],
            "prompt_logprobs": prompt_lp,
        })
    with open(out_path, "w") as handle:
        json.dump(result, handle)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}))


def compare(paths: list[str]) -> None:
    """Compare runs pairwise with the first of each kv-cache dtype (its reference)."""
    runs = [json.load(open(p)) for p in paths]
    for run in runs:
        ref = next(r for r in runs if r["kv_cache_dtype"] == run["kv_cache_dtype"])
        if ref is run:
            continue
        for a, b in zip(ref["requests"], run["requests"]):
            pa = [x for x in a["prompt_logprobs"] if x is not None]
            pb = [x for x in b["prompt_logprobs"] if x is not None]
            diffs = [abs(x - y) for x, y in zip(pa, pb)]
            same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
            print(json.dumps({
                "kv": run["kv_cache_dtype"], "ref": ref["backend"], "run": run["backend"],
                "prompt_len": a["prompt_len"], "prompt_logprob_max_abs_diff": round(max(diffs), 4),
                "prompt_logprob_mean_abs_diff": round(sum(diffs) / len(diffs), 5),
                "greedy_tokens_equal": f"{same}/{len(a['tokens'])}",
                "first_divergence": next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None),
            }))


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2:])
    else:
        main(*sys.argv[1:5])
