"""Writers' clock records for coalescing (coalesce.py): where they live and what they hold.

A writer publishes when it began, its engine's prefill rate and the work ahead of its last
intended block beside its first and last intents; a waiter reads them to decide whether waiting is
clearly shorter than computing. A record is 44 bytes. It used to be a plain ``put`` into the KV
namespace, where every record took a whole KV block (128 KiB to a few MiB) and, in a full pool,
evicted a real prompt block to hold 44 bytes: two per request being prefilled.

So the records live in a namespace of their own, :data:`CLOCK_NAMESPACE`, of 64-byte blocks
(:func:`clock_layout`), one per pool, shared by every KV namespace in it:

* **Cost.** A namespace holds whole chunks, and each node allocates from a home chunk of its own,
  so the records cost one chunk per engine that writes them, carved at its first record (fixed,
  not per record: a 4 MiB chunk holds 4,096 records, a 64 MiB one 65,535 -- one block
  descriptor per KiB of a chunk bounds the count), shared by every KV namespace's records. It
  stays at that because the first engine to open the namespace caps it with a namespace quota
  of one chunk's blocks (:meth:`ClockBoard._cap`): a put into a full record namespace evicts its
  own oldest records first, where without the cap the allocator would carve another chunk or steal
  one of KV (the leftovers of writers killed mid-prefill would grow it). Carved chunks are never
  taken back (fair share steals only from a namespace with two more chunks than the thief). A pool of fewer than
  :data:`MIN_CLOCK_CHUNKS` chunks (a test pool of a few MiB) publishes no clocks: there a chunk is
  more KV than the clocks are worth, and coalescing decides as with a writer that published none
  (assumed to have just begun, at the waiter's rate; its intents still say what it computes).
* **Quotas.** The namespace is opened with no tenant, so records are charged to no tenant's quota:
  a writer's clock never makes its tenant's KV over quota (a tenant's own put evicts its own
  blocks first). The namespace's own quota row is the one-chunk cap above (one of the pool's
  quota rows).
* **Identity.** A record's key is derived from the KV namespace's name and the writer's intent
  (:func:`clock_key`): records of two models never alias, and never a block's or an intent's key.
* **Untrusted.** A record read is decoded and validated (:meth:`WriterClock.decode`); a missing,
  forged or stale one is "no clock", never a hang or an error. A namespace of that name with
  another layout (not ours), a full namespace table, or any other pool error while opening it (a
  namespace-table lock timeout: tried again after :data:`CLOCK_RETRY_S`): no clocks, one
  warning, never an error that would cost the engine its KV cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
import time
from typing import Any

import cxlkv
from cxlkv.errors import LayoutMismatchError, NamespaceTableFullError

CLOCK_SUFFIX = b"cxlkv-intent-clock"
# A "computing too" record: an engine that declined to wait computes blocks another engine's
# intents cover, and says so beside that run's first and last intents, under a key that also names
# where it computes (host and CPUs): an engine on those very CPUs finds it, and waits for it rather
# than halving both (coalesce.py). Several may compute one run at once, each on its own CPUs, so
# there is one record per place, never one slot they overwrite.
COTOO_SUFFIX = b"cxlkv-intent-cotoo"
CLOCK_NAMESPACE = "cxlkv/coalesce-clocks"
CLOCK_BLOCK_BYTES = 64  # one cache line: the smallest block stride the core allocates
# A pool with fewer chunks than this publishes no clocks: the record namespace's chunk would be
# more than 1/8 of its KV.
MIN_CLOCK_CHUNKS = 8
# A writer's clock record (the value under clock_key of its first and of its last intent: a
# waiter's run of blocks in flight begins at the first when it shares the writer's prefix, and
# ends at the last when it waits for the writer's whole prompt, wherever it begins): magic, the wall-clock
# second it began, its engine's prefill rate (tokens/s), and the prompt tokens its engine computes
# before its last intended block is done (its own plus its engine's prefill backlog then), and
# where it computes (a hash of its host's name and the CPUs its engine computes on, folded to 64
# bits; 0: not known, e.g. a GPU engine): two engines that share CPUs slow each other down.
CLOCK_MAGIC = b"cxlkvck2"
CLOCK_RECORD = struct.Struct("<8sddIQQ")
MAX_CLOCK_WORK = 1 << 26  # tokens: far beyond any prompt plus backlog; more is a bad record
CLOCK_SKEW_S = 5.0  # a record that begins this far in this host's future is not believed
# A record this long past its writer's expected end is a leftover (its writer could not replace
# it), not the clock of the live writer that holds the intent now: no clock.
CLOCK_STALE_S = 300.0
# An open of the record namespace that failed for a cause that may pass (its table's lock held by a
# stalled node: up to three leases on the scheduler's thread) is tried again this much later.
CLOCK_RETRY_S = 60.0


def clock_layout() -> cxlkv.KVLayout:
    """The record namespace's layout: opaque 64-byte blocks (a record is CLOCK_RECORD.size)."""
    return cxlkv.KVLayout(
        model_id=CLOCK_NAMESPACE,
        dtype="uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=CLOCK_BLOCK_BYTES,
        tokens_per_block=1,
        kind="opaque",
        source="coalescing writer clocks (cxlkv.integrations.coalesce_clock)",
    )


def clock_key(intent: bytes, namespace: str, place: tuple[int, int] | None = None) -> bytes:
    """Where the writer holding `intent` (its first or last) of KV namespace `namespace` publishes
    its clock: sha256(intent | b"cxlkv-intent-clock" | namespace name). With `place` (host, cpus):
    where an engine computing there the blocks of that intent too publishes its clock,
    sha256(intent | b"cxlkv-intent-cotoo" | host | cpus | namespace name)."""
    if place is None:
        return hashlib.sha256(bytes(intent) + CLOCK_SUFFIX + namespace.encode()).digest()
    where = struct.pack("<QQ", place[0] & (2**64 - 1), place[1] & (2**64 - 1))
    return hashlib.sha256(bytes(intent) + COTOO_SUFFIX + where + namespace.encode()).digest()


@dataclasses.dataclass(frozen=True)
class WriterClock:
    """A writer's published start, rate and work (validated: the pool is untrusted input)."""

    start: float  # wall-clock seconds (time.time())
    tps: float
    work: int  # prompt tokens its engine computes before its last intended block is done
    host: int = 0  # where it computes (compute_place()); 0: not known
    cpus: int = 0

    def encode(self) -> bytes:
        return CLOCK_RECORD.pack(CLOCK_MAGIC, self.start, self.tps, self.work, self.host, self.cpus)

    def shares(self, place: tuple[int, int]) -> bool:
        """Does it compute on the CPUs of an engine at `place` (compute_place())?"""
        host, cpus = place
        return bool(self.host and host == self.host and self.cpus & cpus)

    @classmethod
    def decode(cls, raw: Any, now: float) -> WriterClock | None:
        """None for anything that is not a believable record written before `now`."""
        if raw is None or len(raw) != CLOCK_RECORD.size:
            return None
        magic, start, tps, work, host, cpus = CLOCK_RECORD.unpack(bytes(raw))
        if magic != CLOCK_MAGIC or not (math.isfinite(start) and math.isfinite(tps)):
            return None
        if not (0 < tps <= 1e9 and 0 <= work <= MAX_CLOCK_WORK and start <= now + CLOCK_SKEW_S):
            return None
        return cls(start, tps, work, host, cpus)

    def remaining(self, now: float) -> float:
        """Seconds until its last intended block should be computed. A writer already late by L
        (slower than its clock said) is expected to need about L more, at most its whole work's
        time again."""
        end = self.start + self.work / self.tps
        return end - now if now <= end else min(now - end, self.work / self.tps)


class ClockBoard:
    """The record namespace of the pool a session is attached to, opened at first use and again
    after the session attached anew (a fence); None where the pool publishes no clocks. Every
    method runs inside the session's call (its guard), given the KV namespace of the call."""

    def __init__(self, session: Any, logger: Any) -> None:
        self._session = session
        self._log = logger
        self._pool: Any = None  # the pool handle self._ns belongs to
        self._ns: Any = None
        self._warned = False
        self._retry_at = 0.0  # when an open that failed for a passing cause is tried again

    def records(self) -> Any:
        pool = getattr(self._session, "pool", None)
        if pool is None:
            return None
        if pool is not self._pool:
            self._pool, self._ns = pool, None
            chunks = int(pool.info()["chunk_count"])
            if chunks < MIN_CLOCK_CHUNKS:
                self._log.info(
                    "cxlkv: pool %s has %d chunks (< %d): coalescing publishes no writer clocks "
                    "(their namespace would take one chunk of it)",
                    pool.path,
                    chunks,
                    MIN_CLOCK_CHUNKS,
                )
                return None
            self._ns = self._open(pool)
        elif self._ns is None and self._retry_at and time.monotonic() >= self._retry_at:
            self._ns = self._open(pool)
        return self._ns

    def _open(self, pool: Any) -> Any:
        """The record namespace, capped to one chunk; None (one warning) when it cannot be opened.
        Clocks are an optimisation: no error here may cost the engine its KV cache (the session's
        guard treats an escaping error as a broken pool), so every pool error but a fence (the
        session attaches anew) means "no clocks", retried after CLOCK_RETRY_S when it may pass (a
        namespace-table lock held by a stalled node)."""
        self._retry_at = 0.0
        try:
            ns = pool.namespace(clock_layout(), name=CLOCK_NAMESPACE)
            self._cap(pool)
            return ns
        except cxlkv.FencedError:
            raise
        except cxlkv.CxlkvError as e:
            if not isinstance(e, (LayoutMismatchError, NamespaceTableFullError, cxlkv.ReadOnlyError)):
                self._retry_at = time.monotonic() + CLOCK_RETRY_S
            if not self._warned:
                self._warned = True
                self._log.warning(
                    "cxlkv: coalescing publishes no writer clocks: namespace %r cannot be opened (%s: %s)%s",
                    CLOCK_NAMESPACE,
                    type(e).__name__,
                    e,
                    f"; retried every {CLOCK_RETRY_S:.0f} s" if self._retry_at else "",
                )
            return None

    def _cap(self, pool: Any) -> None:
        """Caps the record namespace to one chunk with a namespace quota, so that a full one evicts
        its own oldest records and never carves a new chunk or steals one of KV (its leftovers:
        writers killed mid-prefill; thousands of prefills at once). Set once per pool (the
        quota table keeps it); with no quota row free the records go uncapped (one warning)."""
        info = next(n for n in pool.namespaces() if n["name"] == CLOCK_NAMESPACE)
        # a quota counts the bytes of the blocks held: one chunk's blocks (one per KiB of it)
        cap = int(info["blocks_per_chunk"]) * int(info["block_bytes"])
        for q in pool.quotas():
            if q["kind"] == "namespace" and q["namespace"] == CLOCK_NAMESPACE and q["max_bytes"] == cap:
                return
        try:
            pool.set_quota(namespace=CLOCK_NAMESPACE, max_bytes=cap)
        except cxlkv.ReadOnlyError:
            pass  # a read-only handle writes no records either
        except cxlkv.QuotaTableFullError as e:
            self._log.warning("cxlkv: writer clock records are not capped to one chunk (%s)", e)

    def read(
        self, kv_ns: Any, intent: bytes, now: float, place: tuple[int, int] | None = None
    ) -> WriterClock | None:
        """The writer's clock beside `intent`; with `place`: the clock of an engine computing its
        blocks too on those CPUs (a record that does not say it computes there is not believed)."""
        rec = self.records()
        if rec is None:
            return None
        c = WriterClock.decode(rec.get_bytes(clock_key(intent, kv_ns.name, place)), now)
        if c is None or c.start + c.work / c.tps + CLOCK_STALE_S < now:
            return None  # none, bad, or a dead writer's leftover (long past its expected end)
        if place is not None and not c.shares(place):
            return None
        return c

    def publish(
        self, kv_ns: Any, intent: bytes, clock: WriterClock, place: tuple[int, int] | None = None
    ) -> bool:
        """Puts the clock under `intent`'s key (a dead writer's leftover is replaced: whoever holds
        the intent owns the record; with `place`, whoever computes there now). False when it could
        not be put."""
        rec = self.records()
        if rec is None:
            return False
        key = clock_key(intent, kv_ns.name, place)
        rec.delete(key)
        return bool(rec.put(key, clock.encode()))

    def remove(self, kv_ns: Any, intent: bytes, place: tuple[int, int] | None = None) -> None:
        rec = self.records()
        if rec is not None:
            rec.delete(clock_key(intent, kv_ns.name, place))
