"""The ``tenant`` setting every integration takes (vLLM's kv_connector_extra_config, LMCache's
extra_config, SGLang's storage config): the quota label an engine's saves are charged to
(docs/ARCHITECTURE.md "Quotas", ``cxlkv pool quota``). A label only: it is never part of a key,
so engines of different tenants that serve the same model share each other's blocks."""

from __future__ import annotations

from typing import Any


def tenant_of(config: dict[str, Any], key: str = "tenant") -> str | None:
    """``config[key]``: a non-empty string, or None when absent/empty; anything else is refused
    at start-up (a typo must not silently run unlimited)."""
    value = config.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"cxlkv: {key} must be a string (a tenant name), not {value!r}")
    return value
