"""How a serving-group member is launched (roles/vllm_server templates, docs/multi-host.md): the
serve command, environment, unit and client settings each host gets, rendered through Ansible as
the role renders them (lookup('template') with the role's defaults and vars), for a head, a
worker, a Ray head and worker, and a single host, whose files must stay byte for byte what
tests/data/serve/ holds (rendered before serving groups existed; since then changed only by the
drain at stop and the bounded Restart=always of issue 45, docs/front-door.md).

The launcher (vllm-cli.py.j2) runs for real against vLLM's CPU build, whose `vllm` console script
fails (no distribution named vllm)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
ROLE = REPO / "roles" / "vllm_server"
GOLDEN = Path(__file__).resolve().parent / "data" / "serve"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
FILES = ("vllm-serve.sh.j2", "vllm.env.j2", "vllm.service.j2", "vllm-cli.py.j2")

RENDER = """
- hosts: all
  gather_facts: false
  vars_files:
    - {role}/defaults/main.yml
    - {role}/vars/main.yml
  tasks:
    - name: This host's settings (above the role's defaults, as inventory variables are)
      ansible.builtin.set_fact:
        "{{{{ item.key }}}}": "{{{{ item.value }}}}"
      loop: "{{{{ case | dict2items }}}}"
    - name: A directory per host
      ansible.builtin.file:
        path: "{{{{ out }}}}/{{{{ inventory_hostname }}}}"
        state: directory
        mode: "0755"
    - name: Render what the role renders
      ansible.builtin.copy:
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}/{{{{ item | basename | regex_replace('[.]j2$', '') }}}}"
        content: "{{{{ lookup('ansible.builtin.template', templates ~ '/' ~ item) }}}}"
        mode: "0644"
      loop: {files}
    - name: And the client settings (server.json, as tasks/config.yml writes them)
      ansible.builtin.copy:
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}/server.json"
        content: "{{{{ __vllm_server_client | to_nice_json }}}}\\n"
        mode: "0644"
"""

# Two single hosts: the role's defaults, and a production GGUF server with everything set.
SINGLE = {
    "plain": {"vllm_server_release_id": "0.32.0-5f268df039"},
    "gguf": {"vllm_server_release_id": "0.20.2-abcdef0123", "vllm_server_root": "/srv/mlafleet",
             "vllm_server_model": "/opt/mlafleet/models/glm-5/GLM-5-Q4_K_M-00001-of-00010.gguf",
             "vllm_server_hf_config_path": "/opt/mlafleet/models/glm-5/config",
             "vllm_server_tokenizer": "/opt/mlafleet/models/glm-5/config", "vllm_server_served_model_name": "glm-5",
             "vllm_server_host": "0.0.0.0", "vllm_server_port": 8100, "vllm_server_api_key": "k-0123456789",
             "vllm_server_args": ["--tensor-parallel-size=8", "--max-model-len=65536", "--enforce-eager"],
             "vllm_server_env": {"VLLM_LOGGING_LEVEL": "DEBUG"}, "vllm_server_triton_sparse_mla": True,
             "vllm_server_start_timeout": 3600, "vllm_server_shutdown_timeout": 600},
}


def member(rank: int, launch: str = "native", **over) -> dict:
    """preflight_serving_member of a member of group `pro` (two hosts, TP 4 x PP 2), as preflight sets it."""
    view = {"group": "pro", "head": "pro-01", "members": ["pro-01", "pro-02"], "workers": ["pro-02"], "nnodes": 2,
            "master_addr": "10.0.0.21", "master_port": 29501, "ray_port": 6379, "launch": launch, "tensor": 4,
            "pipeline": 2, "gpus_per_member": 4, "ok": True, "rank": rank, "is_head": rank == 0,
            "role": "head" if rank == 0 else "worker", "master_ip": "10.0.0.21",
            "host_ip": f"10.0.0.{21 + rank}", "ifname": "enp65s0f0"}
    return {**view, **over}


def render(tmp_path: Path, cases: dict[str, dict], templates: Path = ROLE / "templates",
           files: tuple[str, ...] = FILES) -> dict[str, dict[str, str]]:
    """host -> {file name: text}, each host's variables set as `cases` says."""
    inv = tmp_path / "inventory.yml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {name: {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable, "case": case}
        for name, case in cases.items()}}}))
    play = tmp_path / "render.yml"
    play.write_text(RENDER.format(role=ROLE, files=json.dumps(list(files))))
    out = tmp_path / "out"
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "MLAFLEET_REPORT_ROOT": str(tmp_path / "reports")}
    done = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(play), "-e",
                           json.dumps({"out": str(out), "templates": str(templates)})],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {name: {p.name: p.read_text() for p in (out / name).iterdir()} for name in cases}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    cases = {**SINGLE,
             "pro-01": {"vllm_server_release_id": "0.20.2-abcdef0123", "preflight_serving_member": member(0),
                        "vllm_server_host": "0.0.0.0", "vllm_server_api_key": "k-0123456789",
                        "vllm_server_args": ["--max-model-len=65536"],
                        "vllm_server_env": {"VLLM_CPU_OMP_THREADS_BIND": "0", "NCCL_IB_HCA": "mlx5_0"}},
             "pro-02": {"vllm_server_release_id": "0.20.2-abcdef0123", "preflight_serving_member": member(1),
                        "vllm_server_host": "0.0.0.0", "vllm_server_api_key": "k-0123456789",
                        "vllm_server_args": ["--max-model-len=65536"],
                        "vllm_server_env": {"VLLM_CPU_OMP_THREADS_BIND": "1", "NCCL_IB_HCA": "mlx5_0"}},
             "ray-01": {"vllm_server_release_id": "0.32.0-5f268df039", "preflight_serving_member": member(0, "ray"),
                        "vllm_server_start_timeout": 2400},
             "ray-02": {"vllm_server_release_id": "0.32.0-5f268df039", "preflight_serving_member": member(1, "ray")}}
    return render(tmp_path_factory.mktemp("render"), cases)


def serve_words(text: str) -> list[str]:
    """The serve script's last command (its exec line), as the shell splits it."""
    command = text[text.rindex("\nexec ") + 1:]
    return shlex.split(command.replace("\\\n", " "))


def env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


@pytest.mark.parametrize("host", sorted(SINGLE))
@pytest.mark.parametrize("name", ["vllm-serve.sh", "vllm.env", "vllm.service", "server.json"])
def test_a_single_host_is_served_byte_for_byte_as_the_golden_files_say(rendered, host, name):
    assert rendered[host][name] == (GOLDEN / host / name).read_text()


def test_the_head_and_the_worker_run_the_same_command_with_their_rank_and_the_worker_headless(rendered):
    head, worker = (serve_words(rendered[h]["vllm-serve.sh"]) for h in ("pro-01", "pro-02"))
    launcher = "/opt/mlafleet/releases/0.20.2-abcdef0123/mlafleet-vllm-cli.py"
    assert head[:4] == ["exec", "/opt/mlafleet/releases/0.20.2-abcdef0123/venv/bin/python", launcher, "serve"]
    assert head[4:] == ["--model=/opt/mlafleet/models/model", "--served-model-name=model", "--max-model-len=65536",
                        "--tensor-parallel-size=4", "--pipeline-parallel-size=2", "--nnodes=2", "--node-rank=0",
                        "--master-addr=10.0.0.21", "--master-port=29501", "--shutdown-timeout=120",
                        "--host=0.0.0.0", "--port=8000"]
    # the worker has no API server: nothing to drain
    assert worker == [w.replace("--node-rank=0", "--node-rank=1") for w in head[:-3]] + ["--headless"] + head[-2:]
    assert "api_server" not in rendered["pro-01"]["vllm-serve.sh"]  # it would ignore --headless


def test_each_member_names_its_cluster_address_and_interface_and_only_the_head_times_out(rendered):
    head, worker = env_of(rendered["pro-01"]["vllm.env"]), env_of(rendered["pro-02"]["vllm.env"])
    assert (head["VLLM_HOST_IP"], head["GLOO_SOCKET_IFNAME"], head["NCCL_SOCKET_IFNAME"]) == ("10.0.0.21", "enp65s0f0", "enp65s0f0")
    assert (worker["VLLM_HOST_IP"], worker["GLOO_SOCKET_IFNAME"], worker["NCCL_SOCKET_IFNAME"]) == ("10.0.0.22", "enp65s0f0", "enp65s0f0")
    assert (head["MLAFLEET_GROUP_FORM_TIMEOUT"], head["MLAFLEET_GROUP_HEALTH_URL"]) == ("1800", "http://127.0.0.1:8000/health")
    assert "MLAFLEET_GROUP_FORM_TIMEOUT" not in worker and "RAY_ADDRESS" not in worker
    # the operator's environment comes last (it may override), the CPU lab's thread binding among it
    assert (head["VLLM_CPU_OMP_THREADS_BIND"], worker["VLLM_CPU_OMP_THREADS_BIND"], worker["NCCL_IB_HCA"]) == ("0", "1", "mlx5_0")
    assert list(worker)[-2:] == ["NCCL_IB_HCA", "VLLM_CPU_OMP_THREADS_BIND"]


def test_a_members_unit_does_not_restart_alone_and_kills_a_head_that_ignores_sigterm(rendered):
    single, worker = rendered["gguf"]["vllm.service"], rendered["pro-02"]["vllm.service"]
    assert "Restart=always" in single and "KillMode=mixed" in single
    for line in ("Restart=no", "KillMode=mixed", "TimeoutStopSec=90", "SendSIGKILL=yes", "TimeoutStartSec=1800"):
        assert f"\n{line}\n" in worker
    assert "Restart=always" not in worker and "RestartSec" not in worker and "StartLimit" not in worker
    assert "ProtectSystem=strict" in worker  # hardened like a single host's
    hardening = single[single.index("NoNewPrivileges"):single.index("[Install]")]
    assert hardening in worker


def unit_of(text: str) -> dict[str, dict[str, str]]:
    """section -> {key: value} of a rendered systemd unit (comments and blank lines left out)."""
    sections: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            current[key] = value
    return sections


@pytest.mark.parametrize(("host", "drain"), [("plain", 120), ("gguf", 600)])
def test_a_single_host_drains_at_stop_and_comes_back_whatever_its_exit_status(rendered, host, drain):
    """Issue 45's measured defects: with KillMode=control-group systemd's SIGTERM reached the engine
    too and cut every stream; vLLM exits 0 when its engine dies, which Restart=on-failure ignores."""
    unit = unit_of(rendered[host]["vllm.service"])
    service = unit["Service"]
    # vLLM's drain is in the release's serve file (a rollback restores it), the unit stops after it
    assert f"--shutdown-timeout={drain}" in serve_words(rendered[host]["vllm-serve.sh"])
    assert service["KillMode"] == "mixed"
    assert int(service["TimeoutStopSec"]) == drain + 30
    assert service["Restart"] == "always" and service["RestartSec"] == "10"
    assert (unit["Unit"]["StartLimitIntervalSec"], unit["Unit"]["StartLimitBurst"]) == ("1800", "5")


def test_a_group_head_drains_within_its_stop_timeout_and_a_worker_keeps_its_own(rendered):
    head, worker = (unit_of(rendered[h]["vllm.service"])["Service"] for h in ("pro-01", "pro-02"))
    assert (head["KillMode"], head["TimeoutStopSec"], head["Restart"]) == ("mixed", "150", "no")
    assert (worker["KillMode"], worker["TimeoutStopSec"], worker["Restart"]) == ("mixed", "90", "no")
    assert "--shutdown-timeout" not in rendered["pro-02"]["vllm-serve.sh"]


def test_a_rollback_writes_the_unit_of_the_state_it_restores(rendered, tmp_path: Path):
    """A rollback gathers no preflight facts: the unit follows the restored state's own server.json.
    A worker rolled back keeps a member's unit (no restart of its own; found by molecule/lines step 9,
    where the group's units written as a single host's made the re-run after a rollback restart the
    group), and a host whose facts say member today but that restores a single host's state gets a
    single host's unit."""
    worker_case = {"vllm_server_release_id": "0.20.2-abcdef0123", "vllm_server_host": "0.0.0.0",
                   "vllm_server_api_key": "k-0123456789", "vllm_server_args": ["--max-model-len=65536"]}
    got = render(tmp_path, {
        "pro-02": {**worker_case, "vllm_server_restored": {**json.loads(rendered["pro-02"]["server.json"]),
                                                            "api_key": "k-0123456789"}},
        "plain": {**SINGLE["plain"], "preflight_serving_member": member(1),
                  "vllm_server_restored": {**json.loads(rendered["plain"]["server.json"]), "api_key": ""}},
    }, files=("vllm.service.j2",))
    assert got["pro-02"]["vllm.service"] == rendered["pro-02"]["vllm.service"]
    assert unit_of(got["pro-02"]["vllm.service"])["Service"]["Restart"] == "no"
    assert got["plain"]["vllm.service"] == rendered["plain"]["vllm.service"]


def test_client_settings_name_the_group_and_single_hosts_keep_theirs(rendered):
    assert json.loads(rendered["pro-02"]["server.json"]) == {
        "host": "127.0.0.1", "port": 8000, "served_model_name": "model",
        "group": {"name": "pro", "role": "worker", "rank": 1, "head": "pro-01", "members": ["pro-01", "pro-02"]}}


def test_ray_runs_a_worker_node_on_the_workers_and_the_head_serves_on_the_cluster(rendered):
    worker = serve_words(rendered["ray-02"]["vllm-serve.sh"])
    assert worker == ["exec", "/opt/mlafleet/releases/0.32.0-5f268df039/venv/bin/ray", "start", "--block",
                      "--address=10.0.0.21:6379", "--node-ip-address=10.0.0.22", "--temp-dir=/var/lib/vllm/ray"]
    text = rendered["ray-01"]["vllm-serve.sh"]
    start = text[text.index("/venv/bin/ray start --head"):text.index("|| exit 1")].replace("\\\n", " ").split()
    assert start == ["/venv/bin/ray", "start", "--head", "--port=6379", "--node-ip-address=10.0.0.21",
                     "--include-dashboard=false", "--disable-usage-stats", "--temp-dir=/var/lib/vllm/ray"]
    head = serve_words(text)
    assert "--distributed-executor-backend=ray" in head and "--tensor-parallel-size=4" in head
    assert not [w for w in head if w.startswith(("--nnodes", "--node-rank", "--master-", "--headless"))]
    env = env_of(rendered["ray-01"]["vllm.env"])
    assert (env["RAY_ADDRESS"], env["MLAFLEET_RAY_NODES"], env["MLAFLEET_RAY_GPUS"]) == ("10.0.0.21:6379", "2", "8")
    assert env["MLAFLEET_GROUP_FORM_TIMEOUT"] == "2400"
    assert "RAY_ADDRESS" not in env_of(rendered["ray-02"]["vllm.env"])


def test_the_rendered_scripts_are_valid_shell_and_python(rendered, tmp_path: Path):
    for host in ("pro-01", "pro-02", "ray-01", "ray-02", "plain"):
        script = tmp_path / f"{host}.sh"
        script.write_text(rendered[host]["vllm-serve.sh"])
        done = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, (host, done.stderr)
    compile(rendered["pro-01"]["vllm-cli.py"], "vllm-cli.py", "exec")


# --- the launcher itself -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launcher(rendered, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("launcher") / "mlafleet-vllm-cli.py"
    path.write_text(rendered["pro-01"]["vllm-cli.py"])
    return path


@pytest.mark.parametrize("line", ["0.20.2", "0.32.0"])
def test_the_launcher_runs_vllms_cli_under_the_cpu_build_where_the_console_script_fails(launcher, line, request):
    python = request.getfixturevalue("vllm_python" if line == "0.20.2" else "vllm_python_032")
    script = Path(python).parent / "vllm"
    if line == "0.32.0":  # the console script vllm-cpu installs looks for a distribution named vllm (both lines)
        broken = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=300, check=False)
        assert broken.returncode != 0 and "No package metadata was found for vllm" in broken.stderr
    done = subprocess.run([python, str(launcher), "--version"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"{line}+cpu"


def test_the_launcher_changes_nothing_where_vllm_is_installed_and_lists_no_distribution_twice(launcher, tmp_path):
    """Outside vLLM: a Python without vllm-cpu gets no answer for "vllm"; a listing of every
    distribution is the same with the launcher's finder installed."""
    code = ("import importlib.metadata as m, runpy, sys; before = sorted(d.metadata['Name'] for d in m.distributions());"
            f"ns = runpy.run_path({str(launcher)!r}); after = sorted(d.metadata['Name'] for d in m.distributions());"
            "print(before == after, ns['answer_for_vllm_cpu']())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.split() == ["True", "False"], done.stderr


class Health(ThreadingHTTPServer):
    daemon_threads = True
    answer = 503


class HealthHandler(BaseHTTPRequestHandler):
    server: Health

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(self.server.answer)
        self.end_headers()


def start_head(launcher: Path, url: str, seconds: float) -> subprocess.Popen:
    """The launcher's formation watch as a head runs it: in its own process group (as under systemd),
    with a child process standing for vLLM's engine (a real process it started)."""
    code = (f"import runpy, subprocess, sys; ns = runpy.run_path({str(launcher)!r});"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            "print(child.pid, flush=True);"
            f"ns['end_group_unless_formed']({url!r}, {seconds}, interval=0.2); print('formed', flush=True);"
            "child.kill()")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_head_whose_group_does_not_form_ends_itself_and_its_processes(launcher):
    server = Health(("127.0.0.1", 0), HealthHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        head = start_head(launcher, url, 2)  # /health answers 503 throughout: the group never forms
        child = int(head.stdout.readline())
        _, err = head.communicate(timeout=60)
        assert head.returncode == -signal.SIGKILL
        assert "the serving group did not form within 2 s (still waiting for the server's /health; no answer from" in err
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child)
        server.answer = 200  # a group that forms: the watch returns and ends nothing
        head = start_head(launcher, url, 30)
        out, _ = head.communicate(timeout=60)
        assert head.returncode == 0 and out.split()[-1] == "formed"
    finally:
        server.shutdown()


def free_port() -> int:
    """A free port below the kernel's ephemeral range: an ephemeral one, free now, may be taken by
    one of the sockets vLLM opens before the server binds it."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


