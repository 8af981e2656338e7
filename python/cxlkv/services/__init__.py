"""Services operators run against a live pool: ``cxlkv exporter`` (Prometheus), ``cxlkv events``
(the pool-wide KV-event stream), ``cxlkv query`` (prefix lookups, and its HTTP ``POST /query``),
``cxlkv top`` (live view), and ``pool_view`` (the pool read for them: an observer open, no node
slot). Apart from the benchmarks and demos of ``cxlkv.tools``: a service runs in production, for as
long as the operator keeps it. Services import the public API and ``cxlkv.integrations`` (the key
and token-record formats), never ``cxlkv.tools`` or ``cxlkv.cli`` (tests/python/test_layers.py)."""
