"""A STAND-IN for vLLM's OpenAI server, for the perf gate's tests: the two endpoints its benchmark
client uses, on 127.0.0.1, with fixed delays (vLLM itself needs minutes and a model to start; the
lab's molecule scenarios run the gate against the real server)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TTFT_S, ITL_S = 0.12, 0.03


class FakeVLLM(ThreadingHTTPServer):
    """vLLM's /tokenize and streamed /v1/completions, with fixed delays; remembers every request."""

    daemon_threads = True

    def __init__(self, fail_every: int = 0, itl_s: float = ITL_S):
        super().__init__(("127.0.0.1", 0), Handler)
        self.itl_s = itl_s
        self.completions: list[dict] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.fail_every = fail_every
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: FakeVLLM

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            tokens = [1000 + (sum(map(ord, w)) % 200) for w in body["prompt"].split()]
            return self._json({"tokens": tokens, "count": len(tokens), "max_model_len": 1024})
        with self.server.lock:
            self.server.completions.append(body)
            n = len(self.server.completions)
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        if self.server.fail_every and n % self.server.fail_every == 0:
            self._done()
            return self._json({"error": "engine dead"}, 500)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(TTFT_S)
        for i in range(body["max_tokens"]):
            if i:
                time.sleep(self.server.itl_s)
            self._event({"choices": [{"index": 0, "text": f"t{i}"}]})
        self._done()  # before the client can see the end of its stream and send the next request
        self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                              "completion_tokens": body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _done(self):
        with self.server.lock:
            self.server.in_flight -= 1

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
