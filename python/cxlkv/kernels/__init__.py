"""Triton kernels (optional: torch and triton are imported by the kernel modules only, never by
the core's import path). ``rows``: row gathers and scatters of the token store's hot buffer."""
