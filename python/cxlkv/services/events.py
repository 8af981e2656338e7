"""``cxlkv events``: one pool-wide stream of KV events that routers index (llm-d, Dynamo).

Source: the pool itself. Every ``interval`` seconds the index is scanned (``index_scan``, a
read-only seqlock snapshot of every READY entry) and diffed with the previous scan by
``(slot, generation)``: an incarnation that appeared is a ``BlockStored``, one that is gone a
``BlockRemoved``. So every host's puts and evictions are seen, whoever made them, and nothing is
added to the store path: publishing can neither block nor fail a store (it takes no lock, no pin
and writes nothing to the pool). A block put and evicted between two scans is never seen; that is
the price of reading instead of hooking.

Token ids come from the token records the connector puts beside the blocks it confirms
(integrations/token_records.py), each checked against the block's key; a block without a valid
record (stored by another client, or whose record was evicted) is published after
``record_wait_s`` without token ids.

Wire format: vLLM's ``ZmqEventPublisher``: a PUB socket sending (topic, seq as 8 bytes big-endian,
msgpack of a ``KVEventBatch``: ``[ts, [event, ...]]``, each event a map tagged ``type`` with
vLLM's field names), one sequence for the whole pool (all namespaces, all topics); a ROUTER socket
answering replay requests (``[b"", start seq]``) from a bounded buffer, ended by seq -1. The
topic is ``kv@<pod>@<model>`` as llm-d parses it (``--topic`` template).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

import cxlkv
from cxlkv.errors import CommandError
from cxlkv.index_scan import scan_index
from cxlkv.integrations import token_records as tr
from cxlkv.integrations.heads import head_key
from cxlkv.integrations.namespace_kinds import is_kv_namespace

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv@cxlkv-{pool}@{namespace}"


def pool_medium(pool: cxlkv.Pool) -> str:
    """The medium that names this pool in events (the connector's events use the same)."""
    return f"cxlkv:{pool.uuid}"


def stored_event(key: bytes, rec: tr.TokenRecord | None, block_size: int, medium: str) -> dict:
    """vLLM's BlockStored as a map (its msgspec encoding: tag ``type``, its field names)."""
    return {
        "type": "BlockStored",
        "block_hashes": [key],
        "parent_block_hash": None if rec is None or rec.first else rec.prev,
        "token_ids": [] if rec is None else rec.token_ids,
        "block_size": block_size,
        "lora_id": None if rec is None else rec.lora_id,
        "medium": medium,
        "lora_name": None if rec is None else rec.lora_name,
    }


def removed_event(keys: list, medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": medium}


@dataclasses.dataclass
class _Pending:
    key: bytes
    ns_id: int
    depth: int
    deadline: float


_KNOWN = np.dtype([("id", "<u8"), ("ns_id", "<u4"), ("key", "V32")])


def _ids(slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
    """One uint64 per incarnation: slot above the 24-bit generation (format.h)."""
    return (slots.astype(np.uint64) << np.uint64(24)) | gens.astype(np.uint64)


class PoolEventSource:
    """Diffs successive scans of a pool's index into vLLM-shaped events, per namespace. The diff
    is vectorised (numpy over the scan's records): only what changed is looked at one by one."""

    def __init__(
        self,
        pool: cxlkv.Pool,
        *,
        record_wait_s: float = 1.0,
        namespace: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool, self.medium = pool, pool_medium(pool)
        self.record_wait_s, self.only = record_wait_s, namespace
        self._clock = clock
        self._known = np.zeros(0, _KNOWN)  # published incarnations, sorted by id
        self._pending: dict[int, _Pending] = {}  # id -> a new block waiting for its token record
        self._ns: dict[int, dict] = {}
        self._heads: set[int] = set()  # entries of heads other than 0 (per-head namespaces): no event
        self._records: dict[int, object] = {}  # block size -> record namespace handle (or None)
        self.records_found = self.records_missing = 0

    def namespace(self, ns_id: int) -> dict | None:
        if ns_id not in self._ns:
            self._ns = {n["id"]: n for n in self.pool.namespaces()}
        return self._ns.get(ns_id)

    def _record(self, key: bytes, block_size: int) -> tr.TokenRecord | None:
        if block_size not in self._records:
            name = tr.namespace_name(block_size)
            exists = any(n["name"] == name for n in self.pool.namespaces())
            # Opened only if a connector made it: a reader never creates namespaces.
            self._records[block_size] = (
                self.pool.namespace(tr.layout(block_size), name=name) if exists else None
            )
        ns = self._records[block_size]
        if ns is None:
            return None
        return tr.decode(ns.get_bytes(tr.record_key(key)), key, block_size)  # type: ignore[attr-defined]

    def _block_entry(self, key: bytes, info: dict) -> bool:
        """Whether an entry names a block: always, unless its namespace stores one entry per KV
        head (integrations/heads.py), whose head 0 is under the block key and the other heads
        under keys derived from it: then the key is a block's if its head 1 entry is there."""
        per_entry = int(info.get("heads_per_entry") or 0)
        if not per_entry or int(info["num_kv_heads"]) // per_entry < 2:
            return True
        ns = self.pool.namespace(cxlkv.KVLayout.from_info(info), name=info["name"])
        return bool(ns.contains(head_key(key, 1)))

    def _wanted(self, info: dict | None) -> bool:
        return info is not None and is_kv_namespace(info) and self.only in (None, info["name"])

    def poll(self) -> dict[int, list]:
        """Events since the last poll: {namespace id: [event, ...]}, removals first."""
        now = self._clock()
        scan = scan_index(self.pool)
        rec = scan.records
        ids = _ids(rec["slot"], rec["gen"])
        unstable = np.fromiter(scan.unstable, np.uint64, len(scan.unstable))
        out: dict[int, list] = collections.defaultdict(list)

        # gone: published incarnations not in this scan (a slot read as unstable keeps its own)
        gone = ~np.isin(self._known["id"], ids, assume_unique=True)
        if unstable.size:
            gone &= ~np.isin(self._known["id"] >> np.uint64(24), unstable)
        for ns_id in np.unique(self._known["ns_id"][gone]):
            keys = [bytes(k) for k in self._known["key"][gone & (self._known["ns_id"] == ns_id)]]
            out[int(ns_id)].append(removed_event(keys, self.medium))
        self._known = self._known[~gone]
        present = set(ids.tolist()) if self._pending else set()
        unstable_slots = scan.unstable
        for i in [i for i in self._pending if i not in present and (i >> 24) not in unstable_slots]:
            del self._pending[i]  # gone before it was published: nothing to say
        self._heads &= set(ids.tolist()) | {i for i in self._heads if (i >> 24) in unstable_slots}

        # new: incarnations neither published nor pending
        fresh = np.flatnonzero(~np.isin(ids, self._known["id"], assume_unique=True))
        for j in fresh:
            i = int(ids[j])
            if i in self._pending or i in self._heads:
                continue
            ns_id = int(rec["ns_id"][j])
            if self._wanted(self.namespace(ns_id)):
                self._pending[i] = _Pending(
                    bytes(rec["key"][j]), ns_id, int(rec["depth"][j]), now + self.record_wait_s
                )

        # publish pending blocks whose record arrived (or waited long enough), parents first
        published = []
        for i in sorted(self._pending, key=lambda i: self._pending[i].depth):
            p = self._pending[i]
            info = self.namespace(p.ns_id)
            if info is None:
                del self._pending[i]
                continue
            bs = int(info["tokens_per_block"])
            r = self._record(p.key, bs)
            if r is None and now < p.deadline:
                continue  # its record may still come (the connector writes it a step later)
            if r is None and not self._block_entry(p.key, info):
                self._heads.add(i)  # another head's entry of a block announced by its head 0
                del self._pending[i]
                continue
            self.records_found += r is not None
            self.records_missing += r is None
            out[p.ns_id].append(stored_event(p.key, r, bs, self.medium))
            published.append((i, p.ns_id, p.key))
            del self._pending[i]
        if published:
            add = np.array(published, _KNOWN)
            self._known = np.concatenate([self._known, add])
            self._known.sort(order="id")
        return dict(out)


class ReplayPublisher:
    """vLLM's ZMQ publisher protocol over one sequence: PUB (topic, seq, payload) and a ROUTER
    answering replays from the last ``buffer`` messages. Never blocks: PUB drops at its HWM."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, *, buffer: int = 10_000, hwm: int = 100_000
    ):
        try:
            import msgspec
            import zmq
        except ImportError as e:
            raise CommandError(
                f"cxlkv events needs pyzmq and msgspec ({e}): pip install 'cxlkv[events]'"
            ) from e
        self._zmq, self._encode = zmq, msgspec.msgpack.Encoder().encode
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        self._buffer: collections.deque = collections.deque(maxlen=buffer)
        self.next_seq = 0

    def _bind(self, sock, endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            raise CommandError(f"cannot bind {endpoint}: {e}") from e
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def publish(self, topic: str, events: list, ts: float | None = None) -> int:
        payload = self._encode([time.time() if ts is None else ts, events])
        seq = self.next_seq
        self.next_seq += 1
        frames = (topic.encode(), seq.to_bytes(8, "big"), payload)
        try:
            self._pub.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # a slow subscriber: it recovers the message through the replay socket
        self._buffer.append((seq, frames))
        return seq

    def serve_replays(self, timeout_s: float) -> int:
        """Answers replay requests arriving within timeout_s; returns how many were served."""
        if self._replay is None:
            time.sleep(timeout_s)
            return 0
        served = 0
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                return served
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: vLLM's publisher ignores those too
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, msg in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", *msg))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            served += 1

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()


def topic_for(template: str, pool: cxlkv.Pool, info: dict) -> str:
    return template.format(pool=pool.uuid[:8], namespace=info["name"], model=info["model_id"])


# A pool that stops being usable under the stream: its blocks are announced cleared and it is
# opened again (a new pool at the path, or this node again after a fence).
_POOL_GONE = (cxlkv.FencedError, cxlkv.PoolTruncatedError, cxlkv.PoolCorruptError, FileNotFoundError)


class _Replaced(Exception):
    pass


def run(
    pool: cxlkv.Pool,
    publisher: ReplayPublisher,
    *,
    interval_s: float = 0.1,
    topic: str = DEFAULT_TOPIC,
    namespace: str | None = None,
    record_wait_s: float = 1.0,
    duration_s: float | None = None,
    on_batch: Callable[[int, str, list], None] | None = None,
    reopen: Callable[[], cxlkv.Pool] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> dict:
    """Polls the pool and publishes until duration_s (None: until interrupted). Returns counts.
    With ``reopen``, a pool that is replaced, truncated or fences this node is announced
    ``AllBlocksCleared`` on every topic it published and opened again (retried every interval)."""
    source = PoolEventSource(pool, record_wait_s=record_wait_s, namespace=namespace)
    start = time.monotonic()
    published = events = reopened = 0
    topics: set[str] = set()
    found = missing = 0

    def send(t: str, batch: list) -> None:
        nonlocal published, events
        seq = publisher.publish(t, batch)
        published += 1
        events += len(batch)
        topics.add(t)
        if on_batch is not None:
            on_batch(seq, t, batch)

    try:
        while duration_s is None or time.monotonic() - start < duration_s:
            try:
                if source is None:
                    pool = reopen()  # type: ignore[misc]
                    source = PoolEventSource(pool, record_wait_s=record_wait_s, namespace=namespace)
                    reopened += 1
                    log(f"cxlkv events: pool {pool.path} opened again ({pool_medium(pool)})")
                if pool.file_replaced():
                    raise _Replaced("the pool file was replaced")
                batches = source.poll()
            except (*_POOL_GONE, _Replaced) as e:
                if reopen is None:
                    raise
                if source is not None:
                    log(f"cxlkv events: pool {pool.path}: {e}; its blocks are announced cleared")
                    found, missing = found + source.records_found, missing + source.records_missing
                    for t in sorted(topics):
                        send(t, [{"type": "AllBlocksCleared"}])
                    topics.clear()
                    source = None
                    try:
                        pool.close()
                    except cxlkv.CxlkvError:
                        pass
                publisher.serve_replays(interval_s)
                continue
            for ns_id, batch in batches.items():
                info = source.namespace(ns_id) or {"name": f"ns{ns_id}", "model_id": ""}
                send(topic_for(topic, pool, info), batch)
            publisher.serve_replays(interval_s)
    except KeyboardInterrupt:
        pass
    finally:
        if reopen is not None and source is not None:
            pool.close()
    if source is not None:
        found, missing = found + source.records_found, missing + source.records_missing
    return {
        "messages": published,
        "events": events,
        "records_found": found,
        "records_missing": missing,
        "reopened": reopened,
    }
