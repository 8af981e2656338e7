"""One read of a whole pool for observers (``cxlkv exporter``, ``cxlkv top``): header, counters,
namespaces, nodes, quotas and per-device use, taken through the public API as an observer (no node
slot, so it works on a full node table and never keeps a node alive).

Each read opens the pool and closes it again: a pool that was destroyed and created anew at the
same path is simply the next read's pool (its ``uuid`` tells them apart), and a pool that is
absent or unreadable is a :class:`PoolSnapshot` with ``error`` set, never an exception.
"""

from __future__ import annotations

import dataclasses
import time

import cxlkv


@dataclasses.dataclass
class PoolSnapshot:
    path: str
    taken: float  # time.monotonic() of the read
    info: dict = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(default_factory=dict)
    namespaces: list = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)
    devices: list = dataclasses.field(default_factory=list)  # info's devices merged with their use
    quotas: list = dataclasses.field(default_factory=list)  # Pool.quotas(): tenants' and namespaces' limits
    error: str = ""  # why the pool could not be read ("" when it was)

    @property
    def up(self) -> bool:
        return not self.error


def read_pool(path: str, allow_foreign_owner: bool = False) -> PoolSnapshot:
    """Everything an observer shows, read now; ``error`` (one line) instead of raising."""
    snap = PoolSnapshot(path=path, taken=time.monotonic())
    try:
        with cxlkv.Pool.open(path, attach=False, allow_foreign_owner=allow_foreign_owner) as pool:
            snap.info = dict(pool.info())
            snap.stats = dict(pool.stats())
            snap.namespaces = with_usage(pool.namespaces(), pool.namespace_usage())
            snap.nodes = [dict(n) for n in pool.nodes()]
            snap.quotas = [dict(q) for q in pool.quotas()]
            usage = list(pool.device_usage())
    except (cxlkv.CxlkvError, OSError, ValueError) as e:
        snap.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        return snap
    snap.devices = [{**d, **u} for d, u in zip(snap.info.pop("devices", []), usage, strict=False)]
    return snap


def with_usage(namespaces: list, usage: list) -> list[dict]:
    """Each namespace with its share of the arena: chunks, capacity_blocks, used_blocks, and the
    same in bytes (blocks times the namespace's block size)."""
    by_id = {u["id"]: u for u in usage}
    out = []
    for n in namespaces:
        u = by_id.get(n["id"], {})
        block = int(n.get("block_bytes") or 0)
        cap, used = int(u.get("capacity_blocks", 0)), int(u.get("used_blocks", 0))
        out.append(
            {
                **n,
                "chunks": int(u.get("chunks", 0)),
                "capacity_blocks": cap,
                "used_blocks": used,
                "capacity_bytes": cap * block,
                "used_bytes": used * block,
            }
        )
    return out


def lease_missed(node: dict) -> bool:
    """A node silent for longer than its lease: it missed its lease (a live node beats well
    within it). Judged from the node table's own fields; nodes judged by their kernel lock
    (this host) are alive or dead without a lease and never count."""
    lease = int(node.get("lease_ms") or 0)
    return node.get("judged_by") == "lease" and lease > 0 and int(node.get("silent_ms") or 0) > lease


def printable(text: str) -> str:
    """``text`` with control characters (ESC sequences, CR, C1) shown as \\xNN: strings read from
    a pool must not drive the operator's terminal (cli.render.no_controls is this)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F else c for c in text)


def quota_subject(q: dict) -> tuple[str, str]:
    """(kind, subject) of a quota row as observers label it: ("tenant", name) or ("namespace",
    its name, else its id); an unreadable row is ("unreadable", "row N")."""
    if not q.get("readable"):
        return "unreadable", f"row {q.get('row')}"
    if q.get("kind") == "tenant":
        return "tenant", printable(str(q.get("tenant", "")))
    return "namespace", printable(str(q.get("namespace") or q.get("ns_id")))
