"""Which of a pool's namespaces hold KV: one predicate for every reader that lists them.

Besides one namespace per model layout (KV blocks), a pool holds two kinds of side namespaces that
engines write: token records (token_records.py, for event consumers) and the coalescing writers'
clock records (coalesce_clock.py). Tools that pick "the model's namespace" (``cxlkv query``, the
events stream, tests) must skip both, or a single-model pool looks like two models and records
look like KV blocks.
"""

from __future__ import annotations

from typing import Any

from cxlkv.integrations.coalesce_clock import CLOCK_NAMESPACE
from cxlkv.integrations.token_records import is_record_namespace


def is_kv_namespace(info: dict) -> bool:
    """Whether a ``pool.namespaces()`` entry holds KV blocks (not token or clock records)."""
    return not is_record_namespace(info) and info.get("name") != CLOCK_NAMESPACE


def kv_namespaces(pool: Any) -> list[dict]:
    """``pool.namespaces()`` without the record namespaces: the namespaces that hold KV."""
    return [n for n in pool.namespaces() if is_kv_namespace(n)]
