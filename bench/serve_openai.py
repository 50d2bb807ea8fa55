"""A vLLM server over HTTP, answered through the OpenAI Python client (the docs/e2e-h200.md serve check).

    python bench/serve_openai.py BASE_URL MODEL OUT.json     # BASE_URL e.g. http://127.0.0.1:8765/v1

1. a completion: greedy, exactly 16 tokens (ignore_eos), finish reason "length";
2. a streamed chat: 16 tokens through the model's chat template, the text arriving in several
   chunks, the last one with finish reason "length";
3. 16 completions at once (one thread each, 32 tokens each): every one answered in full.

Writes what it saw to OUT.json and prints it; exits 1 naming every check that failed.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

TOKENS = 16
CONCURRENT = 16
CONCURRENT_TOKENS = 32


def check(base_url: str, model: str) -> tuple[dict, list[str]]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    seen: dict = {}
    problems: list[str] = []

    t0 = time.perf_counter()
    comp = client.completions.create(model=model, prompt="The fleet rolls out", max_tokens=TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    seen["completion"] = {"text": comp.choices[0].text, "tokens": comp.usage.completion_tokens,
                          "finish_reason": comp.choices[0].finish_reason,
                          "latency_ms": round((time.perf_counter() - t0) * 1000, 1)}
    if comp.usage.completion_tokens != TOKENS or comp.choices[0].finish_reason != "length":
        problems.append(f"completion: {comp.usage.completion_tokens} tokens, finish reason "
                        f"{comp.choices[0].finish_reason!r} (expected {TOKENS}, 'length')")

    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks, parts, finish, usage, first_ms = 0, [], None, None, None
    for event in stream:
        if event.usage is not None:
            usage = event.usage.completion_tokens
        for choice in event.choices:
            if choice.delta.content:
                chunks += 1
                parts.append(choice.delta.content)
                first_ms = first_ms or round((time.perf_counter() - t0) * 1000, 1)
            finish = choice.finish_reason or finish
    seen["chat_stream"] = {"text": "".join(parts), "content_chunks": chunks, "tokens": usage, "finish_reason": finish,
                           "first_chunk_ms": first_ms, "latency_ms": round((time.perf_counter() - t0) * 1000, 1)}
    if usage != TOKENS or finish != "length" or chunks < 2:
        problems.append(f"streamed chat: {usage} tokens in {chunks} content chunks, finish reason {finish!r} "
                        f"(expected {TOKENS} tokens in at least 2 chunks, 'length')")

    def one(i: int) -> dict:
        s = time.perf_counter()
        r = client.completions.create(model=model, prompt=f"Request {i} of the batch:", max_tokens=CONCURRENT_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        return {"tokens": r.usage.completion_tokens, "finish_reason": r.choices[0].finish_reason,
                "latency_ms": round((time.perf_counter() - s) * 1000, 1)}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(one, range(CONCURRENT)))
    wall = time.perf_counter() - t0
    short = [i for i, a in enumerate(answers) if a["tokens"] != CONCURRENT_TOKENS or a["finish_reason"] != "length"]
    seen["concurrent"] = {"requests": CONCURRENT, "answered_in_full": CONCURRENT - len(short), "wall_s": round(wall, 3),
                          "output_tok_s": round(sum(a["tokens"] for a in answers) / wall, 1),
                          "latency_ms_max": max(a["latency_ms"] for a in answers)}
    if short:
        problems.append(f"concurrent: requests {short} not answered with {CONCURRENT_TOKENS} tokens")
    return seen, problems


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    base_url, model, out = sys.argv[1:]
    seen, problems = check(base_url, model)
    seen["problems"] = problems
    with open(out, "w") as handle:
        json.dump(seen, handle, indent=1)
    print(json.dumps(seen))
    for problem in problems:
        print(f"serve_openai: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
