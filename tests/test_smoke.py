"""The smoke-report summary reads what the smoke_test role writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlafleet.smoke import summarize


def test_summary_names_each_host_and_its_completion(tmp_path: Path):
    for host, text in (("gpu2", " Paris."), ("gpu1", " Paris")):
        (tmp_path / f"{host}.json").write_text(json.dumps({
            "host": host, "ok": True, "release": "0.20.2-abc", "health_ms": 2.0, "models_ms": 3.0,
            "attention_backend_log": "Using TRITON_MLA_SPARSE backend.",
            "completion": {"prompt": "The capital of France is", "text": text, "tokens": 2, "latency_ms": 40.5},
            "chat": {"text": "Hello", "tokens": 1, "latency_ms": 20.0}}))
    lines = summarize(tmp_path)
    assert [ln.split(":")[0] for ln in lines] == ["gpu1", "gpu2"]
    assert "' Paris.' (2 tokens, 40.5 ms)" in lines[1] and "TRITON_MLA_SPARSE" in lines[1]


def test_no_reports_is_an_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no smoke reports"):
        summarize(tmp_path)
