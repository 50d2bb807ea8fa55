"""nvidia_driver's minimum driver branch per GPU generation: real ansible-runner runs of the role's
validation (tasks_from validate, the first thing the role does) on the controller, one local host per case,
with GPU facts as preflight reports them (the GPUs cannot exist here)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from mlafleet.ops import runner

PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: nvidia_driver
        tasks_from: validate
"""

BLACKWELL = {"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "compute_capability": "12.0",
             "memory_mib": 97887, "driver_version": "none"}
GB10 = {"index": 0, "name": "NVIDIA GB10", "compute_capability": "12.1", "memory_mib": 0, "driver_version": "none"}
H200 = {"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0", "memory_mib": 143771, "driver_version": "none"}
LSPCI = {"index": 0, "name": "01:00.0 3D controller [0302]: NVIDIA Corporation GB202GL [RTX PRO 6000 Blackwell "
         "Workstation Edition] [10de:2bb1]", "compute_capability": "unknown", "memory_mib": 0, "driver_version": "none"}


def test_driver_branch_older_than_the_gpu_generation_needs_is_refused(tmp_path: Path) -> None:
    cases = {
        "blackwell-550": {"nvidia_driver_branch": "550", "nvidia_driver_version": "550.163.01", "gpus": [BLACKWELL]},
        "gb10-570": {"nvidia_driver_branch": "570", "nvidia_driver_version": "570.195.03", "gpus": [GB10]},
        "lspci-550": {"nvidia_driver_branch": "550", "nvidia_driver_version": "550.163.01", "gpus": [LSPCI]},
        "h200-550": {"nvidia_driver_branch": "550", "nvidia_driver_version": "550.163.01", "gpus": [H200]},
        "blackwell-570": {"nvidia_driver_branch": "570", "nvidia_driver_version": "570.195.03", "gpus": [BLACKWELL]},
        "gb10-580": {"gpus": [GB10, BLACKWELL]},  # the defaults: 580.95.05
    }
    hosts = "".join(
        f"    {name}: {json.dumps({'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable, 'nvidia_driver_gpus': c.pop('gpus'), **c})}\n"
        for name, c in cases.items())
    inv = tmp_path / "inventory.yml"
    inv.write_text("all:\n  vars:\n    preflight_os: {id: Debian, version_id: '12', major: '12', codename: bookworm}\n"
                   f"  hosts:\n{hosts}")
    (tmp_path / "validate.yml").write_text(PLAY)
    report = runner.run_playbook("plan", [inv], run="nv", out=io.StringIO(), playbook=str(tmp_path / "validate.yml"),
                                 runner_root=tmp_path / "runner", report_root=tmp_path / "reports")
    got = {h["host"]: h for h in report["hosts"]}
    cause = got["blackwell-550"]["cause"]
    assert got["blackwell-550"]["status"] == "failed"
    assert "nvidia_driver_branch 550 (nvidia_driver_version 550.163.01) refused" in cause
    assert "nothing was changed" in cause
    assert ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition (compute capability 12.0) is Blackwell and needs "
            "branch R570 or newer (R570 is the first driver branch with Blackwell support") in cause
    assert "pin a branch of at least R570" in cause
    cause = got["gb10-570"]["cause"]
    assert "NVIDIA GB10 (compute capability 12.1) is Blackwell GB10 (DGX Spark) and needs branch R580" in cause
    assert "R570 or newer" not in cause and "pin a branch of at least R580" in cause
    assert "compute capability unknown) is Blackwell and needs branch R570" in got["lspci-550"]["cause"]
    for name in ("h200-550", "blackwell-570", "gb10-580"):
        assert got[name]["status"] == "ok", (name, got[name]["cause"])


def test_gpu_facts_with_a_misnamed_or_missing_key_are_refused_by_name(tmp_path: Path) -> None:
    """nvidia_driver_gpus written by hand with nvidia-smi's field name (compute_cap) or without a name:
    the host fails with what is wrong and what a GPU entry holds, not with a template error."""
    misnamed = {k: v for k, v in BLACKWELL.items() if k != "compute_capability"} | {"compute_cap": "12.0"}
    cases = {
        "misnamed": [misnamed],
        "nameless": [H200, {"index": 1, "compute_capability": "9.0"}],
        "not-a-dict": ["NVIDIA H200"],
        "bad-cc": [H200 | {"compute_capability": "twelve"}],
        "good": [BLACKWELL, LSPCI],
    }
    hosts = "".join(
        f"    {name}: {json.dumps({'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable, 'nvidia_driver_gpus': gpus})}\n"
        for name, gpus in cases.items())
    inv = tmp_path / "inventory.yml"
    inv.write_text("all:\n  vars:\n    preflight_os: {id: Debian, version_id: '12', major: '12', codename: bookworm}\n"
                   f"  hosts:\n{hosts}")
    (tmp_path / "validate.yml").write_text(PLAY)
    report = runner.run_playbook("plan", [inv], run="nvgpus", out=io.StringIO(), playbook=str(tmp_path / "validate.yml"),
                                 runner_root=tmp_path / "runner", report_root=tmp_path / "reports")
    got = {h["host"]: h for h in report["hosts"]}
    assert got["good"]["status"] == "ok", got["good"]["cause"]
    for name in ("misnamed", "nameless", "not-a-dict", "bad-cc"):
        cause = got[name]["cause"]
        assert got[name]["status"] == "failed", name
        assert f"nvidia_driver_gpus on {name}" in cause and "nothing was changed" in cause, cause
        assert "index, name, compute_capability" in cause, cause  # what an entry holds
        assert "template" not in cause.lower() and "has no attribute" not in cause, cause
    assert ("GPU 0 (NVIDIA RTX PRO 6000 Blackwell Workstation Edition): lacks compute_capability"
            in got["misnamed"]["cause"]), got["misnamed"]["cause"]
    assert "unknown key compute_cap (did you mean compute_capability?)" in got["misnamed"]["cause"]
    assert "GPU 1: lacks name" in got["nameless"]["cause"] and "GPU 0" not in got["nameless"]["cause"]
    assert 'GPU 0 is not a mapping: "NVIDIA H200"' in got["not-a-dict"]["cause"], got["not-a-dict"]["cause"]
    assert "GPU 0 (NVIDIA H200): compute_capability 'twelve' is neither" in got["bad-cc"]["cause"], got["bad-cc"]["cause"]
