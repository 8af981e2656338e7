"""The programs behind ``cxlkv bench`` and ``cxlkv demo``: benchmarks, demos and their worker
processes. Each returns its result (a JSON-able dict) and raises
:class:`cxlkv.errors.CommandError` for a failure worth one line; printing JSON and choosing the
exit code are the CLI's. Tools import only the public API, ``tools._common``, ``tools.workers``
and ``cxlkv.testing`` (test models): never ``cxlkv.cli`` (tests/python/test_layers.py).
"""
