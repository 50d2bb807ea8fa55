"""The ranged HTTP mirror (`mlafleet weights serve`): ranges, HEAD, refusals, the request log."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from weights_support import mirror


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), b""


def test_ranges_head_and_refusals(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    (tmp_path / "m-00001-of-00001.gguf").write_bytes(data)
    (tmp_path / ".hidden").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    log = tmp_path / "requests.log"
    with mirror(tmp_path, log_path=str(log)) as server:
        url = f"{server.url}/m-00001-of-00001.gguf"
        assert get(url)[0] == 200 and get(url)[2] == data
        status, headers, body = get(url, {"Range": "bytes=1000-"})
        assert status == 206 and body == data[1000:]
        assert headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
        status, headers, body = get(url, {"Range": "bytes=10-19"})
        assert status == 206 and body == data[10:20]
        assert get(url, {"Range": f"bytes={len(data)}-"})[0] == 416
        assert get(url, {"Range": "bytes=-5"})[0] == 416  # suffix ranges are not needed: refused
        status, headers, body = get(url, method="HEAD")
        assert status == 200 and headers["Content-Length"] == str(len(data)) and body == b""
        assert headers["Accept-Ranges"] == "bytes"
        for bad in ("/.hidden", "/sub", "/missing.gguf", "/../etc/passwd", "/sub%2F..%2Fm-00001-of-00001.gguf"):
            assert get(server.url + bad)[0] == 404, bad
    lines = log.read_text().splitlines()
    assert any(line.endswith("range=bytes=1000-") for line in lines)


def test_mirror_refuses_a_missing_root(tmp_path: Path) -> None:
    from mlafleet.weights.mirror import MirrorServer

    with pytest.raises(ValueError, match="is not a directory"):
        MirrorServer(str(tmp_path / "nope"), ("127.0.0.1", 0))
