"""The connector's series on each vLLM engine's ``/metrics`` (``vllm:cxlkv_*``).

vLLM builds them through ``CxlKVConnector.build_prom_metrics`` in the process that serves
``/metrics`` and feeds every step's ``CxlKVStats.data`` (summed over the workers) to
:meth:`CxlKVPromMetrics.observe`. The stats keys (``STAT_KEYS``) and the per-interval
stats object (``CxlKVStats``) are defined here too, beside the series they map to. Hits also reach vLLM's own
``vllm:external_prefix_cache_queries`` / ``_hits`` and ``vllm:prompt_tokens_cached_by_source``
(the scheduler counts a connector's matched tokens as an external source by itself).

Units are base units (tokens, blocks, bytes, seconds); counters end in ``_total`` on the wire.
docs/METRICS.md lists every series.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from cxlkv.integrations.coalesce import FALLBACK_CAUSES
from cxlkv.integrations.coalesce import STAT_KEYS as COALESCE_STAT_KEYS

# The connector's counters (both sides: the scheduler's travel to the worker with each step).
STAT_KEYS = (
    "load_blocks",
    "load_failed_blocks",
    "load_bytes",
    "load_s",
    "store_blocks",
    "store_failed_blocks",
    "store_bytes",
    "store_s",
    "stores_dropped_after_failed_load",
    "stores_waited_at_preemption",
    "pin_capped_requests",
    "pin_capped_blocks",
    "uncacheable_requests",
    "pool_disabled",
    "pool_fenced",
    "lookup_tokens",
    "hit_tokens",
    "load_failed_unavailable_blocks",
    *COALESCE_STAT_KEYS,
)

# name (without "vllm:" and "_total") -> (stats key, help). Plain counters, one per engine.
COUNTERS = {
    "cxlkv_lookup_tokens": (
        "lookup_tokens",
        (
            "Prompt tokens the connector looked up in the pool (whole blocks past the locally "
            "computed ones; the hit ratio's denominator)."
        ),
    ),
    "cxlkv_hit_tokens": (
        "hit_tokens",
        "Prompt tokens found in the pool and offered to the scheduler (the hit ratio's numerator).",
    ),
    "cxlkv_load_bytes": ("load_bytes", "Bytes of KV copied from the pool into vLLM's KV cache."),
    "cxlkv_store_bytes": ("store_bytes", "Bytes of KV copied from vLLM's KV cache into the pool."),
    "cxlkv_load_blocks": ("load_blocks", "KV blocks loaded from the pool."),
    "cxlkv_coalesce_intents": (
        "coalesce_intents",
        "Intent markers taken: requests that computed a new prefix other engines could wait for.",
    ),
    "cxlkv_coalesce_waits": (
        "coalesce_waits",
        "Requests that waited for prompt blocks another engine was computing (coalescing).",
    ),
    "cxlkv_coalesce_declined": (
        "coalesce_declined",
        "Requests that computed prompt blocks another engine was computing: waiting was not clearly shorter.",
    ),
    "cxlkv_coalesced_blocks": (
        "coalesced_blocks",
        "KV blocks a waiting request loaded once another engine had computed them.",
    ),
    "cxlkv_coalesce_recomputed_blocks": (
        "coalesce_recomputed_blocks",
        "KV blocks a waiting request recomputed after its wait gave up.",
    ),
    "cxlkv_coalesce_saved_tokens": (
        "coalesce_saved_tokens",
        "Prompt tokens a waiting request loaded once another engine had computed them (prefill saved).",
    ),
    "cxlkv_coalesce_partial_loads": (
        "coalesce_partial_loads",
        (
            "Waits that loaded part of the prompt's missing blocks and computed the rest (blocks "
            "no intent covered, or left when the wait gave up)."
        ),
    ),
    "cxlkv_coalesce_uncovered_blocks": (
        "coalesce_uncovered_blocks",
        "Missing prompt blocks of waiting requests that no other engine's intent covered: computed at once.",
    ),
    "cxlkv_coalesce_wait_seconds": (
        "coalesce_wait_s",
        "Seconds requests spent waiting for blocks another engine was computing.",
    ),
    "cxlkv_uncacheable_requests": (
        "uncacheable_requests",
        "Requests the connector does not cache (no key derivable, e.g. unsupported inputs).",
    ),
}

# Counters with a label: name -> (label, {label value: stats key}).
STORE_OUTCOMES = {
    "stored": "store_blocks",
    "pool_full": "store_failed_blocks",
    "dropped_after_failed_load": "stores_dropped_after_failed_load",
    "pin_capped": "pin_capped_blocks",
}
LOAD_FAILURE_CAUSES = ("missing_or_corrupt", "pool_unavailable")
POOL_EVENTS = {"disabled": "pool_disabled", "fenced": "pool_fenced"}
# Waits for another engine's blocks that gave up, by cause (coalesce.py).
COALESCE_FALLBACKS = {cause: f"coalesce_fallback_{cause}" for cause in FALLBACK_CAUSES}

# A hybrid model's blocks per KV cache group (vllm_groups.py), by outcome: stats keys
# "<prefix><group index>", made by the connector as groups are seen.
GROUP_OUTCOMES = {
    "stored": "store_blocks_group",
    "skipped": "skip_blocks_group",
    "loaded": "load_blocks_group",
}

# Histograms of one copy (a batch of blocks of one request): stats key of the per-op list.
HISTOGRAMS = {
    "cxlkv_load_seconds": ("load_op_s", "Seconds one load (a request's batch of blocks) took."),
    "cxlkv_store_seconds": ("store_op_s", "Seconds one store (a request's batch of blocks) took."),
}
OP_TIME_KEYS = tuple(key for key, _ in HISTOGRAMS.values())
COPY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def load_failures(data: dict[str, Any]) -> dict[str, int]:
    """Failed block loads by cause: the pool could not be used at all, or blocks were gone
    (evicted meanwhile) or failed their checksum (the core tells these apart only in its own
    counters: ``cxlkv_checksum_failures_total`` on the pool exporter)."""
    total = int(data.get("load_failed_blocks", 0))
    unavailable = int(data.get("load_failed_unavailable_blocks", 0))
    return {"missing_or_corrupt": max(0, total - unavailable), "pool_unavailable": unavailable}


class CxlKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types the classes as a union of the three; each is used as the one it is.
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self._counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter(name=f"vllm:{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, (key, doc) in COUNTERS.items()
        }
        self._store = self._labelled(
            "vllm:cxlkv_store_outcome_blocks",
            "KV blocks the connector meant to store, by outcome: stored; pool_full (no block "
            "could be allocated or evicted); dropped_after_failed_load (computed on top of a "
            "load that failed: never published); pin_capped (blocks in the pool a lookup could "
            "not pin: the pool's pin slots were exhausted).",
            "outcome",
            tuple(STORE_OUTCOMES),
        )
        self._load_failed = self._labelled(
            "vllm:cxlkv_load_failed_blocks",
            "KV blocks that failed to load (vLLM recomputes them), by cause: missing_or_corrupt "
            "(evicted after the lookup, or a checksum mismatch); pool_unavailable (the pool "
            "could not be used: failed, replaced, or this node fenced).",
            "cause",
            LOAD_FAILURE_CAUSES,
        )
        self._pool_events = self._labelled(
            "vllm:cxlkv_pool_events",
            "Pool events of this engine: disabled (the pool failed; serving without the cache), "
            "fenced (the node was reclaimed; the connector reattached).",
            "event",
            tuple(POOL_EVENTS),
        )
        self._coalesce_fallbacks = self._labelled(
            "vllm:cxlkv_coalesce_fallbacks",
            "Waits for blocks another engine was computing that gave up and recomputed, by cause: "
            "writer_gone (the first missing block's intent was released or reclaimed: the writer "
            "finished short, was preempted, or died); stalled (no new block for twice a chunk's "
            "estimated compute); deadline (the estimated time to compute the blocks waited for, "
            "from this engine's prefill rate, or coalesce_wait_s); pool_unavailable.",
            "cause",
            tuple(COALESCE_FALLBACKS),
        )
        self._groups: Any = self._counter_cls(
            name="vllm:cxlkv_group_blocks",
            documentation=(
                "A hybrid model's KV blocks per KV cache group, by outcome: stored; skipped (a "
                "sliding-window block or SSM state no later hit can use: never stored); loaded."
            ),
            labelnames=[*self._labelnames, "group", "outcome"],
        )
        self._histograms: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                histogram(
                    name=f"vllm:{name}", documentation=doc, labelnames=labelnames, buckets=COPY_BUCKETS
                ),
                per_engine_labelvalues,
            )
            for name, (key, doc) in HISTOGRAMS.items()
        }

    def _labelled(self, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict:
        """{engine: {value: child}}: every child made now, so each series exists from 0."""
        metric: Any = self._counter_cls(name=name, documentation=doc, labelnames=[*self._labelnames, label])
        return {
            idx: {v: metric.labels(*labelvalues, v) for v in values}
            for idx, labelvalues in self.per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = transfer_stats_data
        for key, per_engine in self._counters.items():
            if data.get(key):
                per_engine[engine_idx].inc(data[key])
        for outcome, key in STORE_OUTCOMES.items():
            if data.get(key):
                self._store[engine_idx][outcome].inc(data[key])
        for cause, n in load_failures(data).items():
            if n:
                self._load_failed[engine_idx][cause].inc(n)
        for event, key in POOL_EVENTS.items():
            if data.get(key):
                self._pool_events[engine_idx][event].inc(data[key])
        for cause, key in COALESCE_FALLBACKS.items():
            if data.get(key):
                self._coalesce_fallbacks[engine_idx][cause].inc(data[key])
        for outcome, prefix in GROUP_OUTCOMES.items():
            for key, n in data.items():
                if key.startswith(prefix) and key[len(prefix) :].isdigit() and n:
                    labels = self.per_engine_labelvalues[engine_idx]
                    self._groups.labels(*labels, key[len(prefix) :], outcome).inc(n)
        for key, per_engine in self._histograms.items():
            for seconds in data.get(key) or ():
                per_engine[engine_idx].observe(float(seconds))


@dataclasses.dataclass
class CxlKVStats(KVConnectorStats):
    """Per-interval counters of the connector, aggregated by vLLM's stats logger."""

    def __post_init__(self):
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)
        for k in OP_TIME_KEYS:  # seconds of each copy, for the histograms
            self.data.setdefault(k, [])

    def reset(self):
        for k in self.data:
            self.data[k] = [] if isinstance(self.data[k], list) else 0

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict:
        d = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        d["load_gbps"] = round(d["load_bytes"] / d["load_s"] / 1e9, 3) if d["load_s"] else 0.0
        d["store_gbps"] = round(d["store_bytes"] / d["store_s"] / 1e9, 3) if d["store_s"] else 0.0
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())
