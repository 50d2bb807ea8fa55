"""The vLLM patch set: its builder, and our modules it ships into vLLM (beside mlafleet.kernels)."""
