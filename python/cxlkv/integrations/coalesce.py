"""Compute a new prefix once across vLLM instances (issue 16, item 5).

When two engines get the same NEW prompt at the same moment, both would compute it. The pool
knows which chains are being written, so the first engine to miss at block k takes an *intent
marker* for that chain, and any other engine that misses at the same block finds the marker in
flight and waits for the blocks (vLLM's asynchronous KV load) instead of recomputing them.

* The marker is an index entry in WRITING state with no block, taken with
  ``Namespace.reserve(..., blocks=False)`` on the key
  :func:`intent_key` derives from the chain key of block k: it names exactly the bytes of the
  prefix up to block k (identity follows the bytes), and it is never committed, so it is never
  readable KV. It is released (``abort``) once the writer's saves of its prompt blocks are done,
  or when the request finishes, is aborted or preempted; a writer that dies (``kill -9``) leaves
  a WRITING entry of a gone node, which the core treats as absent (``writing_same_key``) and
  reclaims.
* A waiter returns its remaining full prompt blocks as external tokens with ``load_async=True``;
  its worker polls the pool with a bounded backoff and loads the blocks once all are present,
  through the same checksummed ``ns.load`` as every load. It gives up when the marker is gone and
  blocks are still missing (writer finished with a shorter prompt, dropped them, or died:
  ``writer_gone``), or ``coalesce_wait_s`` after the wait began (``deadline``): it loads the
  leading present blocks and reports the rest through ``get_block_ids_with_load_errors``, so vLLM
  recomputes them (policy "recompute", which the connector sets).

Everything the worker needs travels in the connector metadata (:class:`WaitOp`): no state is
shared between the scheduler and the worker, so any executor works. Tensor parallelism is not
supported (the ranks share one namespace of per-head entries, heads.py, but each would poll and
load its waits on its own, untested): coalescing is off with one log line when ``tp_size > 1``.

Extra config: ``coalesce`` (default true; a marker costs an index entry, never a pool block, so a
full pool loses no READY KV to it) and ``coalesce_wait_s`` (default 30: longer than a long prefill
on a loaded CPU, short enough that a stalled writer costs one bounded delay).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from cxlkv.integrations.transfer import BlockOp

INTENT_SUFFIX = b"cxlkv-intent"
DEFAULT_WAIT_S = 30.0
FIRST_POLL_S = 0.005  # a waiter's first re-check; doubles up to MAX_POLL_S
MAX_POLL_S = 0.1
MAX_IDLE_SLEEP_S = 0.05  # an engine with nothing but waits sleeps this long at most per step
FALLBACK_CAUSES = ("writer_gone", "deadline", "pool_unavailable")
# The connector's counters (vllm_metrics.py STAT_KEYS): markers taken, requests that
# waited, blocks they got from another engine, waits that gave up (by cause), blocks recomputed then.
STAT_KEYS = (
    "coalesce_intents",
    "coalesce_waits",
    "coalesced_blocks",
    *(f"coalesce_fallback_{cause}" for cause in FALLBACK_CAUSES),
    "coalesce_recomputed_blocks",
)


def intent_key(chain_key: bytes) -> bytes:
    """The marker of "block k of this chain is being computed": sha256(chain key of block k |
    b"cxlkv-intent"). A distinct derivation, so a marker is never a block's key, and two engines
    derive the same marker exactly when they would compute the same bytes."""
    if len(chain_key) != 32:
        raise ValueError(f"cxlkv: a chain key has 32 bytes, not {len(chain_key)}")
    return hashlib.sha256(bytes(chain_key) + INTENT_SUFFIX).digest()


@dataclasses.dataclass(frozen=True)
class CoalesceConfig:
    enabled: bool = True
    wait_s: float = DEFAULT_WAIT_S

    @classmethod
    def from_extra(cls, extra: dict) -> CoalesceConfig:
        on = extra.get("coalesce", True)
        if not isinstance(on, bool):
            raise ValueError(f"cxlkv: coalesce must be true or false, not {on!r}")
        wait = extra.get("coalesce_wait_s", DEFAULT_WAIT_S)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 < float(wait) <= 3600:
            raise ValueError(f"cxlkv: coalesce_wait_s must be a number of seconds in (0, 3600], not {wait!r}")
        return cls(on, float(wait))


@dataclasses.dataclass
class WaitOp:
    """A request waiting for blocks another engine computes (scheduler -> worker metadata)."""

    op: BlockOp  # keys [start_depth, start_depth + len) of the prompt and the vLLM blocks for them
    marker: bytes
    wait_s: float
    already: int = 0  # leading blocks that were in the pool when the wait began


@dataclasses.dataclass
class _Marker:
    key: bytes
    reservation: Any
    end_blocks: int  # the writer's prompt blocks: released once its saves cover them
    release_after_step: int | None = None


class CoalesceScheduler:
    """Scheduler side: takes, holds and releases intent markers; plans waits."""

    def __init__(self, cfg: CoalesceConfig, session: Any, count: Callable[..., None], logger: Any) -> None:
        self.cfg = cfg
        self._session = session
        self._count = count
        self._log = logger
        self._markers: dict[str, _Marker] = {}
        self._pending: dict[str, WaitOp] = {}  # decided, blocks not allocated yet
        self._ready: list[WaitOp] = []  # blocks allocated: sent with the next metadata
        self._waiting: dict[str, WaitOp] = {}  # sent to the worker, outcome pending
        self._floors: dict[str, int] = {}  # finished waits: leading blocks now in vLLM's cache
        # Requests that waited once: a wait that gave up is not repeated (its writer may be stalled
        # and still hold the marker), so one request's delay is bounded by one coalesce_wait_s.
        self._waited: set[str] = set()

    def on_miss(
        self, req_id: str, keys: list, have: int, hit: int, max_blocks: int, can_save: bool, can_load: bool
    ) -> WaitOp | None:
        """The prompt's pool hit ends at `hit` < `max_blocks`: take the chain's marker (this
        request computes it) or, if another engine holds it, return the wait to plan."""
        if not self.cfg.enabled or hit >= max_blocks:
            return None
        marker = intent_key(keys[hit])
        held = self._markers.get(req_id)
        if held is not None:
            if held.key == marker:
                return None  # looked up again (not scheduled last time): still ours
            self.release(req_id, "its prompt now misses at another block")
        if any(m.key == marker for m in self._markers.values()):
            return None  # another request of this engine computes it: vLLM's own business
        res = self._session.call("coalesce", lambda ns: ns.reserve([marker], start_depth=hit, blocks=False))
        state = res.states[0] if res is not None else "failed"
        if state == "reserved":
            if not can_save:  # it never publishes the blocks: nobody should wait for it
                res.abort()
                return None
            self._markers[req_id] = _Marker(marker, res, max_blocks)
            self._count("coalesce_intents")
            return None
        if res is not None:
            res.abort()  # nothing held; explicit for readers
        if state != "in_flight" or not can_load or have > hit or req_id in self._waited:
            return None  # no marker to be had (index full), more here locally, or waited already
        op = BlockOp(req_id, list(keys[have:max_blocks]), [], start_depth=have)
        wait = WaitOp(op, marker, self.cfg.wait_s, already=hit - have)
        self._pending[req_id] = wait
        return wait

    def lookup_started(self, req_id: str) -> None:
        """vLLM looks the request up again (it was not scheduled last time): a wait planned then
        is void; this lookup decides afresh."""
        self._pending.pop(req_id, None)

    def allocated(self, req_id: str, block_ids: list, external_tokens: int, block_size: int) -> bool:
        """update_state_after_alloc for a planned wait; False when the request has none."""
        wait = self._pending.pop(req_id, None)
        if wait is None:
            return False
        n = external_tokens // block_size
        if n == 0:
            return True
        first = wait.op.start_depth
        wait.op.keys = wait.op.keys[:n]
        wait.op.block_ids = list(block_ids[first : first + n])
        wait.already = min(wait.already, n)
        self._ready.append(wait)
        self._waited.add(req_id)
        self._count("coalesce_waits")
        self._log.info(
            "cxlkv: %s: blocks %d-%d of its prompt are being computed by another engine; waiting "
            "for them (at most %.0f s)",
            req_id,
            first,
            first + n - 1,
            wait.wait_s,
        )
        return True

    def take_waits(self) -> list[WaitOp]:
        out, self._ready = self._ready, []
        for w in out:
            self._waiting[w.op.req_id] = w
        return out

    def saves_planned(self, req_id: str, saved_blocks: int, step: int) -> None:
        """Synchronous saves: the step that carries the save of the marker's last prompt block
        publishes it before it completes; the marker goes once that step has completed."""
        m = self._markers.get(req_id)
        if m is not None and m.release_after_step is None and saved_blocks >= m.end_blocks:
            m.release_after_step = step

    def step_done(
        self,
        completed_steps: int,
        invalid_block_ids: set,
        finished_recving: Iterable[str],
        finished_sending: Iterable[str],
    ) -> None:
        for req_id in [r for r, m in self._markers.items() if m.release_after_step is not None]:
            step = self._markers[req_id].release_after_step
            if step is not None and step <= completed_steps:
                self.release(req_id, "its prompt blocks are saved")
        for req_id in finished_sending:  # asynchronous saves: every copy of the request is done
            self.release(req_id, "its saves are done")
        for req_id in finished_recving:
            wait = self._waiting.pop(req_id, None)
            if wait is None:
                continue
            ids = wait.op.block_ids
            bad = next((i for i, b in enumerate(ids) if b in invalid_block_ids), len(ids))
            self._floors[req_id] = wait.op.start_depth + bad

    def loaded_floor(self, req_id: str) -> int:
        """Blocks a request scheduled after its wait already has (not to be saved again)."""
        return self._floors.pop(req_id, 0)

    def release(self, req_id: str, why: str) -> None:
        m = self._markers.pop(req_id, None)
        if m is not None:
            self._session.call("coalesce", lambda _ns: m.reservation.abort())
            self._log.debug("cxlkv: %s: intent marker released (%s)", req_id, why)

    def finished(self, req_id: str, saves_in_flight: bool) -> None:
        self._pending.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._floors.pop(req_id, None)
        self._waited.discard(req_id)
        if not saves_in_flight:  # else released with finished_sending
            self.release(req_id, "finished")

    def close(self) -> None:
        for req_id in list(self._markers):
            self.release(req_id, "shutdown")

    def holds(self, req_id: str) -> bool:
        return req_id in self._markers


@dataclasses.dataclass
class _Waiting:
    wait: WaitOp
    deadline: float
    next_poll: float
    interval: float = FIRST_POLL_S


class CoalesceWorker:
    """Worker side: polls the pool for the blocks of each wait; loads them once all are there,
    or the leading ones when the wait gives up."""

    def __init__(self, session: Any, count: Callable[..., None], logger: Any) -> None:
        self._session = session
        self._count = count
        self._log = logger
        self._waits: dict[str, _Waiting] = {}
        self._idle = False

    def add(self, waits: Iterable[WaitOp], idle: bool) -> None:
        now = time.monotonic()
        for w in waits:
            self._waits[w.op.req_id] = _Waiting(w, now + w.wait_s, now)
        self._idle = idle

    def pending(self) -> int:
        return len(self._waits)

    def poll(self, finished_req_ids: Iterable[str], load: Callable[[BlockOp], int]) -> tuple[set, set]:
        """Returns (requests done waiting, vLLM block ids to recompute). ``load(op)`` copies the
        op's blocks through the checksummed path and returns the leading count loaded."""
        done: set[str] = set()
        errors: set[int] = set()
        for req_id in set(finished_req_ids) & set(self._waits):  # aborted while waiting
            del self._waits[req_id]
            done.add(req_id)
        now = time.monotonic()
        for req_id, st in list(self._waits.items()):
            if now < st.next_poll:
                continue
            outcome = self._check(st, now)
            if outcome is None:
                st.interval = min(st.interval * 2, MAX_POLL_S)
                st.next_poll = now + st.interval
                continue
            present, cause = outcome
            del self._waits[req_id]
            done.add(req_id)
            errors |= self._finish(st.wait, present, cause, now - (st.deadline - st.wait.wait_s), load)
        if self._idle and self._waits and not done:
            # Nothing else runs in this engine: without a pause its loop would spin on a core the
            # writer computes on.
            time.sleep(min(MAX_IDLE_SLEEP_S, max(0.0, min(s.next_poll for s in self._waits.values()) - now)))
        return done, errors

    def _check(self, st: _Waiting, now: float) -> tuple[int, str | None] | None:
        """None: keep waiting; else (leading blocks present, why the wait gave up or None)."""
        keys = st.wait.op.keys
        present = self._session.call("coalesce", lambda ns: ns.match_prefix(keys), retry=False)
        if present is None:
            return 0, "pool_unavailable"
        if present >= len(keys):
            return present, None
        if now >= st.deadline:
            return present, "deadline"
        state = self._session.call("coalesce", lambda ns: _probe(ns, st.wait.marker, st.wait.op.start_depth))
        if state == "in_flight":
            return None
        # The writer is done, gone or dropped it: its last blocks may have landed meanwhile.
        again = self._session.call("coalesce", lambda ns: ns.match_prefix(keys), retry=False)
        present = max(present, again or 0)
        return present, (None if present >= len(keys) else "writer_gone")

    def _finish(
        self, wait: WaitOp, present: int, cause: str | None, waited_s: float, load: Callable[[BlockOp], int]
    ) -> set[int]:
        op = wait.op
        n = (
            load(BlockOp(op.req_id, op.keys[:present], op.block_ids[:present], op.start_depth))
            if present
            else 0
        )
        self._count("coalesced_blocks", max(0, n - wait.already))
        missing = len(op.keys) - n
        if cause is not None or missing:
            cause = cause or "writer_gone"  # present, then failed its checksum or was evicted
            self._count("coalesce_fallback_" + cause)
            self._count("coalesce_recomputed_blocks", missing)
            self._log.info(
                "cxlkv: %s: gave up waiting after %.1f s (%s): %d of %d blocks loaded, vLLM "
                "recomputes the rest",
                op.req_id,
                waited_s,
                cause,
                n,
                len(op.keys),
            )
        else:
            self._log.info(
                "cxlkv: %s: %d blocks computed by another engine loaded after %.1f s",
                op.req_id,
                n,
                waited_s,
            )
        return set(op.block_ids[n:])

    def close(self) -> None:
        self._waits.clear()


def _probe(ns: Any, marker: bytes, depth: int) -> str:
    """The marker's state without holding it: a reserve that succeeds means nobody holds it (a
    dead writer's entry counts as absent) and is aborted at once."""
    res = ns.reserve([marker], start_depth=depth, blocks=False)
    state = res.states[0]
    res.abort()
    return str(state)
