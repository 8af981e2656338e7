"""The READY entries of a pool's prefix index, read without taking or pinning anything.

``scan_index(pool)`` is what ``cxlkv events`` diffs between two polls and what ``cxlkv query``
can list. Each entry is one consistent (seqlock) snapshot: the slot, its generation (a new one on
every reuse of the slot, so ``(slot, gen)`` names one incarnation of one block), the namespace id
(checked against the pool's table by the core), the writer's chain depth (a hint) and the 32-byte
key. Entries still changing after a few re-reads are returned as ``unstable`` slots: a caller
diffing two scans keeps what it knew of them rather than reading them as gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The core's packed record (src/python/bindings_events.cpp): 56 bytes, little-endian.
RECORD = np.dtype(
    [("slot", "<u8"), ("gen", "<u4"), ("ns_id", "<u4"), ("depth", "<u2"), ("_pad", "V6"), ("key", "V32")]
)
assert RECORD.itemsize == 56


@dataclass
class IndexScan:
    records: np.ndarray  # RECORD entries, in slot order
    unstable: frozenset  # slots whose entry kept changing while read

    def __len__(self) -> int:
        return len(self.records)

    def entries(self):
        """(slot, gen, ns_id, depth, key bytes) of every record."""
        r = self.records
        for i in range(len(r)):
            yield (
                int(r["slot"][i]),
                int(r["gen"][i]),
                int(r["ns_id"][i]),
                int(r["depth"][i]),
                bytes(r["key"][i]),
            )


def scan_index(pool, first: int = 0, count: int | None = None) -> IndexScan:
    """The READY entries of index slots [first, first + count) (all of them by default) of an
    open :class:`cxlkv.Pool` (an observer, ``attach=False``, is enough)."""
    raw, unstable = pool._core.scan_index(first, (1 << 64) - 1 if count is None else count)
    if len(raw) % RECORD.itemsize:
        raise RuntimeError(f"index scan returned {len(raw)} bytes, not whole {RECORD.itemsize}-byte records")
    return IndexScan(np.frombuffer(raw, RECORD), frozenset(int(s) for s in unstable))
