"""STAND-IN vLLM servers for the front door's and the load generator's tests: real HTTP servers on
127.0.0.1 that answer what the door and the load generator read from vLLM (/health, /metrics with
vllm:num_requests_running, /v1/completions streamed as server-sent events ending with a
finish_reason and `data: [DONE]`). No GPU here, so no real vLLM: these are named STAND-IN.

Faults, set per server: `generates=False` answers /health but fails every completion (500);
`cut_every=N` cuts every Nth stream (its last chunk has no finish_reason, then [DONE], as vLLM's
cut streams end); `refuse_every=N` answers every Nth completion 503 at once.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandInVllm(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, name: str = "standin", tokens: int = 4, token_delay: float = 0.01,
                 generates: bool = True, cut_every: int = 0, refuse_every: int = 0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.name, self.tokens, self.token_delay = name, tokens, token_delay
        self.generates, self.cut_every, self.refuse_every = generates, cut_every, refuse_every
        self.lock = threading.Lock()
        self.running = 0
        self.completions = 0  # completion requests received (checks and traffic)
        self.streams = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request, client_address) -> None:
        pass  # a client (the door's health check, a cut test stream) hung up: nothing to report

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: StandInVllm
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's protocol
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            text = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{engine="0",model_name="model"}} {float(self.server.running)}\n')
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length) or b"{}")
        srv = self.server
        with srv.lock:
            srv.completions += 1
            number = srv.completions
        if self.path != "/v1/completions":
            self._send(404, b"{}")
            return
        if not srv.generates:
            self._send(500, b'{"error": "STAND-IN engine generates nothing"}')
            return
        if srv.refuse_every and number % srv.refuse_every == 0:
            self._send(503, b'{"error": "STAND-IN refused"}')
            return
        tokens = int(request.get("max_tokens") or srv.tokens)
        if not request.get("stream"):
            body = {"id": f"cmpl-{number}", "object": "text_completion", "model": request.get("model"),
                    "choices": [{"index": 0, "text": "x" * tokens, "finish_reason": "length"}]}
            self._send(200, json.dumps(body).encode())
            return
        with srv.lock:
            srv.running += 1
            srv.streams += 1
            cut = bool(srv.cut_every) and srv.streams % srv.cut_every == 0
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            last = tokens // 2 if cut else tokens
            for i in range(last):
                finish = "length" if (i == tokens - 1 and not cut) else None
                chunk = {"id": f"cmpl-{number}", "object": "text_completion", "model": request.get("model"),
                         "choices": [{"index": 0, "text": "x", "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(srv.token_delay)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
        finally:
            with srv.lock:
                srv.running -= 1
