"""mlafleet: serve DeepSeek-Sparse-Attention models (GLM-5) with vLLM on Blackwell fleets."""

__version__ = "0.1.0"
