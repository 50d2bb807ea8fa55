"""bench/sparse_mla.py runs end to end without a GPU (--cpu-dry-run): its correctness checks over
every config, the timed cases with the sweep, and the tables it writes. The device runs cost
minutes of a scarce budget; a script that breaks there (as it once did, on a removed config
field) must break here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sparse_mla_bench_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "sparse_mla.py", "--cpu-dry-run", "--sweep", "--out", str(tmp_path)],
                         cwd=REPO / "bench", env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "correctness: PASS" in run.stdout
    data = json.loads((tmp_path / "sparse_mla.json").read_text())
    from mlafleet.kernels.sparse_mla import CONFIGS
    checked = {c["impl"] for c in data["checks"]}
    assert len(checked) >= 3 + 2 * len(set(CONFIGS.values()))  # auto/unsplit/16 and every config x 2 splits
    assert {(r["cache"], r["s_q"], r["h_q"]) for r in data["results"]} == {
        (k, s, h) for k in ("bf16", "fp8") for s, h in ((1, 8), (2, 32))}
    assert all(r["ours_s"] > 0 and r["sweep_us"] for r in data["results"])
    table = (tmp_path / "sparse_mla.md").read_text()
    assert "sweep, fp8" in table and "| fp8 | 2 x 32 |" in table
