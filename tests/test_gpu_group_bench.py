"""bench/gpu_group.sh (issue 44) renders each process of its GPU runs through the roles' own
templates and preflight's serving_groups filter (bench/gpu_group.yml): its `render` mode, which
needs no GPU, is what the device runs before starting anything. These check the files it renders
for the two-GPU layout (two "nodes" on one host) and the one-GPU one (a group of one)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def render(tmp_path: Path, shape: str) -> dict[str, dict[str, str]]:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "venv" / "bin").mkdir(parents=True)
    env = {**os.environ, "E2E_WORK": str(work), "E2E_ANSIBLE_PLAYBOOK": str(Path(sys.executable).parent / "ansible-playbook")}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_group.sh"), "render", str(out), shape], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files: dict[str, dict[str, str]] = {}
    for path in out.iterdir():
        if path.suffix in (".serve", ".env"):
            files.setdefault(path.stem, {})[path.suffix[1:]] = path.read_text()
    return files


def words(serve: str) -> list[str]:
    """The serve script's last command (what it execs), as the shell splits it."""
    return shlex.split(serve[serve.rindex("\nexec ") + 6:].replace("\\\n", " "))


def env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    return render(tmp_path_factory.mktemp("two"), "two")


def test_two_gpus_a_native_group_of_two_processes_at_tp2(two):
    head, worker = words(two["native-0"]["serve"]), words(two["native-1"]["serve"])
    for argv, rank in ((head, "0"), (worker, "1")):
        assert argv[2] == "serve" and argv[1].endswith("/releases/0.32.0-gpu/mlafleet-vllm-cli.py")
        assert {"--nnodes=2", f"--node-rank={rank}", "--master-addr=127.0.0.1", "--master-port=29511",
                "--tensor-parallel-size=2", "--pipeline-parallel-size=1", "--attention-backend=TRITON_MLA_SPARSE"} <= set(argv)
    assert "--headless" in worker and "--headless" not in head
    assert "--port=8100" in head
    for name in ("native-0", "native-1"):
        e = env(two[name]["env"])
        assert (e["VLLM_HOST_IP"], e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) == ("127.0.0.1", "lo", "lo")
        assert e["NCCL_NVLS_ENABLE"] == "0" and e["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert env(two["native-0"]["env"])["MLAFLEET_GROUP_HEALTH_URL"] == "http://127.0.0.1:8100/health"


def test_two_gpus_the_reference_is_one_process_at_tp2_and_pipeline_parallel_splits_the_layers(two):
    ref = words(two["ref-0"]["serve"])
    assert ref[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--tensor-parallel-size=2" in ref
    assert not any(w.startswith(("--nnodes", "--node-rank")) for w in ref)
    assert "VLLM_HOST_IP" not in env(two["ref-0"]["env"])
    for name in ("pp-0", "pp-1"):
        assert {"--tensor-parallel-size=1", "--pipeline-parallel-size=2", "--nnodes=2"} <= set(words(two[name]["serve"]))


def test_two_gpus_on_ray_the_head_starts_the_cluster_and_the_worker_joins_it(two):
    head_text, worker = two["ray-0"]["serve"], words(two["ray-1"]["serve"])
    assert "ray start --head --port=6390" in head_text
    assert "--distributed-executor-backend=ray" in words(head_text)
    assert worker[1:4] == ["start", "--block", "--address=127.0.0.1:6390"] and worker[0].endswith("/venv/bin/ray")
    e = env(two["ray-0"]["env"])
    assert (e["RAY_ADDRESS"], e["MLAFLEET_RAY_NODES"], e["MLAFLEET_RAY_GPUS"]) == ("127.0.0.1:6390", "2", "2")


def test_one_gpu_a_group_of_one_node_native_and_on_ray(tmp_path):
    one = render(tmp_path, "one")
    assert set(one) == {"ref-0", "native-0", "ray-0"}
    native = words(one["native-0"]["serve"])
    assert {"--nnodes=1", "--node-rank=0", "--tensor-parallel-size=1"} <= set(native) and "--headless" not in native
    e = env(one["ray-0"]["env"])
    assert (e["MLAFLEET_RAY_NODES"], e["MLAFLEET_RAY_GPUS"]) == ("1", "1")


def run_of(name: str, tokens: list[int], tops: list[dict[str, float]]) -> dict:
    """A run as `group_tokens.py tokens` writes it: one prompt, token k's text is "t<id>"."""
    return {"name": name, "prompt_words": [700], "tokens": [tokens],
            "steps": [[{"text": f"t{t}", "top": top} for t, top in zip(tokens, tops, strict=True)]]}


def test_the_token_comparison_passes_a_near_tie_and_fails_a_real_difference(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import group_tokens
    finally:
        sys.path.remove(str(REPO / "bench"))
    steady = {"t1600": -0.10, "t261": -2.5}
    # as on the H100: both runs rank 1600 and 261 first and second, 0.01 nats apart, and break it differently
    ref = run_of("ref", [1600, 1600, 261, 261], [steady, steady, {"t261": -0.69, "t1600": -0.70}, {"t261": -0.1}])
    tie = run_of("native", [1600, 1600, 1600, 261], [steady, steady, {"t1600": -0.69, "t261": -0.70}, {"t261": -0.1}])
    far = run_of("far", [1600, 1600, 1600, 261], [steady, steady, {"t1600": -0.2, "t261": -1.9}, {"t261": -0.1}])
    bare = {**far, "name": "bare", "steps": [[]]}  # a server that returned no logprobs
    assert group_tokens.compare(ref, ref) == ["| ref | ref | 0 (700 words) | 4/4 | equal |"]
    assert group_tokens.compare(ref, tie) == ["| native | ref | 0 (700 words) | 3/4 | near tie at step 2 (0.0100 nats), equal before it |"]
    assert group_tokens.compare(ref, tie, tie=0.005)[0].endswith("| first differs at step 2 (0.0100 nats apart) |")
    assert group_tokens.compare(ref, far)[0].endswith("| first differs at step 2 (1.7000 nats apart) |")
    assert group_tokens.compare(ref, bare)[0].endswith("| first differs at step 2 |")
    paths = []
    for run in (ref, tie, far):
        paths.append(tmp_path / f"{run['name']}.json")
        paths[-1].write_text(json.dumps(run))
    script = [sys.executable, str(REPO / "bench" / "group_tokens.py"), "compare"]
    assert subprocess.run([*script, paths[0], paths[1]], capture_output=True, check=False).returncode == 0
    done = subprocess.run([*script, *paths], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "near tie at step 2" in done.stdout and "1.7000 nats apart" in done.stdout
