"""Seed an offline Hugging Face cache with the model configs vLLM's own backend tests ask for.

    python bench/hf_offline_config.py HF_HOME     then run the tests with HF_HOME=HF_HOME HF_HUB_OFFLINE=1

vLLM's tests/v1/attention/test_sparse_mla_backends.py builds its VllmConfig from the model name
"deepseek-ai/DeepSeek-V2-Lite-Chat", so ModelConfig reads that model's config.json from the hub
(then the test replaces the attention dimensions with its own); 0.32.0's file also builds one
from "Qwen/Qwen3.5-0.8B" (test_index_group_convert_during_piecewise_capture, which needs only a
forward context). The GPU machine reaches no hub: this writes a config.json of each name into
the cache layout huggingface_hub reads offline (hub/models--<org>--<name>/refs/main and
snapshots/<revision>/). The values are the models' published architecture as far as the model
cards give it (DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, MLA with kv_lora_rank 512, no
q_lora, 64 routed experts; Qwen3.5-0.8B: 24 hybrid layers, one in four full attention, hidden
1024, 8 heads, 2 KV heads of 256, vocabulary 248320, 262144 positions; the rest transformers'
defaults). Each is a STAND-IN written by us, not the hub's file, and carries no weights or tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REVISION = "0" * 40  # a fixed snapshot name: nothing here is the hub's own revision

CONFIGS: dict[str, dict] = {
    "deepseek-ai/DeepSeek-V2-Lite-Chat": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen3.5-0.8B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        },
        "vision_config": {"model_type": "qwen3_5_vision", "out_hidden_size": 1024},
        "torch_dtype": "bfloat16",
    },
}


def seed(hf_home: Path) -> list[Path]:
    written = []
    for name, config in CONFIGS.items():
        repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        path = snapshot / "config.json"
        path.write_text(json.dumps(config, indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hf_offline_config.py HF_HOME")
    for p in seed(Path(sys.argv[1])):
        print(p)
