"""A small HTTP mirror for GGUF shards: static files with byte ranges, and a request log.

`mlafleet weights serve DIR` runs it on a controller (an air-gapped fleet's origin), the tests run
it on 127.0.0.1, and the molecule scenario runs this same file with a lab host's python3, so it
uses the standard library only. Python's own http.server ignores Range headers; resuming a
400 GB download needs them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")
CHUNK = 1 << 20


class MirrorHandler(BaseHTTPRequestHandler):
    """GET/HEAD of files directly under the server's root; single `bytes=N-` or `bytes=N-M` ranges."""

    server: "MirrorServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        self.server.record(f"{self.client_address[0]} {format % args}")

    def _resolve(self) -> str | None:
        name = unquote(urlsplit(self.path).path).lstrip("/")
        if not name or "/" in name or name.startswith("."):
            return None
        path = os.path.join(self.server.root, name)
        return path if os.path.isfile(path) else None

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = self._resolve()
        if path is None:
            self.send_error(404, "no such shard")
            return
        size = os.path.getsize(path)
        start, end = 0, size - 1
        requested = self.headers.get("Range")
        auth = "yes" if self.headers.get("Authorization") else "no"  # whether one came, never its value
        self.server.record(f"{self.client_address[0]} {self.command} {self.path} auth={auth} range={requested or '-'}")
        if requested:
            match = RANGE_RE.match(requested.strip())
            if not match or int(match[1]) >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(match[1])
            end = min(int(match[2]), size - 1) if match[2] else size - 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if body:
            self.send_bytes(path, start, end - start + 1)

    def send_bytes(self, path: str, start: int, length: int) -> None:
        with open(path, "rb") as handle:
            handle.seek(start)
            rate = self.server.rate
            began = time.monotonic()
            sent = 0
            while sent < length:
                chunk = handle.read(min(CHUNK, length - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(chunk)
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)


class MirrorServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: str, address: tuple[str, int], rate: float = 0.0, log_path: str = "",
                 handler: type[MirrorHandler] = MirrorHandler) -> None:
        if not os.path.isdir(root):
            raise ValueError(f"{root} is not a directory")
        self.root = os.path.abspath(root)
        self.rate = rate
        self.log_path = log_path
        self.requests: list[str] = []
        self._lock = threading.Lock()
        super().__init__(address, handler)

    def record(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="directory whose files are served")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--rate", type=float, default=0.0, help="bytes per second per request (0: unlimited)")
    parser.add_argument("--log", default="", help="append one line per request to this file")


def run(args: argparse.Namespace) -> int:
    server = MirrorServer(args.root, (args.bind, args.port), rate=args.rate, log_path=args.log)
    print(f"serving {server.root} at {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
