"""scripts/phase and scripts/phases-report: the time table .ci/run prints at the end of every run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_phase_is_recorded_with_its_seconds_and_exit_status_and_passes_the_status_on(tmp_path: Path) -> None:
    env = {**os.environ, "MLAFLEET_PHASES": str(tmp_path / "phases.tsv")}
    ok = subprocess.run([str(REPO / "scripts" / "phase"), "quick one", "true"], env=env, check=False)
    bad = subprocess.run([str(REPO / "scripts" / "phase"), "failing", "sh", "-c", "sleep 1; exit 3"], env=env,
                         check=False)
    assert ok.returncode == 0 and bad.returncode == 3
    rows = [line.split("\t") for line in (tmp_path / "phases.tsv").read_text().splitlines()]
    assert rows[0] == ["quick one", "0", "0"]
    assert rows[1][0] == "failing" and int(rows[1][1]) >= 1 and rows[1][2] == "3"


def test_the_report_prints_the_table_and_warns_over_budget_naming_the_slowest(tmp_path: Path) -> None:
    table = tmp_path / "phases.tsv"
    table.write_text("lint\t120\t0\npytest\t900\t0\nmolecule rollout\t1500\t0\nmolecule lines\t1300\t1\n")
    report = [str(REPO / "scripts" / "phases-report"), str(table)]
    under = subprocess.run(report + ["--total", "3900", "--budget", "4000"], capture_output=True, text=True, check=True)
    assert "molecule lines                 1300" in under.stdout and "other (not timed by phase)       80" in under.stdout
    assert "total" in under.stdout and "65 min 0 s" in under.stdout and under.stderr == ""
    over = subprocess.run(report + ["--total", "3900"], capture_output=True, text=True, check=True)
    assert "WARNING: this run took 65 min, over the 60-minute budget" in over.stderr
    assert "Slowest phases: molecule rollout 1500 s, molecule lines 1300 s, pytest 900 s" in over.stderr
