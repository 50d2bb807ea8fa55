"""Greedy tokens of a served model for a fixed set of prompts, and their comparison (bench/gpu_group.sh).

    python bench/group_tokens.py tokens BASE_URL MODEL OUT.json    # BASE_URL e.g. http://127.0.0.1:8100
    python bench/group_tokens.py compare REF.json OTHER.json...    # a table; exit 1 where any differs

`tokens` sends each prompt to /v1/completions (temperature 0, exactly TOKENS tokens, ignore_eos)
one at a time and keeps the generated token ids (vLLM's `return_token_ids`; the returned token
strings where a server gives no ids) with each step's two most likely tokens and their logprobs.
The prompts are fixed words of several lengths, from a few tokens to past the tiny GLM-5's indexer
top-k, so that the long ones go through sparse attention with a real selection.

`compare` passes a prompt whose tokens are equal, or whose first difference is a near tie: at that
step both runs rank the same two tokens within GROUP_TOKENS_TIE nats (0.05 by default) of each
other, each picking the other's token as its runner-up. A random-weight model has such ties, and
two starts of the same server broke one differently (docs/e2e-h200.md); the steps after a tie are
not compared (the two texts have parted).
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


def complete(base_url: str, model: str, prompt: str) -> tuple[list, list]:
    """The generated tokens, and per step the text of each step's top two tokens with their logprobs."""
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2}
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        choice = json.load(resp)["choices"][0]
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    steps = [{"text": text, "top": top or {}} for text, top in
             zip(logprobs.get("tokens") or [], logprobs.get("top_logprobs") or [], strict=False)]
    return (list(ids) if ids else list(logprobs.get("tokens") or [])), steps


def near_tie(ref: dict, other: dict, i: int, k: int) -> float | None:
    """The larger of the two runs' margins (nats) between the two tokens they chose at step k of
    prompt i, where each run has both among its top two; None where either lacks them."""
    try:
        r, o = ref["steps"][i][k], other["steps"][i][k]
        mine, theirs = r["text"], o["text"]
        return max(abs(r["top"][mine] - r["top"][theirs]), abs(o["top"][theirs] - o["top"][mine]))
    except (KeyError, IndexError, TypeError):
        return None


def compare(ref: dict, other: dict, tie: float = 0.05) -> list[str]:
    """One line per prompt: equal, a near tie at the first difference, or the step where the tokens part."""
    lines = []
    for i, (a, b) in enumerate(zip(ref["tokens"], other["tokens"], strict=True)):
        same = sum(1 for x, y in zip(a, b) if x == y)
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if a == b:
            verdict = "equal"
        elif first is None:
            verdict = f"first differs at step {min(len(a), len(b))}"
        elif (margin := near_tie(ref, other, i, first)) is not None and margin <= tie:
            verdict = f"near tie at step {first} ({margin:.4f} nats), equal before it"
        else:
            verdict = f"first differs at step {first}" + (f" ({margin:.4f} nats apart)" if margin is not None else "")
        lines.append(f"| {other['name']} | {ref['name']} | {i} ({ref['prompt_words'][i]} words) | {same}/{len(a)} | {verdict} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "tokens":
        base_url, model, out = argv[1:]
        texts = prompts()
        done = [complete(base_url, model, t) for t in texts]
        seen = {"name": out.rsplit("/", 1)[-1].removesuffix(".json"), "base_url": base_url,
                "prompt_words": [len(t.split()) for t in texts], "tokens": [d[0] for d in done],
                "steps": [d[1] for d in done]}
        with open(out, "w") as f:
            json.dump(seen, f)
        print(f"{out}: {[len(t) for t in seen['tokens']]} tokens for {len(texts)} prompts")
        return 0 if all(len(t) == TOKENS for t in seen["tokens"]) else 1
    if len(argv) >= 3 and argv[0] == "compare":
        runs = []
        for path in argv[1:]:
            with open(path) as f:
                runs.append(json.load(f))
        tie = float(os.environ.get("GROUP_TOKENS_TIE", "0.05"))
        lines = [line for other in runs[1:] for line in compare(runs[0], other, tie)]
        print("| run | reference | prompt | greedy tokens equal | verdict |\n| --- | --- | --- | ---: | --- |")
        print("\n".join(lines))
        return 0 if all(line.endswith(("| equal |", "equal before it |")) for line in lines) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
