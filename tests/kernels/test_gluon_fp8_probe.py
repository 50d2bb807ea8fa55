"""bench/gluon_fp8_probe.py's Gluon prototype of the fp8_ds_mla kernel compiles for sm_120 within
its shared memory and without spills (no GPU: compiled in a child Python without
TRITON_INTERPRET, which this suite sets). The prototype is the next fp8 pass's starting point
(docs/perf-kernels.md); its device runs are scarce, so a change that breaks it or outgrows sm_120
must show here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlafleet.kernels.sm120 import SM120_MAX_SHARED_BYTES

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
sys.path.insert(0, "bench")
import gluon_fp8_probe as probe
print("REPORT", json.dumps({st: probe.compile_prototype(120, 32, st) for st in (2, 3)}))
"""


def test_prototype_fits_sm120_with_two_stages_not_three() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *(p for p in sys.path if p)])
    run = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("REPORT "))[7:])
    two, three = report["2"], report["3"]
    # two raw stages (one gather in flight): fits, no spills, every dot on the tensor cores
    assert two["shared"] <= SM120_MAX_SHARED_BYTES, two
    assert two["stack"] == 0 and two["registers"] <= 255, two
    assert two["ops"]["HMMA"] > 0 and two["ops"]["LDGSTS"] > 0, two
    # a third 21 KB ring slot is over sm_120's 99 KB: the limit the design works within
    assert three["shared"] > SM120_MAX_SHARED_BYTES, three
