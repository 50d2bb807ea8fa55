"""`mlafleet loadgen`: an open-loop load of streamed completions with long outputs against a URL (the
front door, or one server), counting what clients would see through a rollout (docs/front-door.md).

Open loop: request i starts at i / rate seconds whatever the earlier ones do, so a server that
stalls meets the same arrivals as one that serves. Each request asks for a streamed completion
(`stream: true`, `max_tokens`, `ignore_eos` so the output is long) and is

- ok: HTTP 200 and the stream's last choice carries a finish_reason;
- truncated: HTTP 200 but no finish_reason before the stream ended (vLLM ends a stream it cut
  with `data: [DONE]` and no finish_reason: a client that does not check takes half an answer);
- failed: refused, reset or answered with an error status.

Prints a table (sent, ok, failed, truncated, TTFT p50/p99 of the ok requests, requests per second
completed ok) and, with --json, writes the same numbers, when the load started (epoch seconds;
each request's `start` counts from it) and each request's outcome as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Outcome:
    start: float  # seconds since the load started
    status: str  # ok, truncated, failed
    ttft: float | None = None  # seconds to the first token chunk
    seconds: float = 0.0
    chunks: int = 0
    error: str = ""


def one(url: str, body: bytes, headers: dict[str, str], timeout: float, start: float, t0: float) -> Outcome:
    """Send one streamed completion; read it to its end and classify it."""
    began = time.monotonic()
    out = Outcome(start=round(began - t0, 3), status="failed")
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    finished = False
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            for raw in answer:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                out.chunks += 1
                if out.ttft is None:
                    out.ttft = round(time.monotonic() - began, 4)
                if any(c.get("finish_reason") for c in chunk.get("choices") or []):
                    finished = True
        out.status = "ok" if finished else "truncated"
    except urllib.error.HTTPError as exc:
        out.error = f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a chunk that is not JSON
        out.status = "truncated" if out.chunks else "failed"
        out.error = f"{type(exc).__name__}: {exc}"
    out.seconds = round(time.monotonic() - began, 3)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def summary(outcomes: list[Outcome], elapsed: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "ok"]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    return {"sent": len(outcomes), "ok": len(ok), "failed": sum(o.status == "failed" for o in outcomes),
            "truncated": sum(o.status == "truncated" for o in outcomes),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "ok_per_s": round(len(ok) / elapsed, 3) if elapsed > 0 else 0.0, "seconds": round(elapsed, 3)}


def run(url: str, rate: float, duration: float, *, model: str = "model", max_tokens: int = 256,
        prompt: str = "Tell me a long story.", api_key: str = "", timeout: float = 600.0,
        until: str | None = None) -> dict[str, Any]:
    """The load: `rate` requests per second for `duration` seconds (or until the file `until`
    exists: a test stops the arrivals when its rollout is over), each to its end."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    count = max(1, int(rate * duration))
    outcomes: list[Outcome | None] = [None] * count
    threads = []
    t0, started_at = time.monotonic(), time.time()
    for i in range(count):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if until and os.path.exists(until):
            break

        def go(i: int = i) -> None:
            outcomes[i] = one(url, body, headers, timeout, i / rate, t0)

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    done = [o for o in outcomes if o is not None]
    return {"url": url, "rate": rate, "max_tokens": max_tokens, "started_at": round(started_at, 3),
            **summary(done, time.monotonic() - t0),
            "requests": [asdict(o) for o in done]}


def table(result: dict[str, Any]) -> str:
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    head = ("sent", "ok", "failed", "truncated", "TTFT p50 s", "TTFT p99 s", "ok req/s")
    row = (str(result["sent"]), str(result["ok"]), str(result["failed"]), str(result["truncated"]),
           secs(result["ttft_p50_s"]), secs(result["ttft_p99_s"]), f"{result['ok_per_s']:.3f}")
    widths = [max(len(h), len(v)) for h, v in zip(head, row)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in (head, row))


def _cmd(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    if not url.endswith("/v1/completions"):
        url += "/v1/completions"
    result = run(url, args.rate, args.duration, model=args.model, max_tokens=args.max_tokens, prompt=args.prompt,
                 api_key=args.api_key, timeout=args.timeout, until=args.until)
    print(table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] == result["sent"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("loadgen", help="open-loop streamed completions against a URL; counts cut streams")
    p.add_argument("url", help="base URL (the front door, e.g. http://door:8000) or its /v1/completions")
    p.add_argument("--rate", type=float, default=0.5, help="requests started per second (default 0.5)")
    p.add_argument("--duration", type=float, default=60, help="seconds of arrivals (default 60)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens each answer is made to generate (default 256)")
    p.add_argument("--model", default="model", help="served model name (default model)")
    p.add_argument("--prompt", default="Tell me a long story.")
    p.add_argument("--api-key", default="", help="sent as Authorization: Bearer")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may stay silent (default 600)")
    p.add_argument("--json", help="write the numbers and every request's outcome here")
    p.add_argument("--until", metavar="FILE",
                   help="stop starting requests once FILE exists (--duration stays the cap); running ones finish")
    p.set_defaults(func=_cmd)

