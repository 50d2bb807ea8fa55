"""bench/gluon_fp8_probe.py's Gluon prototypes of the fp8_ds_mla kernel compile for sm_120 within
its shared memory and without spills (no GPU: compiled in a child Python without
TRITON_INTERPRET, which this suite sets), with ptxas's .maxnreg 255 as the launcher compiles for
SM12x. The prototypes are the next fp8 pass's starting point (docs/perf-kernels.md); their device
runs are scarce, so a change that breaks one or outgrows sm_120 must show here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sm120 import SM120_MAX_SHARED_BYTES

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
sys.path.insert(0, "bench")
import gluon_fp8_probe as probe
report = {f"h16/{st}": probe.compile_prototype(120, 32, st, 16, 255) for st in (2, 3)}
report["h32/3"] = probe.compile_prototype(120, 32, 3, 32, 255)
report.update({f"grouped/{st}": probe.compile_grouped(120, 32, st, 255) for st in (2, 4, 5)})
report["grouped/2 partial"] = probe.compile_grouped(120, 32, 2, 255, partial=True)
print("REPORT", json.dumps(report))
"""


def test_prototypes_fit_sm120() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *(p for p in sys.path if p)])
    run = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("REPORT "))[7:])
    # what the H200 runs timed: each fits, spills nothing, and keeps every dot on the tensor cores
    for name in ("h16/2", "h16/3", "grouped/2", "grouped/4", "grouped/2 partial"):
        r = report[name]
        assert r["shared"] <= SM120_MAX_SHARED_BYTES, (name, r)
        assert r["stack"] == 0 and 0 < r["registers"] <= 255, (name, r)
        assert r["ops"]["HMMA"] > 0 and r["ops"]["LDGSTS"] > 0, (name, r)
    # the limits the designs work within: a 32-head block with three ring stages (107 KB) and a
    # fifth stage of the grouped ring (20 KB each) are over sm_120's 99 KB
    assert report["h32/3"]["shared"] > SM120_MAX_SHARED_BYTES, report["h32/3"]
    assert report["grouped/5"]["shared"] > SM120_MAX_SHARED_BYTES, report["grouped/5"]
    # the grouped kernel keeps q in registers: its shared memory is the ring alone, 20 KB a stage
    assert report["grouped/4"]["shared"] - report["grouped/2"]["shared"] == 2 * 4 * 32 * (128 + 32)
