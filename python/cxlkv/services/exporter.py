"""``cxlkv exporter``: a Prometheus exporter of a whole pool.

A custom collector reads the pool at scrape time (pool_view.read_pool: an observer open, no
node slot) and turns the public API's dicts into ``cxlkv_*`` series in base units (bytes,
seconds, blocks), counters ending in ``_total``. A pool that is absent, being recreated or
unreadable gives ``cxlkv_up 0`` and the exporter keeps serving. docs/METRICS.md lists every
series. Works with prometheus_client 0.24.1 (LMCache's pin) and newer: it uses only
``CollectorRegistry``, ``*MetricFamily`` and ``start_http_server``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

from cxlkv import _core
from cxlkv.services.pool_view import PoolSnapshot, lease_missed, quota_subject, read_pool


def counter_series_name(name: str) -> str:
    """The series (without ``_total``) of the pool counter ``name``: ``cxlkv_<name>``, a unit
    moved to the end as Prometheus wants it (``bytes_stored`` -> ``cxlkv_stored_bytes``)."""
    if name.startswith("bytes_"):
        return f"cxlkv_{name[len('bytes_') :]}_bytes"
    return f"cxlkv_{name}"


def counter_table() -> list[tuple[str, str, str]]:
    """(Pool.stats() key, series without ``_total``, help) of every pool counter, in the core's
    order: derived from the core's one counter list (format.h, ``_core.counter_info()``), so a
    counter the core adds is exported with its meaning and without a change here."""
    return [(n, counter_series_name(n), what[0].upper() + what[1:] + ".") for n, what in _core.counter_info()]


VERDICTS = ("alive", "dead", "undecided")


def _family(kind: str, name: str, doc: str, labels: tuple[str, ...] = (), unit: str = ""):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "info": InfoMetricFamily}[kind]
    if kind == "info":
        return cls(name, doc, labels=list(labels))
    return cls(name, doc, labels=list(labels), unit=unit)


class PoolCollector:
    """Reads the pool at each scrape; never raises (a failed read is ``cxlkv_up 0``)."""

    def __init__(self, path: str, allow_foreign_owner: bool = False) -> None:
        self.path = path
        self.allow_foreign_owner = allow_foreign_owner
        self._lock = threading.Lock()  # scrapes may overlap (one thread per request)

    def describe(self) -> list:
        return []  # unchecked collector: the series depend on the pool read at scrape time

    def collect(self) -> Iterator:
        with self._lock:
            snap = read_pool(self.path, self.allow_foreign_owner)
        up = _family(
            "gauge",
            "cxlkv_up",
            "1: the pool was read at this scrape; 0: it could not be (see cxlkv_scrape_error).",
        )
        up.add_metric([], 1.0 if snap.up else 0.0)
        yield up
        if not snap.up:
            err = _family("info", "cxlkv_scrape_error", "Why the pool could not be read.", ("path", "error"))
            err.add_metric([], {"path": snap.path, "error": snap.error[:200]})
            yield err
            return
        yield from _pool_series(snap)
        yield from _counter_series(snap.stats)
        yield from _namespace_series(snap)
        yield from _device_series(snap)
        yield from _node_series(snap)
        yield from _quota_series(snap)


def _pool_series(snap: PoolSnapshot) -> Iterator:
    i, s = snap.info, snap.stats
    info = _family(
        "info", "cxlkv_pool", "The pool read: path, uuid (changes when it is recreated), backend, format."
    )
    info.add_metric(
        [],
        {
            "path": snap.path,
            "uuid": str(i.get("uuid", "")),
            "backend": str(i.get("backend", "")),
            "format_version": str(i.get("format_version", "")),
        },
    )
    yield info
    for name, doc, value, unit in (
        ("cxlkv_pool_size", "Bytes of the pool (all devices).", i.get("pool_bytes"), "bytes"),
        ("cxlkv_pool_chunk_size", "Bytes per allocator chunk.", i.get("chunk_bytes"), "bytes"),
        (
            "cxlkv_pool_lease",
            "Heartbeat lease of nodes of another kernel.",
            (i.get("lease_ms") or 0) / 1000,
            "seconds",
        ),
        ("cxlkv_pool_max_nodes", "Node slots of the pool.", i.get("max_nodes"), ""),
        (
            "cxlkv_pool_created_timestamp",
            "When the pool was created (Unix time).",
            (i.get("created_unix_ns") or 0) / 1e9,
            "seconds",
        ),
        (
            "cxlkv_capacity_blocks",
            "KV blocks carved out of active chunks (all namespaces).",
            s.get("capacity_blocks"),
            "",
        ),
        ("cxlkv_used_blocks", "KV blocks holding data.", s.get("used_blocks"), ""),
        ("cxlkv_free_blocks", "Carved KV blocks that are free.", s.get("free_blocks"), ""),
        ("cxlkv_free_chunks", "Chunks not given to any namespace yet.", s.get("free_chunks"), ""),
        ("cxlkv_active_chunks", "Chunks carved into blocks of a namespace.", s.get("active_chunks"), ""),
        ("cxlkv_namespaces", "Namespaces (model layouts) in the pool.", len(snap.namespaces), ""),
    ):
        g = _family("gauge", name, doc, unit=unit)
        g.add_metric([], float(value or 0))
        yield g


def _counter_series(stats: dict) -> Iterator:
    for key, name, doc in counter_table():
        if key not in stats:
            continue
        c = _family("counter", name, doc + " Summed over every node slot of the pool.")
        c.add_metric([], float(stats[key]))
        yield c


def _namespace_series(snap: PoolSnapshot) -> Iterator:
    info = _family(
        "info",
        "cxlkv_namespace",
        "A namespace of the pool and what its identity was derived from.",
        ("namespace", "id", "model_id", "kind", "dtype", "heads_per_entry", "source"),
    )
    block = _family("gauge", "cxlkv_namespace_block_size", "Bytes of one KV block.", ("namespace",), "bytes")
    cap = _family(
        "gauge",
        "cxlkv_namespace_capacity",
        "Bytes of the blocks carved for the namespace.",
        ("namespace",),
        "bytes",
    )
    used = _family(
        "gauge", "cxlkv_namespace_used", "Bytes of its blocks holding data.", ("namespace",), "bytes"
    )
    blocks = _family("gauge", "cxlkv_namespace_used_blocks", "Its blocks holding data.", ("namespace",))
    chunks = _family("gauge", "cxlkv_namespace_chunks", "Chunks carved for the namespace.", ("namespace",))
    tokens = _family("gauge", "cxlkv_namespace_block_tokens", "Tokens per KV block.", ("namespace",))
    for n in snap.namespaces:
        name = str(n.get("name", ""))
        info.add_metric(
            [],
            {
                "namespace": name,
                "id": str(n.get("id", "")),
                "model_id": str(n.get("model_id", ""))[:128],
                "kind": str(n.get("kind", "")),
                "dtype": str(n.get("dtype", "")),
                "heads_per_entry": str(n.get("heads_per_entry", 0)),
                "source": str(n.get("source", ""))[:128],
            },
        )
        block.add_metric([name], float(n.get("block_bytes") or 0))
        tokens.add_metric([name], float(n.get("tokens_per_block") or 0))
        cap.add_metric([name], float(n.get("capacity_bytes", 0)))
        used.add_metric([name], float(n.get("used_bytes", 0)))
        blocks.add_metric([name], float(n.get("used_blocks", 0)))
        chunks.add_metric([name], float(n.get("chunks", 0)))
    yield from (info, block, tokens, cap, used, blocks, chunks)


def _device_series(snap: PoolSnapshot) -> Iterator:
    labels = ("device", "path")
    share = _family("gauge", "cxlkv_device_pool", "Bytes of the pool on this device.", labels, "bytes")
    cap = _family(
        "gauge", "cxlkv_device_capacity", "Bytes of carved KV blocks on this device.", labels, "bytes"
    )
    used = _family(
        "gauge", "cxlkv_device_used", "Bytes of KV blocks holding data on this device.", labels, "bytes"
    )
    for d in snap.devices:
        lv = [str(d.get("index", 0)), str(d.get("path", ""))]
        share.add_metric(lv, float(d.get("pool_bytes") or 0))
        cap.add_metric(lv, float(d.get("capacity_bytes") or 0))
        used.add_metric(lv, float(d.get("used_bytes") or 0))
    yield from (share, cap, used)


def _node_series(snap: PoolSnapshot) -> Iterator:
    counts = _family("gauge", "cxlkv_nodes", "Attached node slots by liveness verdict.", ("verdict",))
    by = dict.fromkeys(VERDICTS, 0)
    labels = ("node", "pid", "judged_by", "verdict")
    alive = _family("gauge", "cxlkv_node_alive", "1: the node is judged alive; 0: dead or undecided.", labels)
    silent = _family(
        "gauge",
        "cxlkv_node_silent",
        "Time since the node's last heartbeat (as judged now).",
        ("node",),
        "seconds",
    )
    lease = _family("gauge", "cxlkv_node_lease", "The node's heartbeat lease.", ("node",), "seconds")
    missed = _family(
        "gauge",
        "cxlkv_nodes_lease_missed",
        "Nodes judged by lease that have been silent for longer than their lease now.",
    )
    n_missed = 0
    for n in snap.nodes:
        verdict = str(n.get("verdict", "undecided"))
        by[verdict] = by.get(verdict, 0) + 1
        node = str(n.get("node", ""))
        alive.add_metric(
            [node, str(n.get("pid", "")), str(n.get("judged_by", "")), verdict], float(verdict == "alive")
        )
        silent.add_metric([node], float(n.get("silent_ms") or 0) / 1000)
        lease.add_metric([node], float(n.get("lease_ms") or 0) / 1000)
        n_missed += lease_missed(n)
    for verdict, k in by.items():
        counts.add_metric([verdict], float(k))
    missed.add_metric([], float(n_missed))
    yield from (counts, alive, silent, lease, missed)


def _quota_series(snap: PoolSnapshot) -> Iterator:
    labels = ("kind", "subject")
    limit = _family(
        "gauge",
        "cxlkv_quota_limit",
        "The quota of a tenant or namespace; 0: counted, not limited.",
        labels,
        "bytes",
    )
    used = _family(
        "gauge", "cxlkv_quota_used", "Pool bytes a tenant's or namespace's blocks hold.", labels, "bytes"
    )
    for q in snap.quotas:
        lv = list(quota_subject(q))
        limit.add_metric(lv, float(q.get("limit_bytes") or 0))
        used.add_metric(lv, float(q.get("usage_bytes") or 0))
    yield from (limit, used)


def make_registry(path: str, allow_foreign_owner: bool = False):
    """A registry with only the pool's collector (no process metrics of the exporter itself)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(path, allow_foreign_owner))
    return registry


def serve(path: str, port: int, addr: str = "0.0.0.0", allow_foreign_owner: bool = False) -> None:
    """Serve /metrics until interrupted (Ctrl-C, SIGTERM)."""
    import signal

    from prometheus_client import start_http_server

    registry = make_registry(path, allow_foreign_owner)
    start_http_server(port, addr=addr, registry=registry)
    print(
        f"cxlkv exporter: serving http://{addr}:{port}/metrics for pool {path}", file=sys.stderr, flush=True
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
