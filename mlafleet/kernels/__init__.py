"""Triton kernels of the patch set. Modules here import only torch and triton."""
