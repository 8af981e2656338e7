"""KV events of the vLLM connector: vLLM's own ``BlockStored`` / ``BlockRemoved`` for the blocks
this engine's requests have in the pool, returned by the scheduler side's ``take_events()``; vLLM's
scheduler publishes them with its ZMQ publisher when ``--kv-events-config`` enables events.

What "stored" means here. The scheduler plans saves; the worker performs them during the step
(or later, with asynchronous saves), and reports only counts. So the scheduler side does not
trust its plan: after each step it asks the pool's index (``match_prefix``, read-only: no pin, no
hit counted) which of each request's planned blocks are present, and announces those, in chain
order, once. A block whose save failed (pool full, evicted before the check) is never announced;
one that lands later (an asynchronous save) is announced at the first check after it lands. A
request that finished (``finished``, called by the connector's ``request_finished``, so that one
which came and went within a single step is seen too) is checked for ``linger_rounds`` more
steps, for its last saves. Blocks the
request loaded from the pool are announced too: they are in the pool, reachable by this engine,
which is what a router indexing this engine's media needs to know.

Lost blocks: every step, the oldest ``checks_per_round`` announced keys are re-checked
(``contains``); one that is gone (evicted by any host, or dropped after a failed load) is
announced as ``BlockRemoved``. At most ``max_announced`` keys are tracked; the oldest beyond that
are forgotten without an event (``cxlkv events`` gives the complete, pool-wide view). When the
connector stops using a pool that failed (deleted, replaced, truncated: "no cache"), every block
still tracked is announced removed, once.

Each announced block also gets a token record in the pool (token_records.py), so that the
pool-wide stream of ``cxlkv events`` can publish its token ids too.

Fields (what llm-d's indexer reads): ``block_hashes`` (the 32-byte cxlkv keys), ``parent_block_hash``
(the key of the block before the run; None for a chain's first block), ``token_ids`` of exactly
those blocks, ``block_size``, ``lora_id`` / ``lora_name`` (vLLM's adapter id and name), and
``medium`` = ``cxlkv:<pool uuid>``: the same for every engine on the pool.
"""

from __future__ import annotations

import collections
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from cxlkv.integrations import token_records as tr


def events_enabled(vllm_config: Any, extra: dict) -> bool:
    """``kv_connector_extra_config.kv_events`` if set, else whether vLLM publishes KV events."""
    if "kv_events" in extra:
        return bool(extra["kv_events"])
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class _Tracked:
    __slots__ = ("announced", "gone_rounds", "state")

    def __init__(self, state: Any):
        self.state = state
        self.announced = 0  # blocks [0, announced) were announced
        self.gone_rounds = 0  # steps since the request left the connector


class ConnectorEvents:
    """Scheduler-side bookkeeping of what this engine announced. ``take`` reads the request
    states duck-typed: ``request`` (``all_token_ids``, ``lora_request``), ``keys`` (ChainedKeys:
    ``keys``, ``root``) and ``saved_blocks`` (blocks [0, n) are in the pool or planned)."""

    def __init__(
        self,
        block_size: int,
        *,
        linger_rounds: int = 8,
        checks_per_round: int = 256,
        max_announced: int = 1 << 16,
    ):
        self.block_size = block_size
        self.linger_rounds, self.checks_per_round, self.max_announced = (
            linger_rounds,
            checks_per_round,
            max_announced,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._announced: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._records: tr.TokenRecordWriter | None = None
        self._records_pool: Any = None
        self._medium: str | None = None  # of the pool the announced blocks are in

    def _writer(self, pool: Any) -> tr.TokenRecordWriter:
        if self._records is None or self._records_pool is not pool:  # a new pool after a fence
            self._records, self._records_pool = tr.TokenRecordWriter(pool, self.block_size), pool
        return self._records

    def finished(self, req_id: str, state: Any) -> None:
        """The connector forgot a request (finished or aborted): keep checking it for its last
        saves, which may be in the very step it finished in (a prefill-only request's only step)."""
        t = self._tracked.get(req_id)
        if t is None or t.state is not state:
            self._tracked[req_id] = _Tracked(state)

    def pool_lost(self) -> list[KVCacheEvent]:
        """The connector stopped using the pool (it failed: deleted, replaced, truncated): every
        block announced is no longer reachable by this engine. Said once."""
        if not self._announced or self._medium is None:
            return []
        gone = BlockRemoved(block_hashes=list(self._announced), medium=self._medium)
        self._announced.clear()
        self._tracked.clear()
        return [gone]

    def take(self, pool: Any, ns: Any, live: dict) -> list[KVCacheEvent]:
        medium = self._medium = f"cxlkv:{pool.uuid}"
        events: list[KVCacheEvent] = []
        for rid, st in live.items():
            t = self._tracked.get(rid)
            if t is None or t.state is not st:
                self._tracked[rid] = t = _Tracked(st)
            t.gone_rounds = 0
        for rid, t in list(self._tracked.items()):
            if rid not in live:
                t.gone_rounds += 1
            ev = self._confirm(pool, ns, t, medium)
            if ev is not None:
                events.append(ev)
            if t.gone_rounds > self.linger_rounds:
                del self._tracked[rid]
        removed = self._sweep(ns)
        if removed:
            events.append(BlockRemoved(block_hashes=removed, medium=medium))
        return events

    def _confirm(self, pool: Any, ns: Any, t: _Tracked, medium: str) -> BlockStored | None:
        st = t.state
        chain = getattr(st, "keys", None)
        if chain is None:
            return None  # an uncacheable request
        keys = chain.keys
        upto = min(int(st.saved_blocks), len(keys))
        start = t.announced
        if upto <= start:
            return None
        n = int(ns.match_prefix(keys[start:upto]))
        if n <= 0:
            return None
        bs = self.block_size
        tokens = [int(x) for x in list(st.request.all_token_ids)[start * bs : (start + n) * bs]]
        if len(tokens) != n * bs:
            return None
        lora = getattr(st.request, "lora_request", None)
        lora_id = getattr(lora, "lora_int_id", None) if lora is not None else None
        lora_name = getattr(lora, "lora_name", None) if lora is not None else None
        writer = self._writer(pool)
        for i in range(start, start + n):
            prev = keys[i - 1] if i else chain.root
            rec = tr.TokenRecord(
                keys[i], prev, i == 0, tokens[(i - start) * bs : (i - start + 1) * bs], lora_id, lora_name
            )
            writer.put(rec)
            self._announce(keys[i])
        t.announced = start + n
        return BlockStored(
            block_hashes=list(keys[start : start + n]),
            parent_block_hash=keys[start - 1] if start else None,
            token_ids=tokens,
            block_size=bs,
            lora_id=lora_id,
            medium=medium,
            lora_name=lora_name,
        )

    def _announce(self, key: bytes) -> None:
        self._announced[key] = None
        self._announced.move_to_end(key)
        while len(self._announced) > self.max_announced:
            self._announced.popitem(last=False)

    def _sweep(self, ns: Any) -> list:
        gone = []
        for _ in range(min(self.checks_per_round, len(self._announced))):
            key, _v = self._announced.popitem(last=False)
            if ns.contains(key):
                self._announced[key] = None  # still there: to the back of the queue
            else:
                gone.append(key)
        if gone:  # a block announced again later must be announced by its request's next store
            for t in self._tracked.values():
                keys = getattr(getattr(t.state, "keys", None), "keys", ())
                for i, k in enumerate(keys[: t.announced]):
                    if k in gone:
                        t.announced = i
                        break
        return gone
