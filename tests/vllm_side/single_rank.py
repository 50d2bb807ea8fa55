"""What the vLLM-side load scripts share (run by a vLLM interpreter; imported from the script's own
directory, or from PYTHONPATH by the script in tests/test_gguf_vllm.py): the names
GlmMoeDsaForCausalLM.load_weights reports, and one CPU rank (gloo) with the engine's config current,
in which a loader builds and loads the model."""

import contextlib
import os


def record_loaded_names(model_cls, loaded: dict) -> None:
    """Wrap model_cls.load_weights so that loaded["names"] holds the sorted names it returned."""
    original = model_cls.load_weights

    def spy(self, weights):
        names = original(self, weights)
        loaded["names"] = sorted(names)
        return names

    model_cls.load_weights = spy


@contextlib.contextmanager
def single_cpu_rank(vllm_config):
    """vllm_config current, a one-rank gloo group and model parallel 1 x 1, the CPU workspace."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.workspace import init_workspace_manager

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:%d" % (29500 + os.getpid() % 1000),
                                     backend="gloo")
        initialize_model_parallel(1, 1)
        init_workspace_manager(torch.device("cpu"))
        yield
