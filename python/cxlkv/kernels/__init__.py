"""Triton kernels of cxlkv's device data paths (optional: need torch and triton, imported only by
the modules that use them). paged.py: gather/scatter of vLLM's paged KV blocks <-> pool blocks."""
