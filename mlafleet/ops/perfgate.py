"""The performance gate's decisions: workload keys, medians over repeats, regressions, acceptance.

The perf_gate role measures a release on a host (its client prints one JSON object with one
entry per repeat, see roles/perf_gate/files/mlafleet-perf-bench) and asks this module, on the
controller, what that measurement means:

- `plan`: check the workload, repeats, thresholds and acceptance before anything runs, and name
  the workload (`workload_key`: the baseline file is releases/<id>/perf/<key>.json on the host).
- `compare`: the median of every metric over the repeats, against the baseline of the release
  being replaced (its medians). A gated metric that is worse by more than its threshold (in
  percent of the baseline) is a regression; failed requests beyond `max_errors` always fail. No
  baseline: this measurement becomes the release's baseline. A regression can be accepted with
  a reason, which is recorded in the report and in the baseline kept beside the release.

Both read one JSON object on stdin and print one on stdout (`python -m mlafleet.ops.perfgate plan`),
and exit 2 with the problem named on stderr for bad input. Standard library only, so any Python
that runs Ansible runs it.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import statistics
import sys
import time
from typing import Any

# name: (label, unit, better) -- better is "higher" or "lower". Names are the client's keys.
METRICS: dict[str, tuple[str, str, str]] = {
    "output_throughput": ("output tok/s", "tok/s", "higher"),
    "request_throughput": ("requests/s", "req/s", "higher"),
    "ttft_p50_ms": ("TTFT p50", "ms", "lower"),
    "ttft_p99_ms": ("TTFT p99", "ms", "lower"),
    "itl_p50_ms": ("ITL p50", "ms", "lower"),
    "itl_p99_ms": ("ITL p99", "ms", "lower"),
    "tpot_p50_ms": ("TPOT p50", "ms", "lower"),
    "tpot_p99_ms": ("TPOT p99", "ms", "lower"),
}
DEFAULT_THRESHOLDS = {"output_throughput": 10.0, "ttft_p99_ms": 25.0, "itl_p99_ms": 25.0}
WORKLOAD_DEFAULTS = {"input_len": 1024, "output_len": 128, "num_prompts": 32, "concurrency": 8, "warmup": 8,
                     "seed": 0}
# What the work of one measured run depends on (warm-up and repeats do not change it).
KEYED_FIELDS = ("input_len", "output_len", "num_prompts", "concurrency", "seed")


class GateError(ValueError):
    """Bad input to the gate; the message names the variable and the problem."""


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GateError(f"{name} must be an integer >= {minimum}, not {value!r}")
    return value


def normalize_workload(workload: Any) -> dict[str, int]:
    """perf_gate_workload with the defaults filled in; unknown or bad fields are errors."""
    if not isinstance(workload, dict):
        raise GateError(f"perf_gate_workload must be a mapping, not {workload!r}")
    unknown = sorted(set(workload) - set(WORKLOAD_DEFAULTS))
    if unknown:
        raise GateError(f"perf_gate_workload has unknown fields {', '.join(unknown)} "
                        f"(known: {', '.join(WORKLOAD_DEFAULTS)})")
    out = {**WORKLOAD_DEFAULTS, **workload}
    for name in WORKLOAD_DEFAULTS:
        minimum = 0 if name in ("warmup", "seed") else 1
        _positive_int(f"perf_gate_workload.{name}", out[name], minimum)
    return out


def workload_key(workload: dict[str, int], model: str) -> str:
    """A readable, stable name for the work of one run on one model: in1024-out128-n32-c8-<hash>."""
    digest = hashlib.sha256(json.dumps({"model": model, **{k: workload[k] for k in KEYED_FIELDS}},
                                       sort_keys=True).encode()).hexdigest()[:10]
    return (f"in{workload['input_len']}-out{workload['output_len']}-n{workload['num_prompts']}"
            f"-c{workload['concurrency']}-{digest}")


def normalize_thresholds(thresholds: Any) -> dict[str, float]:
    """metric -> largest allowed worsening in percent of the baseline."""
    if not isinstance(thresholds, dict):
        raise GateError(f"perf_gate_thresholds must be a mapping of metric to percent, not {thresholds!r}")
    out = {}
    for name, value in thresholds.items():
        if name not in METRICS:
            raise GateError(f"perf_gate_thresholds: unknown metric {name!r} (known: {', '.join(METRICS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise GateError(f"perf_gate_thresholds.{name} must be a percentage >= 0, not {value!r}")
        out[name] = float(value)
    return out


def plan(request: dict[str, Any]) -> dict[str, Any]:
    """Validate everything the role was given before the benchmark runs."""
    workload = normalize_workload(request.get("workload", {}))
    repeats = _positive_int("perf_gate_repeats", request.get("repeats", 3))
    thresholds = normalize_thresholds(request.get("thresholds", DEFAULT_THRESHOLDS))
    _positive_int("perf_gate_max_errors", request.get("max_errors", 0), 0)
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise GateError(f"perf_gate_model must name the served model, not {model!r}")
    accept, reason = request.get("accept", False), request.get("accept_reason", "")
    if not isinstance(accept, bool):
        raise GateError(f"perf_gate_accept must be true or false, not {accept!r}")
    if accept and not (isinstance(reason, str) and reason.strip()):
        raise GateError("perf_gate_accept=true needs perf_gate_accept_reason: say why this regression is "
                        "accepted (it is recorded in the report and beside the release), e.g. "
                        "-e perf_gate_accept=true -e \"perf_gate_accept_reason='fp8 KV: known 8% ITL cost'\"")
    return {"workload": workload, "key": workload_key(workload, model), "repeats": repeats,
            "thresholds": thresholds}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: the values of every repeat, their median and spread ((max - min) / median, %)."""
    out = {}
    for name in METRICS:
        values = [r[name] for r in runs if isinstance(r.get(name), (int, float))]
        if not values:
            out[name] = {"values": [], "median": None, "min": None, "max": None, "spread_pct": None}
            continue
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med * 100 if med else None
        out[name] = {"values": values, "median": med, "min": min(values), "max": max(values),
                     "spread_pct": None if spread is None else round(spread, 2)}
    return out


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


def read_baseline(request: dict[str, Any]) -> dict[str, Any] | None:
    """The baseline from the request: `baseline` (an object) or `baseline_text` (the file's text)."""
    baseline = request.get("baseline")
    where = request.get("baseline_path") or "the baseline"
    if baseline is None and request.get("baseline_text") is not None:
        try:
            baseline = json.loads(request["baseline_text"])
        except json.JSONDecodeError as exc:
            raise GateError(f"{where} is not JSON ({exc}); move it away to measure a new baseline") from None
    if baseline is not None and (not isinstance(baseline, dict) or not isinstance(baseline.get("summary"), dict)):
        raise GateError(f"{where} is not a perf_gate baseline (no 'summary'); move it away to measure a new one")
    return baseline


def compare(request: dict[str, Any]) -> dict[str, Any]:
    """The verdict on one host: status baseline | passed | accepted | failed, with every metric."""
    planned = plan(request)
    thresholds, key = planned["thresholds"], planned["key"]
    current = request.get("current")
    if not isinstance(current, dict) or not isinstance(current.get("runs"), list) or not current["runs"]:
        raise GateError("the benchmark printed no runs to compare")
    baseline = read_baseline(request)
    if baseline is not None and baseline.get("workload_key") not in (None, key):
        raise GateError(f"the baseline measured workload {baseline.get('workload_key')}, not {key}")
    release = request.get("release", "")
    baseline_release = request.get("baseline_release", "")
    cur = summarize(current["runs"])
    base = baseline["summary"] if baseline else None
    metrics, regressions = [], []
    for name, (label, unit, better) in METRICS.items():
        entry = {"name": name, "label": label, "unit": unit, "better": better,
                 "current": cur[name], "baseline": base.get(name) if base else None,
                 "threshold_pct": thresholds.get(name), "change_pct": None, "worse_pct": None, "regressed": False}
        b = (entry["baseline"] or {}).get("median")
        c = cur[name]["median"]
        if b and c is not None:
            change = (c - b) / b * 100
            entry["change_pct"] = round(change, 2)
            entry["worse_pct"] = round(-change if better == "higher" else change, 2)
            if entry["threshold_pct"] is not None and entry["worse_pct"] > entry["threshold_pct"]:
                entry["regressed"] = True
                direction = "down" if better == "higher" else "up"
                regressions.append(f"{label} {direction} {abs(change):.1f}% ({_fmt(b, unit)} -> {_fmt(c, unit)}; "
                                   f"limit {entry['threshold_pct']:g}%)")
        elif name in thresholds and base is not None and c is None:
            entry["regressed"] = True
            regressions.append(f"{label}: not measured")
        metrics.append(entry)
    errors = sum(int(r.get("errors") or 0) for r in current["runs"])
    requests = sum(int(r.get("completed") or 0) + int(r.get("errors") or 0) for r in current["runs"])
    max_errors = int(request.get("max_errors", 0))
    samples = [s for r in current["runs"] for s in (r.get("error_samples") or [])][:3]
    error_failure = errors > max_errors
    accept = bool(request.get("accept")) and bool(regressions) and not error_failure
    against = f"release {baseline_release}" if baseline_release else "no release"
    if error_failure:
        status = "failed"
        message = (f"perf gate: {errors} of {requests} benchmark requests failed (limit {max_errors}): "
                   f"{'; '.join(samples)}")
        if regressions:
            message += f"; also {', '.join(regressions)} against {against}"
    elif base is None:
        status = "baseline"
        message = (f"perf gate: no baseline of {against} for workload {key} on this host; "
                   f"this measurement becomes the baseline of release {release}")
    elif regressions:
        status = "accepted" if accept else "failed"
        message = f"perf gate: {', '.join(regressions)} against {against} (measured {baseline.get('measured_at', '?')})"
        if accept:
            message += f"; accepted: {request.get('accept_reason')}"
        else:
            message += ("; to accept a known regression: -e perf_gate_accept=true "
                        "-e perf_gate_accept_reason='why'")
    else:
        status = "passed"
        message = f"perf gate: within the thresholds of {against}"
    accepted = None
    if accept:
        accepted = {"reason": request.get("accept_reason"), "by": request.get("accepted_by") or _user(),
                    "run": request.get("run", ""), "at": _now(), "against": baseline_release,
                    "regressions": regressions}
    verdict = {
        "host": request.get("host", ""), "release": release, "baseline_release": baseline_release or None,
        "status": status, "ok": status != "failed", "message": message, "regressions": regressions,
        "errors": errors, "requests": requests, "workload": planned["workload"], "workload_key": key,
        "repeats": len(current["runs"]), "thresholds": thresholds, "max_errors": max_errors,
        "accepted": accepted, "measured_at": current.get("started") or _now(), "run": request.get("run", ""),
        "bench_total_s": current.get("total_s"), "bench_warmup_s": current.get("warmup_s"),
        "baseline_measured_at": baseline.get("measured_at") if baseline else None,
        "baseline_run": baseline.get("run") if baseline else None,
        "metrics": metrics, "current_runs": current["runs"],
    }
    # What the host keeps beside the release (only a measurement that passed becomes a baseline).
    verdict["record"] = None if status == "failed" else {
        "release": release, "host": verdict["host"], "workload": planned["workload"], "workload_key": key,
        "model": request.get("model"), "measured_at": verdict["measured_at"], "run": verdict["run"],
        "compared_with": baseline_release or None, "status": status, "accepted": accepted,
        "summary": cur, "runs": current["runs"],
    }
    return verdict


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"plan": plan, "compare": compare}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: python -m mlafleet.ops.perfgate {{{','.join(commands)}}} < request.json", file=sys.stderr)
        return 2
    try:
        request = json.loads(sys.stdin.read() or "{}")
        if not isinstance(request, dict):
            raise GateError("the request must be a JSON object")
        print(json.dumps(commands[argv[0]](request), indent=1, sort_keys=True))
    except (GateError, json.JSONDecodeError) as exc:
        print(f"perf gate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
