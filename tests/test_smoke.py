"""The smoke-report summary reads what the smoke_test role writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlafleet.ops.smoke import summarize


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


def test_summary_names_the_backend_found_and_the_one_expected(tmp_path: Path):
    (tmp_path / "lab1.json").write_text(json.dumps({
        "host": "lab1", "ok": True, "release": "0.20.2-abc", "health_ms": 2.0, "attention_backend_log": None,
        "attention_backend": "CPU_ATTN", "attention_backend_expected": "CPU_ATTN",
        "completion": {"prompt": "Hi", "text": " there", "tokens": 1, "latency_ms": 9.0},
        "chat": {"text": "Hello", "tokens": 1, "latency_ms": 8.0}}))
    assert summarize(tmp_path)[0].endswith("attention backend: CPU_ATTN (expected CPU_ATTN)")


def test_no_reports_is_an_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no smoke reports"):
        summarize(tmp_path)


def test_the_runs_own_files_are_skipped_and_a_rolled_back_host_is_named(tmp_path: Path):
    """A run's directory as `make demo` leaves it: the report callback's timeline.json (and the
    CLI's run.json) beside the hosts' reports; a host whose batch was rolled back."""
    (tmp_path / "timeline.json").write_text(json.dumps({"run": "demo", "events": [{"host": "gpu1"}]}))
    (tmp_path / "run.json").write_text(json.dumps({"command": "rollout", "hosts": [{"name": "gpu1"}]}))
    (tmp_path / "gpu1.json").write_text(json.dumps({
        "host": "gpu1", "ok": True, "release": "0.32.0-abc", "health_ms": 2.0,
        "completion": {"prompt": "Hi", "text": " there", "tokens": 1, "latency_ms": 9.0},
        "chat": {"text": "Hello", "tokens": 1, "latency_ms": 8.0}}))
    (tmp_path / "gpu2.json").write_text(json.dumps({
        "host": "gpu2", "ok": False, "release": "0.32.0-abc", "rolled_back_to": "0.20.2-def",
        "rollback_error": None, "cause": "perf gate: ttft_p50_ms up 4000%"}))
    lines = summarize(tmp_path)
    assert len(lines) == 2 and lines[0].startswith("gpu1: release 0.32.0-abc: 'Hi' -> ' there'")
    assert lines[1] == ("gpu2: release 0.32.0-abc: no smoke test passed: perf gate: ttft_p50_ms up 4000%; "
                        "rolled back to 0.20.2-def")
    (tmp_path / "gpu1.json").unlink()
    (tmp_path / "gpu2.json").unlink()
    with pytest.raises(FileNotFoundError, match="no smoke reports"):
        summarize(tmp_path)
