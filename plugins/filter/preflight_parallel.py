"""Filters `preflight_parallel_sizes` and `preflight_attention_heads`: what vLLM's arguments and the
model's config.json say about how many GPUs a server needs.

vLLM runs tensor parallel size x pipeline parallel size workers per host, one per GPU, and splits
each layer's attention heads over the tensor parallel workers (so that size must divide the head
count). Preflight compares both with the host before anything changes.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's spellings of the two options (the long form and its short alias).
OPTIONS = {"tensor": ("--tensor-parallel-size", "-tp"), "pipeline": ("--pipeline-parallel-size", "-pp")}


def parallel_sizes(args: Any) -> dict[str, Any]:
    """{tensor, pipeline, world, named, problems} from a server argument list ("--opt=N", "--opt N" or
    "--opt", "N"); named lists the sizes the arguments give (the others are vLLM's default, 1).

    The last occurrence wins, as with argparse. A value that is not a positive integer is a problem.
    """
    if isinstance(args, str):
        args = [args]
    words: list[str] = []
    for item in args or []:
        words.extend(str(item).split())
    sizes = {"tensor": 1, "pipeline": 1}
    named: list[str] = []
    problems = []
    index = 0
    while index < len(words):
        word = words[index]
        name, sep, value = word.partition("=")
        for key, spellings in OPTIONS.items():
            if name in spellings:
                if not sep:
                    value = words[index + 1] if index + 1 < len(words) else ""
                    index += 1
                if value.isdigit() and int(value) > 0:
                    sizes[key] = int(value)
                    named.append(key)
                else:
                    problems.append(f"vllm_server_args: {name} {value!r} is not a positive integer")
        index += 1
    return {**sizes, "world": sizes["tensor"] * sizes["pipeline"], "named": sorted(set(named)), "problems": problems}


def attention_heads(config: Any) -> int | None:
    """num_attention_heads of a Hugging Face config.json (text or dict; nested text_config too), or None."""
    if isinstance(config, (str, bytes)):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if not isinstance(config, dict):
        return None
    for candidate in (config, config.get("text_config"), config.get("llm_config")):
        if isinstance(candidate, dict):
            heads = candidate.get("num_attention_heads", candidate.get("n_head"))
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                return heads
    return None


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"preflight_parallel_sizes": parallel_sizes, "preflight_attention_heads": attention_heads}
