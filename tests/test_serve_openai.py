"""bench/serve_openai.py, the GPU serve check, through the real OpenAI client (vLLM's venv has it)
against a stand-in OpenAI-API server (a real HTTP server on 127.0.0.1 answering like vLLM's
/v1/completions and streamed /v1/chat/completions; the real vLLM server runs on the GPU)."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from weights_support import serving

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "serve_openai.py"


class StandInOpenAI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, short_every: int = 0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.short_every = short_every  # every n-th completion ends early (finish reason "stop")
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: StandInOpenAI

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append({"path": self.path, **body})
            n = len(self.server.bodies)
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        try:
            if self.path == "/v1/chat/completions":
                return self._chat(body)
            self._sleep_for_peers()
            tokens = body["max_tokens"] - (1 if self.server.short_every and n % self.server.short_every == 0 else 0)
            self._json({"id": f"cmpl-{n}", "object": "text_completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "text": " t" * tokens, "logprobs": None,
                                     "finish_reason": "length" if tokens == body["max_tokens"] else "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}})
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _sleep_for_peers(self):
        # hold each completion briefly so that requests sent at once overlap
        threading.Event().wait(0.05)

    def _chat(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = {"id": "chat-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        for i in range(body["max_tokens"]):
            delta = {"role": "assistant", "content": f"w{i} "} if i == 0 else {"content": f"w{i} "}
            last = i == body["max_tokens"] - 1
            self._event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": "length" if last else None}]})
        self._event({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"],
                                                      "total_tokens": 7 + body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _check(vllm_python_032: str, server: StandInOpenAI, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([vllm_python_032, str(SCRIPT), f"http://127.0.0.1:{server.server_address[1]}/v1",
                           "tiny-glm5", str(out)], text=True, capture_output=True, timeout=120)


def test_completion_streamed_chat_and_16_at_once(vllm_python_032: str, tmp_path: Path) -> None:
    with serving(StandInOpenAI()) as server:
        proc = _check(vllm_python_032, server, tmp_path / "serve.json")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((tmp_path / "serve.json").read_text())
    assert seen["completion"]["tokens"] == 16 and seen["completion"]["finish_reason"] == "length"
    assert seen["chat_stream"]["content_chunks"] == 16 and seen["chat_stream"]["text"].startswith("w0 w1 ")
    assert seen["concurrent"]["answered_in_full"] == 16 and seen["problems"] == []
    # what the server received: greedy, ignore_eos, the chat streamed, and the 16 really at once
    chat = [b for b in server.bodies if b["path"] == "/v1/chat/completions"]
    assert len(chat) == 1 and chat[0]["stream"] is True and chat[0]["messages"][0]["role"] == "user"
    assert all(b.get("ignore_eos") is True and b["temperature"] == 0 for b in server.bodies)
    assert len(server.bodies) == 18 and server.most_in_flight >= 8


def test_a_short_answer_fails_the_check_and_is_named(vllm_python_032: str, tmp_path: Path) -> None:
    with serving(StandInOpenAI(short_every=5)) as server:
        proc = _check(vllm_python_032, server, tmp_path / "serve.json")
    assert proc.returncode == 1
    seen = json.loads((tmp_path / "serve.json").read_text())
    assert seen["concurrent"]["answered_in_full"] < 16
    assert "serve_openai: concurrent: requests [" in proc.stderr and "not answered with 32 tokens" in proc.stderr
