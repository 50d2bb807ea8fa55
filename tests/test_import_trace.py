"""bench/import_trace.py: the hook records what a real process (and a process it spawns) imported,
and the report names the distributions the GPU image's list lacks, unless a --have file names them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "bench" / "import_trace.py"

# the parent imports ansible (ansible-core: not on the image); a spawned child imports jinja2 (on it)
PROGRAM = """
import multiprocessing as mp
def child():
    import jinja2
if __name__ == "__main__":
    import ansible
    p = mp.get_context("spawn").Process(target=child); p.start(); p.join()
"""


def _report(trace_dir: Path, *have: Path) -> subprocess.CompletedProcess:
    extra = [a for h in have for a in ("--have", str(h))]
    return subprocess.run([sys.executable, str(TRACE), "report", str(trace_dir), "--python", sys.executable, *extra],
                          capture_output=True, text=True, timeout=120)


def test_trace_names_what_the_image_lacks(tmp_path):
    trace = tmp_path / "trace"
    subprocess.run([sys.executable, str(TRACE), "hook", str(trace)], check=True, capture_output=True)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(trace))
    subprocess.run([sys.executable, str(prog)], check=True, env=env, timeout=120)
    records = sorted(trace.glob("modules-*.txt"))
    assert len(records) >= 2, records  # the parent, its spawned child (and spawn's resource tracker)
    assert any("jinja2" in r.read_text().split() for r in records)

    first = _report(trace)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "ansible-core  (imports ansible)" in first.stdout
    listed = [line.split()[0].lower() for line in first.stdout.splitlines()[1:]]
    assert "ansible-core" in listed and "jinja2" not in listed  # jinja2 is on the image's list

    have = tmp_path / "bundle.txt"
    have.write_text("ansible_core==2.19.14\n")
    second = _report(trace, have)
    assert "ansible-core" not in second.stdout, second.stdout


def test_report_without_records_says_how(tmp_path):
    r = _report(tmp_path)
    assert r.returncode == 2
    assert "PYTHONPATH=" in r.stderr and "modules-*.txt" in r.stderr
