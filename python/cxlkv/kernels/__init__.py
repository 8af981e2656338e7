"""Triton kernels of cxlkv's device data paths (optional: torch and triton are imported only by
the modules that use them, never by the core's import path). ``paged``: gather/scatter of vLLM's
paged KV blocks <-> pool blocks; ``rows``: row gathers and scatters of the token store's hot
buffer."""
