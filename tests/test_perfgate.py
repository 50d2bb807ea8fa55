"""The perf gate: its decisions (mlafleet.ops.perfgate) and its benchmark client (roles/perf_gate/files).

The client runs against a real HTTP server of ours on 127.0.0.1 that speaks the parts of vLLM's
OpenAI API the client uses (/tokenize, streamed /v1/completions) and streams tokens with known
delays, so the metrics can be checked against what they must be (tests/perf_support.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from perf_support import ITL_S, TTFT_S, FakeVLLM
from play_support import run_local_play
from weights_support import serving

from mlafleet.ops import perfgate

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "roles" / "perf_gate" / "files" / "mlafleet-perf-bench"
WORKLOAD = {"input_len": 16, "output_len": 8, "num_prompts": 4, "concurrency": 2, "warmup": 2, "seed": 3}


def run(**metrics: float) -> dict:
    """One repeat as the client prints it: every metric, 0 errors, overridden by `metrics`."""
    base = {"output_throughput": 100.0, "request_throughput": 4.0, "ttft_p50_ms": 50.0, "ttft_p99_ms": 80.0,
            "itl_p50_ms": 10.0, "itl_p99_ms": 20.0, "tpot_p50_ms": 10.0, "tpot_p99_ms": 12.0,
            "completed": 4, "errors": 0, "error_samples": []}
    return {**base, **metrics}


def measured(*runs: dict) -> dict:
    return {"workload": WORKLOAD, "started": "2026-12-01T10:00:00Z", "total_s": 3.0, "warmup_s": 0.5,
            "runs": list(runs)}


def request(current: dict, baseline: dict | None = None, **kw) -> dict:
    return {"workload": WORKLOAD, "model": "tiny-llama", "host": "h1", "release": "rel-b",
            "baseline_release": "rel-a" if baseline else kw.pop("baseline_release", ""), "run": "run-1",
            "current": current, "baseline": baseline, **kw}


def baseline_of(*runs: dict) -> dict:
    """The record a passing first measurement leaves on the host (what the next release compares with)."""
    verdict = perfgate.compare(request(measured(*runs), release="rel-a"))
    assert verdict["status"] == "baseline"
    return verdict["record"]


# --- decisions ------------------------------------------------------------------------------

def test_first_release_sets_the_baseline_and_names_it():
    verdict = perfgate.compare(request(measured(run(), run(), run()), release="rel-a"))
    assert verdict["status"] == "baseline" and verdict["ok"]
    assert "no baseline" in verdict["message"] and "becomes the baseline of release rel-a" in verdict["message"]
    record = verdict["record"]
    assert record["release"] == "rel-a" and record["workload_key"] == verdict["workload_key"]
    assert record["summary"]["output_throughput"]["median"] == 100.0 and len(record["runs"]) == 3


def test_medians_not_means_decide():
    # One slow outlier run out of three: the median is unchanged, so the gate passes.
    base = baseline_of(run(), run(), run())
    verdict = perfgate.compare(request(measured(run(), run(output_throughput=20.0, ttft_p99_ms=900.0), run()), base))
    assert verdict["status"] == "passed", verdict["message"]
    tput = next(m for m in verdict["metrics"] if m["name"] == "output_throughput")
    assert tput["current"]["median"] == 100.0 and tput["current"]["values"] == [100.0, 20.0, 100.0]
    assert tput["current"]["spread_pct"] == 80.0  # (max - min) / median, shown in the report
    # Two of three slow: the median moves, and the gate fails naming the metric, amount and release.
    verdict = perfgate.compare(request(measured(run(output_throughput=50.0), run(output_throughput=60.0), run()), base))
    assert verdict["status"] == "failed" and not verdict["ok"] and verdict["record"] is None
    assert verdict["regressions"] == ["output tok/s down 40.0% (100 tok/s -> 60 tok/s; limit 10%)"]
    assert "against release rel-a" in verdict["message"] and "perf_gate_accept=true" in verdict["message"]


@pytest.mark.parametrize(("metric", "value", "regressed"), [
    ("output_throughput", 90.5, False),   # down 9.5% < 10%
    ("output_throughput", 89.0, True),    # down 11% > 10%
    ("output_throughput", 300.0, False),  # faster is never a regression
    ("ttft_p99_ms", 99.0, False),         # up 23.75% < 25%
    ("ttft_p99_ms", 101.0, True),         # up 26.25%
    ("itl_p99_ms", 25.2, True),           # up 26%
    ("itl_p99_ms", 5.0, False),
    ("ttft_p50_ms", 500.0, False),        # not gated by default: reported only
])
def test_default_thresholds(metric, value, regressed):
    base = baseline_of(run())
    verdict = perfgate.compare(request(measured(run(**{metric: value})), base))
    entry = next(m for m in verdict["metrics"] if m["name"] == metric)
    assert entry["regressed"] is regressed
    assert (verdict["status"] == "failed") is regressed
    if regressed:
        assert entry["label"] in verdict["message"]


def test_thresholds_are_variables():
    base = baseline_of(run())
    slower = measured(run(output_throughput=85.0, ttft_p50_ms=70.0))
    assert perfgate.compare(request(slower, base, thresholds={"output_throughput": 20}))["status"] == "passed"
    verdict = perfgate.compare(request(slower, base, thresholds={"ttft_p50_ms": 30}))
    assert verdict["status"] == "failed" and verdict["regressions"][0].startswith("TTFT p50 up 40.0%")
    with pytest.raises(perfgate.GateError, match="unknown metric 'tok_s'"):
        perfgate.compare(request(slower, base, thresholds={"tok_s": 10}))
    with pytest.raises(perfgate.GateError, match="percentage >= 0"):
        perfgate.compare(request(slower, base, thresholds={"ttft_p99_ms": -5}))


def test_accepted_regression_needs_a_reason_and_is_recorded():
    base = baseline_of(run())
    slower = measured(run(itl_p99_ms=40.0))
    with pytest.raises(perfgate.GateError, match="perf_gate_accept=true needs perf_gate_accept_reason"):
        perfgate.compare(request(slower, base, accept=True, accept_reason="  "))
    verdict = perfgate.compare(request(slower, base, accept=True, accept_reason="fp8 KV cache: known ITL cost",
                                       accepted_by="alice"))
    assert verdict["status"] == "accepted" and verdict["ok"]
    assert verdict["accepted"]["reason"] == "fp8 KV cache: known ITL cost" and verdict["accepted"]["by"] == "alice"
    assert verdict["accepted"]["against"] == "rel-a" and verdict["accepted"]["run"] == "run-1"
    assert verdict["accepted"]["regressions"] == ["ITL p99 up 100.0% (20 ms -> 40 ms; limit 25%)"]
    # The new release's baseline carries the acceptance, so whoever compares with it later sees it.
    assert verdict["record"]["accepted"] == verdict["accepted"] and verdict["record"]["status"] == "accepted"
    # Accepting when nothing regressed records nothing.
    verdict = perfgate.compare(request(measured(run()), base, accept=True, accept_reason="just in case"))
    assert verdict["status"] == "passed" and verdict["accepted"] is None


def test_failed_requests_fail_the_gate_even_when_accepted_or_first():
    failing = measured(run(errors=1, error_samples=["HTTP 500: boom"]), run())
    verdict = perfgate.compare(request(failing, release="rel-a"))
    assert verdict["status"] == "failed" and verdict["record"] is None
    assert "1 of 9 benchmark requests failed (limit 0): HTTP 500: boom" in verdict["message"]
    base = baseline_of(run())
    verdict = perfgate.compare(request(failing, base, accept=True, accept_reason="known"))
    assert verdict["status"] == "failed" and verdict["accepted"] is None
    assert perfgate.compare(request(failing, base, max_errors=1))["status"] == "passed"


def test_workload_key_and_bad_input():
    planned = perfgate.plan({"workload": {"input_len": 16}, "model": "m"})
    assert planned["workload"] == {**perfgate.WORKLOAD_DEFAULTS, "input_len": 16}
    assert planned["key"].startswith("in16-out128-n32-c8-")
    # The key follows the work and the model, not the warm-up.
    key = perfgate.workload_key
    w = planned["workload"]
    assert key(w, "m") == key({**w, "warmup": 0}, "m") != key({**w, "seed": 1}, "m") != key(w, "other")
    for bad, match in [({"workload": {"concurrency": 0}, "model": "m"}, "concurrency must be an integer >= 1"),
                       ({"workload": {"input_len": "8"}, "model": "m"}, "input_len must be an integer"),
                       ({"workload": {"prompts": 8}, "model": "m"}, "unknown fields prompts"),
                       ({"workload": {}, "model": "m", "repeats": 0}, "perf_gate_repeats must be"),
                       ({"workload": {}, "model": ""}, "perf_gate_model"),
                       ({"workload": {}, "model": "m", "accept": "yes"}, "perf_gate_accept must be true or false")]:
        with pytest.raises(perfgate.GateError, match=match):
            perfgate.plan(bad)


def test_a_baseline_of_another_workload_or_garbage_is_refused():
    base = baseline_of(run())
    with pytest.raises(perfgate.GateError, match="measured workload"):
        perfgate.compare(request(measured(run()), {**base, "workload_key": "in1-out1-n1-c1-x"}))
    with pytest.raises(perfgate.GateError, match="/opt/x.json is not JSON"):
        perfgate.compare(request(measured(run()), None, baseline_text="{not json", baseline_path="/opt/x.json"))
    with pytest.raises(perfgate.GateError, match="not a perf_gate baseline"):
        perfgate.compare(request(measured(run()), None, baseline_text="[1, 2]"))


def test_cli_reads_stdin_and_exits_2_on_bad_input():
    ok = subprocess.run([sys.executable, "-m", "mlafleet.ops.perfgate", "compare"], cwd=REPO, text=True,
                        capture_output=True, input=json.dumps(request(measured(run()), release="rel-a")))
    assert ok.returncode == 0 and json.loads(ok.stdout)["status"] == "baseline"
    bad = subprocess.run([sys.executable, "-m", "mlafleet.ops.perfgate", "plan"], cwd=REPO, text=True,
                         capture_output=True, input=json.dumps({"workload": {"seed": -1}, "model": "m"}))
    assert bad.returncode == 2 and "perf gate: perf_gate_workload.seed must be an integer >= 0" in bad.stderr


# --- the client -------------------------------------------------------------------------

def bench(server: FakeVLLM, workload: dict, repeats: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLIENT), f"--base-url=http://127.0.0.1:{server.server_address[1]}",
                           "--model=tiny", f"--workload={json.dumps(workload)}", f"--repeats={repeats}"],
                          text=True, capture_output=True, timeout=120)


def test_client_metrics_mean_what_vllm_bench_means():
    with serving(FakeVLLM()) as server:
        out = bench(server, WORKLOAD)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["runs"]) == 2 and "run 2/2" in out.stderr
    # Warm-up requests were sent first and are not measured: 2 + 2 runs x 4 prompts.
    bodies = server.completions
    assert len(bodies) == 2 + 2 * 4 and all(r["completed"] == 4 and r["errors"] == 0 for r in result["runs"])
    # Every request: exactly input_len token ids, output_len tokens with ignore_eos, streamed.
    assert all(len(b["prompt"]) == 16 and all(isinstance(t, int) for t in b["prompt"]) for b in bodies)
    assert all(b["max_tokens"] == 8 and b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    # Prompts differ within and between runs (no prefix-cache hits) but are the same every time.
    assert len({json.dumps(b["prompt"]) for b in bodies}) == len(bodies)
    assert server.most_in_flight == 2  # concurrency
    with serving(FakeVLLM()) as again:
        bench(again, WORKLOAD)
    assert sorted(b["prompt"] for b in again.completions) == sorted(b["prompt"] for b in bodies)
    for r in result["runs"]:
        assert r["output_tokens"] == 4 * 8 and r["input_tokens"] == 4 * 16
        assert TTFT_S * 1000 <= r["ttft_p50_ms"] < TTFT_S * 1000 + 100  # sleeps are lower bounds
        assert ITL_S * 1000 * 0.9 <= r["itl_p50_ms"] < ITL_S * 1000 + 25
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert ITL_S * 1000 * 0.9 <= r["tpot_p50_ms"] < ITL_S * 1000 + 25
        # 4 requests at concurrency 2: two waves of TTFT + 7 ITL each.
        wave = TTFT_S + 7 * ITL_S
        assert 2 * wave <= r["duration_s"] < 2 * wave + 1.5
        assert r["output_throughput"] == pytest.approx(32 / r["duration_s"], rel=1e-3)
        assert r["request_throughput"] == pytest.approx(4 / r["duration_s"], rel=1e-3)


def test_client_counts_failed_requests_and_refuses_bad_input():
    with serving(FakeVLLM(fail_every=3)) as server:
        out = bench(server, {**WORKLOAD, "warmup": 0}, repeats=1)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)["runs"][0]
    assert r["errors"] == 1 and r["completed"] == 3 and r["error_samples"][0].startswith("HTTP 500")
    with serving(FakeVLLM()) as server:
        too_long = bench(server, {**WORKLOAD, "input_len": 1000, "output_len": 100})
        assert too_long.returncode == 1 and "exceeds the server's max_model_len 1024" in too_long.stderr
        missing = bench(server, {"input_len": 8})
        assert missing.returncode == 1 and "workload needs integer output_len" in missing.stderr
    down = subprocess.run([sys.executable, str(CLIENT), "--base-url=http://127.0.0.1:9", "--model=m",
                           f"--workload={json.dumps(WORKLOAD)}"], text=True, capture_output=True, timeout=60)
    assert down.returncode == 1 and "POST /tokenize" in down.stderr


def test_client_percentiles_interpolate_like_numpy():
    loader = importlib.machinery.SourceFileLoader("perf_bench", str(CLIENT))
    spec = importlib.util.spec_from_loader("perf_bench", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert mod.percentile(values, 50) == 3.0
    assert mod.percentile(values, 99) == pytest.approx(4.96)  # numpy.percentile(values, 99)
    assert mod.percentile([7.0], 99) == 7.0 and mod.percentile([], 50) is None


# --- the role, through mlafleet's runner (connection local, a scratch release root) ---------

GATE_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: perf_gate
      vars:
        perf_gate_root: "{{ scratch }}/root"
        perf_gate_report_dir: "{{ scratch }}/reports/{{ mlafleet_run }}"
        perf_gate_base_url: "{{ url }}"
        perf_gate_model: tiny
        perf_gate_workload: {input_len: 16, output_len: 8, num_prompts: 4, concurrency: 2, warmup: 1}
        perf_gate_repeats: 2
        # ITL p50 only: the fake server's token gaps are fixed, so its median is steady even on a
        # loaded machine (p99s of 8-request runs are not).
        perf_gate_thresholds: {itl_p50_ms: 50}
        mlafleet_run_id: "{{ mlafleet_run }}"
"""


def test_role_sets_then_enforces_the_baseline_beside_the_release(tmp_path):
    from mlafleet.ops import runner

    for release in ("rel-a", "rel-b"):
        (tmp_path / "root" / "releases" / release).mkdir(parents=True)
    inv = tmp_path / "inventory.yml"
    inv.write_text(f"all:\n  vars:\n    scratch: {tmp_path}\n  hosts:\n"
                   f"    h1: {{ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n")
    (tmp_path / "gate.yml").write_text(GATE_PLAY)
    reports = tmp_path / "reports"

    def gate(server: FakeVLLM, run_id: str, **extravars) -> dict:
        out = io.StringIO()
        report = runner.run_playbook(
            "rollout", [inv], run=run_id, out=out, playbook=str(tmp_path / "gate.yml"),
            runner_root=tmp_path / "runner", report_root=reports,
            extravars={"url": f"http://127.0.0.1:{server.server_address[1]}",
                       "__perf_gate_client": str(tmp_path / "perf-bench"), **extravars})
        report["_out"] = out.getvalue()
        return report

    base_dir = tmp_path / "root" / "releases"
    with serving(FakeVLLM()) as server:
        first = gate(server, "first", perf_gate_release="rel-a")
    assert first["rc"] == 0, first["_out"]
    verdict = json.loads((reports / "first" / "perf" / "h1.json").read_text())
    assert verdict["status"] == "baseline" and "record" not in verdict
    kept = list((base_dir / "rel-a" / "perf").glob("*.json"))
    assert [p.stem for p in kept] == [verdict["workload_key"]]
    assert json.loads(kept[0].read_text())["summary"]["itl_p50_ms"]["median"] == pytest.approx(30, abs=15)
    assert "2 runs of workload" in (tmp_path / "runner" / "first" / "artifacts" / "first" / "stdout").read_text()

    # rel-b streams 3x slower tokens: ITL p50 fails the host, naming the metric and rel-a.
    with serving(FakeVLLM(itl_s=3 * ITL_S)) as slow:
        second = gate(slow, "second", perf_gate_release="rel-b", perf_gate_baseline_release="rel-a")
        assert second["rc"] != 0
        cause = second["hosts"][0]["cause"]
        assert "ITL p50 up" in cause and "limit 50%" in cause and "against release rel-a" in cause, cause
        assert not (base_dir / "rel-b" / "perf").exists()  # a failed measurement is no baseline
        assert json.loads((reports / "second" / "perf" / "h1.json").read_text())["status"] == "failed"

        # Accepted, with a reason: it passes, and rel-b's baseline records why.
        third = gate(slow, "third", perf_gate_release="rel-b", perf_gate_baseline_release="rel-a",
                     perf_gate_accept=True, perf_gate_accept_reason="known: slower tokens, for the test")
        assert third["rc"] == 0, third["_out"]
    record = json.loads(next((base_dir / "rel-b" / "perf").glob("*.json")).read_text())
    assert record["status"] == "accepted" and record["compared_with"] == "rel-a"
    assert record["accepted"]["reason"] == "known: slower tokens, for the test" and record["accepted"]["run"] == "third"

    # The HTML report of the failed run, rendered by the callback and again by the runner.
    html = (reports / "second" / "index.html").read_text()
    assert "rollout report: " + str(reports / "second" / "index.html") in second["_out"]
    assert "h1" in html and "ITL p50 <span" in html and "regressed" in html and "rel-a" in html
    assert json.loads((reports / "second" / "timeline.json").read_text())["hosts"]["h1"]

    # Turned off (per group in real inventories): nothing is measured or written.
    with serving(FakeVLLM()) as server:
        off = gate(server, "off", perf_gate_release="rel-b", perf_gate_enabled=False)
        assert off["rc"] == 0 and not server.completions and not (reports / "off" / "perf").exists()


SKIP_PLAY = """\
- name: The perf gate's skip entry point
  hosts: all
  gather_facts: false
  tasks:
    - name: Skip
      ansible.builtin.include_role:
        name: "{{ role }}"
        tasks_from: skip
      vars:
        __perf_gate_skip_message: unchanged state, server not restarted
"""


def test_a_skipped_verdict_is_written_private_like_a_measured_one(tmp_path):
    """The skip path writes reports/<run>/perf/<host>.json as the compare path does: a 0600 file in
    a 0700 directory (docs/rollout.md), with the status and the reason."""
    done = run_local_play(tmp_path, SKIP_PLAY, {"role": str(REPO / "roles/perf_gate"), "perf_gate_release": "rel-a",
                                                "perf_gate_report_dir": str(tmp_path / "run")}, host="h1")
    assert done.returncode == 0, done.stdout[-3000:]
    verdict = tmp_path / "run" / "perf" / "h1.json"
    assert json.loads(verdict.read_text())["status"] == "skipped"
    assert verdict.stat().st_mode & 0o777 == 0o600
    assert verdict.parent.stat().st_mode & 0o777 == 0o700
