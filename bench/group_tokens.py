"""Greedy tokens of a served model for a fixed set of prompts, and their comparison (bench/gpu_group.sh).

    python bench/group_tokens.py tokens BASE_URL MODEL OUT.json    # BASE_URL e.g. http://127.0.0.1:8100
    python bench/group_tokens.py compare REF.json OTHER.json...    # a table; exit 1 where any differs

`tokens` sends each prompt to /v1/completions (temperature 0, exactly TOKENS tokens, ignore_eos)
one at a time and keeps the generated token ids (vLLM's `return_token_ids`; the returned token
strings where a server gives no ids). The prompts are fixed words of several lengths, from a few
tokens to past the tiny GLM-5's indexer top-k, so that the long ones go through sparse attention
with a real selection.
"""

from __future__ import annotations

import json
import os
import random
import sys
import urllib.request

TOKENS = 32
WORDS = ("fleet host group rank worker head tensor pipeline kernel cache token shard rollout "
         "canary batch drain door serve stream health engine model weight scale block").split()


def prompts() -> list[str]:
    """The fixed prompts; GROUP_TOKENS_WORDS ("60 700 2500" by default) sets the long ones' word counts
    (the script's CPU check serves a model of 2048 positions)."""
    rng = random.Random(44)
    counts = [int(n) for n in os.environ.get("GROUP_TOKENS_WORDS", "60 700 2500").split()]
    return ["The capital of France is"] + [" ".join(rng.choice(WORDS) for _ in range(n)) for n in counts]


def complete(base_url: str, model: str, prompt: str) -> list:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0}
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        choice = json.load(resp)["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids else list((choice.get("logprobs") or {}).get("tokens") or [])


def compare(ref: dict, other: dict) -> list[str]:
    """One line per prompt: equal, or the first step where the tokens part."""
    lines = []
    for i, (a, b) in enumerate(zip(ref["tokens"], other["tokens"], strict=True)):
        same = sum(1 for x, y in zip(a, b) if x == y)
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        verdict = "equal" if a == b else f"first differs at step {first if first is not None else min(len(a), len(b))}"
        lines.append(f"| {other['name']} | {ref['name']} | {i} ({ref['prompt_words'][i]} words) | {same}/{len(a)} | {verdict} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "tokens":
        base_url, model, out = argv[1:]
        texts = prompts()
        seen = {"name": out.rsplit("/", 1)[-1].removesuffix(".json"), "base_url": base_url,
                "prompt_words": [len(t.split()) for t in texts], "tokens": [complete(base_url, model, t) for t in texts]}
        with open(out, "w") as f:
            json.dump(seen, f)
        print(f"{out}: {[len(t) for t in seen['tokens']]} tokens for {len(texts)} prompts")
        return 0 if all(len(t) == TOKENS for t in seen["tokens"]) else 1
    if len(argv) >= 3 and argv[0] == "compare":
        runs = []
        for path in argv[1:]:
            with open(path) as f:
                runs.append(json.load(f))
        lines = [line for other in runs[1:] for line in compare(runs[0], other)]
        print("| run | reference | prompt | greedy tokens equal | verdict |\n| --- | --- | --- | ---: | --- |")
        print("\n".join(lines))
        return 0 if all(line.endswith("| equal |") for line in lines) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
