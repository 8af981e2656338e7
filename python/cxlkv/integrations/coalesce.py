"""Compute a new prefix once across vLLM instances (issue 16 item 5; issue 24 item 2: never convoy).

An engine that gets a NEW prompt another engine is already computing would compute it again. The
pool knows which chains are being written, so an engine that misses takes an *intent* for every
block it will compute, and another engine that misses there waits for exactly those blocks
(vLLM's asynchronous KV load) when that is clearly shorter than computing them, loads what is
already READY, and computes the rest at once.

* An intent is an index entry in WRITING state with no block, taken with
  ``Namespace.reserve(..., blocks=False)`` on the key :func:`intent_key` derives from the chain key
  of one block: it names exactly the bytes of the prefix up to that block (identity follows the
  bytes), and it is never committed, so it is never readable KV. A writer takes one per prompt
  block it computes (``[hit, prompt blocks)``, in one reserve), so its intents say which keys it
  will write; a node holds at most ``intent_cap`` of them (past it: ``capped``, those blocks are
  simply not covered). They are released (``abort``) once the writer's saves of its prompt blocks
  are done, or when the request finishes, is aborted or preempted; a writer that dies
  (``kill -9``) leaves WRITING entries of a gone node, which the core treats as absent and reclaims.
* A request that misses at block ``hit`` reserves the intents of ``[hit, prompt blocks)`` itself:
  the leading run found ``in_flight`` (another engine's) is what it waits for; every block after
  it is computed at once, and the intents it got there are its own (others may wait for it). A
  next turn that shares all but the last blocks of a turn still in flight thus waits only for the
  blocks that turn covers, never for blocks no intent covers.
* Whether to wait: only when waiting is clearly shorter than computing the blocks now
  (:func:`decide`). A writer publishes its clock beside its first and last intents (a 44-byte
  :class:`WriterClock` in the pool's small-record namespace, never a KV block: coalesce_clock.py;
  when it began, its engine's prefill rate, the prompt tokens its engine computes before its last
  intended block is done, backlog included; deleted with its intents).
  A request that finds the leading blocks in flight compares the writer's expected remaining time
  (the latest of the clocks along the run; a run whose writer published none: assumed to have
  just begun, at this engine's rate) plus ``SETTLE_S`` (save, poll, load), times ``WAIT_MARGIN``,
  with its own time to compute them now (their tokens plus this engine's prefill backlog, at its
  rate; doubled when the writer computes on this engine's CPUs: :func:`compute_place`). Two
  engines of one speed on cores of their own that begin a new prefix at the same moment both
  compute it (a tie is a loss: the wait's polls and load cost time, and a late writer costs the
  whole wait); a request that arrives when the writer is well on, whose engine has a long
  backlog, or that shares the writer's cores, waits.
  Counted: ``coalesce_declined`` (computed instead). A request that declines first takes the
  run's "computing too" marker for its host and cores (:func:`cotoo_marker`, an intent: one
  engine per place gets it) and publishes its clock beside the run's first and last intents; a
  later request on exactly those cores finds the marker held, reads that clock, takes the earlier
  of the two expected times and counts its own compute as shared, so the second of two engines on
  one core waits instead of halving the first (marker and clock go when the request finishes or
  decides afresh).
* Bounds: a wait lasts at most the estimated time to compute what it waits for in this engine
  (the blocks waited for plus the prompt tokens of other requests this engine still has to
  compute, which would share its steps), from this engine's measured prefill rate
  (:class:`PrefillRate`: prompt tokens per second of its own steps;
  ``coalesce_prefill_tokens_per_s`` before the first measurement, or fixed when an operator sets
  it), and never more than ``coalesce_wait_s``. The worker re-checks every step:
  the first missing block's intent gone (writer died, was preempted, finished short) ->
  ``writer_gone``; no new block for ``STALL_FACTOR`` x the time to compute one step's chunk ->
  ``stalled``; the bound passed -> ``deadline``. Then it loads the leading present blocks and
  reports the rest through ``get_block_ids_with_load_errors``, so vLLM recomputes them (policy
  "recompute", which the connector sets).

Everything the worker needs travels in the connector metadata (:class:`WaitOp`): no state is
shared between the scheduler and the worker, so any executor works. Tensor parallelism: every
rank polls a wait with its own session, whose lookups ask for every KV head's entry
(heads.HeadNamespace), so a block counts as present once every rank's entry of it is READY; each
rank loads its heads and reports its failed blocks; vLLM unions the ranks' failures per step and
reports the request once every rank has, and truncates it at the first failed block: the request
has the shortest of the ranks' loads (the scheduler keeps that as its floor).

Hybrid models (several KV cache groups, vllm_groups.py): a boundary is servable in every group only
where its writer stored a bounded group's reach before it, at its anchors (every
``window_checkpoint_blocks`` boundaries and its prompt's last). So a writer also holds an anchor
mark (:func:`anchor_mark`, an intent of its own derivation) for each anchor it computes, released
with its intents; a waiter waits only up to the deepest boundary of the covered run whose mark is
held (none: it computes at once), polls the common hit over the groups (each group's blocks that
boundary needs, the lookup's rule), and loads one op per group. vLLM 0.32 takes no block-level
load failure with several groups, so the outcome is all or nothing: a wait that gives up (its mark
released short of the boundary, stalled, deadline) or whose load falls short loads nothing and
reports the request in ``failed_recving``; vLLM then looks it up again from scratch (it waits once
at most, so it loads what the pool holds and computes the rest). A model with a state group (SSM
/ linear attention) stores a state only where a prefill chunk ends on an anchor; vLLM's "align"
mode ends one at the prompt's last block boundary always (its scheduler's last cacheable
position), at a checkpoint only when the step budget happens to: so its writers mark their
prompt's last boundary only, and a waiter loads the state there with the other groups' blocks.

Extra config: ``coalesce`` (default true), ``coalesce_wait_s`` (default 30: the cap of any one
wait) and ``coalesce_prefill_tokens_per_s`` (the estimate before a measurement; set it to fix it).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from cxlkv.integrations.coalesce_clock import ClockBoard, WriterClock
from cxlkv.integrations.transfer import BlockOp

INTENT_SUFFIX = b"cxlkv-intent"
COTOO_MARK_SUFFIX = b"cxlkv-intent-cotoo"
ANCHOR_MARK_SUFFIX = b"cxlkv-intent-anchor"
# Waiting must be clearly shorter than computing: the writer's expected remaining time (plus the
# settle below) times this margin must be under this engine's own time to compute the blocks now.
# A tie is a loss (the wait's polls and the load cost time, and the estimate is uncertain).
WAIT_MARGIN = 1.25
# A writer that computes on this engine's CPUs (same host, overlapping cores): computing the blocks
# here too would share those cores with it, about this many times slower for both, so a tie waits.
SHARED_FACTOR = 2.0
# Between a writer's last prefill step and its waiter's load: the save is published, the waiter's
# next step polls and loads. Added to the writer's expected remaining time.
SETTLE_S = 0.25
DEFAULT_WAIT_S = 30.0
# Prefill tokens per second assumed before this engine has measured its own: a slow CPU engine's
# (SmolLM2-135M on two cores shared by several servers under load does a few hundred), so the first
# waits on a GPU are longer than needed rather than cut short; the first prefill step measures it.
DEFAULT_PREFILL_TPS = 250.0
RATE_SMOOTHING = 0.3  # per step, the older steps' sums keep 1 - this of their weight
MIN_SAMPLE_TOKENS = 32  # a step with fewer prompt tokens says more about overheads than prefill
STALL_FACTOR = 2.0  # no new block for this many times one chunk's estimated compute: stalled
MIN_STALL_S = 0.25  # ... but at least this long (a save and a poll lie between two chunks)
MAX_IDLE_SLEEP_S = 0.05  # an engine with nothing but waits sleeps this long at most per step
NULL_BLOCK = 0  # vLLM's null block id (a sliding window's blocks out of reach): never loaded into
FALLBACK_CAUSES = ("writer_gone", "stalled", "deadline", "pool_unavailable")
# The connector's counters (vllm_metrics.py STAT_KEYS): requests that took intents, requests that
# waited, blocks they got from another engine (and the prompt tokens that saved), waits that gave
# up (by cause), blocks recomputed then, waits that loaded only part of the prompt's miss, blocks of
# a waiter's miss no intent covered (computed at once), seconds spent waiting.
STAT_KEYS = (
    "coalesce_intents",
    "coalesce_waits",
    "coalesce_declined",
    "coalesced_blocks",
    "coalesce_saved_tokens",
    *(f"coalesce_fallback_{cause}" for cause in FALLBACK_CAUSES),
    "coalesce_recomputed_blocks",
    "coalesce_partial_loads",
    "coalesce_uncovered_blocks",
    "coalesce_wait_s",
)


def intent_key(chain_key: bytes) -> bytes:
    """The intent of "this block of this chain is being computed": sha256(chain key | b"cxlkv-intent").
    A distinct derivation, so an intent is never a block's key, and two engines derive the same
    intent exactly when they would compute the same bytes."""
    if len(chain_key) != 32:
        raise ValueError(f"cxlkv: a chain key has 32 bytes, not {len(chain_key)}")
    return hashlib.sha256(bytes(chain_key) + INTENT_SUFFIX).digest()


def anchor_mark(intent: bytes) -> bytes:
    """A hybrid model's "the writer of this block makes the boundary after it servable in every
    KV cache group": sha256(intent of the boundary's last block | b"cxlkv-intent-anchor"), held
    (never committed) beside the writer's intents for each of its anchors."""
    return hashlib.sha256(bytes(intent) + ANCHOR_MARK_SUFFIX).digest()


def cotoo_marker(intent: bytes, place: tuple[int, int]) -> bytes:
    """The intent "an engine at `place` (host, cpus: compute_place()) computes the run that begins
    at `intent` too": sha256(intent | b"cxlkv-intent-cotoo" | host | cpus), held (never committed)
    by the first engine there that declines to wait for the run's writer."""
    where = struct.pack("<QQ", place[0] & (2**64 - 1), place[1] & (2**64 - 1))
    return hashlib.sha256(bytes(intent) + COTOO_MARK_SUFFIX + where).digest()


@dataclasses.dataclass(frozen=True)
class Decision:
    """Why a request that misses where another engine computes the next blocks waits or not."""

    wait: bool
    own_s: float  # this engine computing the covered blocks now (with its prefill backlog)
    writer_s: float  # the writer's expected remaining time, plus SETTLE_S
    known: bool  # the writer published its clock (else: assumed to have just begun, no backlog)
    shared: bool = False  # the writer, or an engine computing them too, computes on this engine's CPUs
    cotoo: bool = False  # an engine on this engine's CPUs computes them too (it declined its wait)


def decide(own_s: float, writer_s: float, known: bool, shared: bool = False, cotoo: bool = False) -> Decision:
    """Wait only when waiting is clearly shorter than computing now: two engines of their own
    cores that begin the same prefix at the same moment with the same backlog compute it both (a
    tie is a loss); two that share cores would each compute at about half speed, so there the
    one that comes second waits (for the writer, or for an engine on its cores computing too)."""
    cost = own_s * (SHARED_FACTOR if shared or cotoo else 1.0)
    return Decision(writer_s * WAIT_MARGIN < cost, own_s, writer_s, known, shared or cotoo, cotoo)


def _cpu_mask(spec: str) -> int:
    """CPU numbers like "0-3,8|9" (VLLM_CPU_OMP_THREADS_BIND) folded to a 64-bit mask; 0 if none."""
    mask = 0
    for part in spec.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return 0  # "auto", "all", "nobind" or something unexpected: not known
        for cpu in range(int(lo), int(hi or lo) + 1):
            mask |= 1 << (cpu % 64)
    return mask


def compute_place(device_type: str) -> tuple[int, int]:
    """(host, cpus) of an engine computing on `device_type`, for its writer clocks: a CPU engine
    computes on the cores VLLM_CPU_OMP_THREADS_BIND names (else this process's affinity); other
    devices: (0, 0), not known (nothing is assumed shared)."""
    if device_type != "cpu":
        return 0, 0
    host = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "little") or 1
    spec = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    cpus = _cpu_mask(spec) if spec else 0
    if not cpus and hasattr(os, "sched_getaffinity"):
        cpus = _cpu_mask(",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    return host, cpus


def _seconds(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < float(value) <= high:
        raise ValueError(f"cxlkv: {name} must be a number in ({low:g}, {high:g}], not {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class CoalesceConfig:
    enabled: bool = True
    wait_s: float = DEFAULT_WAIT_S
    prefill_tps: float = DEFAULT_PREFILL_TPS
    fixed_rate: bool = False  # the operator set the rate: no measurement replaces it

    @classmethod
    def from_extra(cls, extra: dict) -> CoalesceConfig:
        on = extra.get("coalesce", True)
        if not isinstance(on, bool):
            raise ValueError(f"cxlkv: coalesce must be true or false, not {on!r}")
        wait = _seconds(extra.get("coalesce_wait_s", DEFAULT_WAIT_S), "coalesce_wait_s", 0, 3600)
        tps = extra.get("coalesce_prefill_tokens_per_s")
        if tps is None:
            return cls(on, wait)
        return cls(on, wait, _seconds(tps, "coalesce_prefill_tokens_per_s", 0, 1e9), fixed_rate=True)


class PrefillRate:
    """This engine's prefill rate, measured from its own steps: prompt tokens a step computed over
    the time from its start (its plan, or the previous step's completion if later: steps overlap
    with asynchronous scheduling) to its completion; the default until then. Tokens over seconds of
    the recent steps, each sum decayed by RATE_SMOOTHING per step: a step's weight is its time, so
    a short step whose time is mostly a step's fixed cost (a 64-token suffix after a 2,048-token
    load, decode beside it) moves the rate little. An average of per-step rates weighted them like
    a whole prefill and put a CPU engine's rate at a quarter of what it computes (273 against
    about 1,100 tokens/s), which made waits look shorter than computing when they were not."""

    def __init__(self, default_tps: float, fixed: bool = False, clock: Callable[[], float] = time.monotonic):
        self.tps = default_tps
        self.measured = False
        self._fixed = fixed
        self._clock = clock
        self._steps: collections.deque[tuple[float, int]] = collections.deque()
        self._last_done: float | None = None
        self._tokens = 0.0  # decayed sums of the measured steps
        self._seconds = 0.0

    def step_planned(self, prefill_tokens: int) -> None:
        self._steps.append((self._clock(), prefill_tokens))

    def step_done(self) -> None:
        now = self._clock()
        if not self._steps:
            return
        planned, tokens = self._steps.popleft()
        start = planned if self._last_done is None else max(planned, self._last_done)
        self._last_done = now
        if self._fixed or tokens < MIN_SAMPLE_TOKENS or now <= start:
            return
        self._tokens = (1 - RATE_SMOOTHING) * self._tokens + tokens
        self._seconds = (1 - RATE_SMOOTHING) * self._seconds + (now - start)
        self.tps = self._tokens / self._seconds
        self.measured = True

    def seconds_for(self, tokens: int) -> float:
        return tokens / self.tps


@dataclasses.dataclass
class WaitOp:
    """A request waiting for blocks another engine computes (scheduler -> worker metadata)."""

    op: BlockOp  # keys [start_depth, start_depth + len) of the prompt and the vLLM blocks for them
    wait_s: float  # the bound: estimated time to compute the blocks waited for (capped)
    stall_s: float  # no new block for this long: the writer is stalled
    already: int = 0  # leading blocks that were in the pool when the wait began
    uncovered: int = 0  # the prompt's missing blocks after the wait's: no intent, computed at once
    tokens_per_block: int = 0
    # A hybrid model (several KV cache groups): what each group needs for the boundary waited for
    # (one op per group, its own keys and block ids), and that boundary's anchor mark (its writer
    # holds it until its saves are done). The outcome is all or nothing (vLLM's failed_recving).
    groups: list = dataclasses.field(default_factory=list)
    mark: bytes | None = None


@dataclasses.dataclass
class _CoToo:
    """A request computing blocks another engine's intents cover: its place's marker for the run
    and the intents its "computing too" clock is beside."""

    reservation: Any
    first: bytes  # the run's first intent
    clocks: list


@dataclasses.dataclass
class _Intents:
    keys: list  # the intent keys this request holds (a subset of the reservation's)
    reservation: Any
    start: int  # the first block it holds an intent for
    end_blocks: int  # the request's prompt blocks: released once its saves cover them
    clocks: list = dataclasses.field(default_factory=list)  # intents its clock is beside (deleted on release)
    release_after_step: int | None = None
    marks: Any = None  # a hybrid model's anchor marks (their reservation), released with the intents


class CoalesceScheduler:
    """Scheduler side: takes, holds and releases intents; plans waits and bounds them."""

    def __init__(
        self,
        cfg: CoalesceConfig,
        session: Any,
        count: Callable[..., None],
        logger: Any,
        block_size: int,
        chunk_tokens: int = 2048,
        rate: PrefillRate | None = None,
        wall: Callable[[], float] = time.time,
        place: tuple[int, int] = (0, 0),
        groups: list | None = None,
        checkpoint: int = 0,
        prompt_anchor_only: bool = False,
    ) -> None:
        self.cfg = cfg
        # A hybrid model's KV cache groups (vllm_groups.GroupLayout: index, first_needed) and its
        # anchors (every `checkpoint` boundaries and the prompt's last): a boundary is servable in
        # every group only where its writer made it an anchor. None: one group.
        # `prompt_anchor_only`: a model with a state group, whose writer stores a state only where
        # a prefill chunk ends on an anchor. vLLM's "align" mode ends a chunk at the prompt's last
        # block boundary always, at a checkpoint only by chance: only that one is marked.
        self._groups = groups
        self._checkpoint = checkpoint
        self._prompt_anchor_only = prompt_anchor_only
        self._wall = wall
        self._place = place  # compute_place() of this engine
        self.rate = rate or PrefillRate(cfg.prefill_tps, cfg.fixed_rate)
        self._block_size = block_size
        self._chunk = max(1, chunk_tokens)  # one step's prompt tokens at most (the stall unit)
        self._session = session
        self._clocks = ClockBoard(session, logger)
        self._count = count
        self._log = logger
        self._intents: dict[str, _Intents] = {}
        # Requests that declined a wait and compute blocks another engine's intents cover: the
        # intents their "computing too" records are beside (removed when they finish or re-decide).
        self._cotoo: dict[str, _CoToo] = {}
        self._pending: dict[str, WaitOp] = {}  # decided, blocks not allocated yet
        self._ready: list[WaitOp] = []  # blocks allocated: sent with the next metadata
        self._waiting: dict[str, WaitOp] = {}  # sent to the worker, outcome pending
        self._floors: dict[str, int] = {}  # finished waits: leading blocks now in vLLM's cache
        self._bad: dict[str, int] = {}  # waits in progress: the first block a rank failed to load
        # Requests that waited once: a wait that gave up is not repeated, so one request's delay
        # is bounded by one wait.
        self._waited: set[str] = set()

    def bounds(self, tokens: int, backlog: int = 0, shared: bool = False) -> tuple[float, float]:
        """(wait bound, stall bound) for waiting on `tokens` prompt tokens another engine computes,
        with `backlog` prompt tokens of other requests still to compute in this engine (they share
        its steps with this request's prefill if it computed the blocks itself); `shared`: the
        engine it waits for computes on this engine's CPUs, so computing here would take about
        SHARED_FACTOR times as long (both would share the cores)."""
        slow = SHARED_FACTOR if shared else 1.0
        wait = min(self.cfg.wait_s, slow * self.rate.seconds_for(tokens + backlog))
        stall = max(MIN_STALL_S, slow * STALL_FACTOR * self.rate.seconds_for(min(tokens, self._chunk)))
        return wait, stall

    def on_miss(
        self,
        req_id: str,
        keys: list,
        have: int,
        hit: int,
        max_blocks: int,
        can_save: bool,
        can_load: bool,
        backlog: int = 0,
        group_keys: list | None = None,
    ) -> WaitOp | None:
        """The prompt's pool hit ends at `hit` < `max_blocks`: take intents for the blocks this
        request computes and, where another engine holds the leading ones, return the wait to plan.
        A hybrid model (`group_keys`: each group's chain keys; `keys` the primary group's, `hit`
        the boundary every group serves) waits only up to the deepest boundary of the run whose
        anchor mark the writer holds, and marks its own anchors."""
        if not self.cfg.enabled or hit >= max_blocks:
            return None
        held = self._intents.get(req_id)
        if held is not None:
            if held.start == hit:
                return None  # looked up again (not scheduled last time): still ours
            self.release(req_id, "looked up again at another block")
        self._drop_cotoo(req_id)  # looked up again: it decides afresh
        wanted = [intent_key(k) for k in keys[hit:max_blocks]]
        local = {k for i in self._intents.values() for k in i.keys}
        if wanted[0] in local or any(wanted[0] == c.first for c in self._cotoo.values()):
            return None  # another request of this engine computes it: vLLM's own business
        res = self._session.call("coalesce", lambda ns: ns.reserve(wanted, start_depth=hit, blocks=False))
        states = list(res.states) if res is not None else ["failed"] * len(wanted)
        covered = 0  # the leading blocks another engine's intents cover
        while covered < len(wanted) and states[covered] == "in_flight" and wanted[covered] not in local:
            covered += 1
        may_wait = bool(covered) and can_load and have <= hit and req_id not in self._waited
        if may_wait and self._groups is not None:
            # Only a boundary every group will serve: the deepest of the run its writer marked.
            covered = self._marked_end(wanted[:covered], hit)
            may_wait = covered > 0
        decision = self._decide(req_id, wanted[:covered], hit, backlog) if may_wait else None
        mine = [k for k, s in zip(wanted, states, strict=True) if s == "reserved"]
        if mine and can_save:
            first = hit + states.index("reserved")
            # It computes [hit, end of prompt) now, or [first, end) once its wait for the covered
            # blocks ends.
            waits = decision is not None and decision.wait
            begins = self._wall() + (decision.writer_s if decision is not None and waits else 0.0)
            work = (max_blocks - (first if waits else hit)) * self._block_size + backlog
            clock = WriterClock(begins, self.rate.tps, work, *self._place)
            published = [ck for ck in {mine[0], mine[-1]} if self._publish_clock(ck, clock)]
            self._intents[req_id] = _Intents(mine, res, first, max_blocks, published)
            if self._groups is not None:
                self._intents[req_id].marks = self._mark_anchors(wanted, hit, first, max_blocks)
            self._count("coalesce_intents")
        elif res is not None:
            res.abort()  # nothing to hold (or it never publishes blocks: nobody should wait for it)
        if decision is None:
            return None  # nobody else computes its next block, more here locally, or waited already
        if not decision.wait:
            self._count("coalesce_declined")
            return None
        end = hit + covered
        wait_s, stall_s = self.bounds(covered * self._block_size, backlog, decision.shared)
        op = BlockOp(req_id, list(keys[have:end]), [], start_depth=have)
        wait = WaitOp(op, wait_s, stall_s, already=hit - have, uncovered=max_blocks - end)
        if self._groups is not None and group_keys is not None:
            op.group = self._primary_index()
            wait.mark = anchor_mark(wanted[covered - 1])
            for g in self._groups:
                lo = max(g.first_needed(end), have)
                wait.groups.append(BlockOp(req_id, list(group_keys[g.index][lo:end]), [], lo, group=g.index))
        self._pending[req_id] = wait
        return wait

    def _primary_index(self) -> int:
        return next((g.index for g in self._groups or () if not g.bounded), 0)

    def _anchors(self, first: int, end: int) -> list[int]:
        """A hybrid writer's anchor boundaries in (first, end]: those it makes servable in every
        group (vllm_groups.GroupLayout.anchors_needing), `end` being its prompt's last."""
        if self._prompt_anchor_only:
            return [end] if end > first else []
        step = max(1, self._checkpoint)
        return [a for a in range(first + 1, end + 1) if a % step == 0 or a == end]

    def _mark_anchors(self, wanted: list, hit: int, first: int, end: int) -> Any:
        """Hold the anchor marks of the boundaries this request makes servable in every group
        (their last block is one it computes); None when none could be taken."""
        marks = [anchor_mark(wanted[a - 1 - hit]) for a in self._anchors(first, end)]
        if not marks:
            return None
        return self._session.call("coalesce", lambda ns: ns.reserve(marks, start_depth=first, blocks=False))

    def _marked_end(self, covered: list, hit: int) -> int:
        """Of the leading `covered` blocks another engine computes, how many lead to the deepest
        boundary whose anchor mark it holds (0: none; the waiter computes). The marks are probed,
        never held: a reserve that gets one aborts it at once."""
        marks = [anchor_mark(k) for k in covered]
        res = self._session.call("coalesce", lambda ns: ns.reserve(marks, start_depth=hit + 1, blocks=False))
        if res is None:
            return 0
        states = [str(s) for s in res.states]
        self._session.call("coalesce", lambda _ns: res.abort())
        return next((i + 1 for i in range(len(states) - 1, -1, -1) if states[i] == "in_flight"), 0)

    def _decide(self, req_id: str, covered: list, hit: int, backlog: int) -> Decision:
        """Wait for the `covered` intents' blocks, or compute them now? The writer's expected
        remaining time is the latest of the clocks its writers published along the run (a run
        with none, e.g. one that ends before its writer's last block: assumed to have just begun,
        at this engine's rate)."""
        now = self._wall()
        tokens = len(covered) * self._block_size
        own_s = self.rate.seconds_for(tokens + backlog)
        clocks = [self._read_clock(k, now) for k in covered]
        known = any(c is not None for c in clocks)
        writer_s = max((c.remaining(now) for c in clocks if c is not None), default=0.0)
        if not known:
            writer_s = max(writer_s, self.rate.seconds_for(tokens))
        shared = any(c is not None and c.shares(self._place) for c in clocks)
        d = decide(own_s, writer_s + SETTLE_S, known, shared)
        co_s = self._claim_cotoo(req_id, covered, hit, backlog) if not d.wait and self._place[0] else None
        if co_s is not None:
            # An engine on these very CPUs declined its wait and computes the run too: computing
            # here as well would halve both; the blocks come from whichever of the two is first.
            d = decide(own_s, min(writer_s, co_s) + SETTLE_S, known, shared, cotoo=True)
        self._log.info(
            "cxlkv: %s: blocks %d-%d are being computed by another engine, expected in %.2f s (%s); "
            "computing them here would take %.2f s (%d tokens of backlog at %.0f tokens/s%s%s): %s",
            req_id,
            hit,
            hit + len(covered) - 1,
            d.writer_s,
            "its clock" if known else "no clock: assumed just begun",
            d.own_s,
            backlog,
            self.rate.tps,
            ", on the writer's cores" if shared else "",
            ", an engine on these cores computes them too" if co_s is not None else "",
            "wait" if d.wait else "compute",
        )
        return d

    def _claim_cotoo(self, req_id: str, covered: list, hit: int, backlog: int) -> float | None:
        """This request would compute the `covered` blocks another engine's intents cover (a tie
        with their writer). Several engines may do so, but on one set of CPUs only the first
        should: it takes the run's "computing too" marker for its place (an intent, atomic: of two
        engines on one core deciding at once, one gets it) and publishes its clock beside the
        run's first and last intents. None: this request holds it (or none could be taken);
        else the expected remaining time of the engine on these CPUs that holds it (its clock;
        without one, assumed to have just begun at this engine's rate)."""
        marker = cotoo_marker(covered[0], self._place)
        res = self._session.call("coalesce", lambda ns: ns.reserve([marker], start_depth=hit, blocks=False))
        state = str(res.states[0]) if res is not None else "failed"
        if state == "reserved":
            work = len(covered) * self._block_size + backlog
            clock = WriterClock(self._wall(), self.rate.tps, work, *self._place)
            published = [
                k
                for k in {covered[0], covered[-1]}
                if self._session.call(
                    "coalesce", lambda ns, k=k: self._clocks.publish(_plain(ns), k, clock, self._place)
                )
            ]
            self._cotoo[req_id] = _CoToo(res, covered[0], published)
            return None
        if res is not None:
            self._session.call("coalesce", lambda _ns: res.abort())
        if state != "in_flight":
            return None  # "capped" or "failed": nobody can say; decide as without it
        now = self._wall()
        co = [self._read_clock(k, now, self._place) for k in {covered[0], covered[-1]}]
        known = [c.remaining(now) for c in co if c is not None]
        return max(known) if known else self.rate.seconds_for(len(covered) * self._block_size)

    def _drop_cotoo(self, req_id: str) -> None:
        m = self._cotoo.pop(req_id, None)
        if m is None:
            return
        self._session.call("coalesce", lambda _ns: m.reservation.abort())
        for intent in m.clocks:
            self._session.call(
                "coalesce", lambda ns, i=intent: self._clocks.remove(_plain(ns), i, self._place)
            )

    def _read_clock(
        self, intent: bytes, now: float, place: tuple[int, int] | None = None
    ) -> WriterClock | None:
        return self._session.call(
            "coalesce", lambda ns: self._clocks.read(_plain(ns), intent, now, place), retry=False
        )

    def _publish_clock(self, intent: bytes, clock: WriterClock) -> bool:
        return bool(
            self._session.call("coalesce", lambda ns: self._clocks.publish(_plain(ns), intent, clock))
        )

    def lookup_started(self, req_id: str) -> None:
        """vLLM looks the request up again (it was not scheduled last time): a wait planned then
        is void; this lookup decides afresh."""
        self._pending.pop(req_id, None)

    def allocated(
        self, req_id: str, block_ids: list, external_tokens: int, block_size: int, group_ids: Any = None
    ) -> bool:
        """update_state_after_alloc for a planned wait; False when the request has none.
        `group_ids`: a hybrid model's block ids per group (vLLM's tuple)."""
        wait = self._pending.pop(req_id, None)
        if wait is None:
            return False
        n = external_tokens // block_size
        if n == 0:
            return True
        first = wait.op.start_depth
        if wait.groups and (n != len(wait.op.keys) or group_ids is None):
            # Granted short of the marked boundary: its groups' needs are another boundary's,
            # which no writer promised. Nothing is loaded; vLLM computes (worker: void wait).
            wait.groups = []
        for g in wait.groups:
            g.block_ids = list(group_ids[g.group][g.start_depth : g.start_depth + len(g.keys)])
            if len(g.block_ids) != len(g.keys) or NULL_BLOCK in g.block_ids:
                wait.groups = []
                break
        wait.uncovered += max(0, len(wait.op.keys) - n)
        wait.op.keys = wait.op.keys[:n]
        wait.op.block_ids = list(block_ids[first : first + n])
        wait.already = min(wait.already, n)
        wait.tokens_per_block = block_size
        self._ready.append(wait)
        self._waited.add(req_id)
        self._count("coalesce_waits")
        self._count("coalesce_uncovered_blocks", wait.uncovered)
        self._log.info(
            "cxlkv: %s: blocks %d-%d of its prompt are being computed by another engine; waiting "
            "for them (at most %.2f s; %d blocks after them no intent covers, computed here)",
            req_id,
            first,
            first + n - 1,
            wait.wait_s,
            wait.uncovered,
        )
        return True

    def take_waits(self) -> list[WaitOp]:
        out, self._ready = self._ready, []
        for w in out:
            self._waiting[w.op.req_id] = w
        return out

    def saves_planned(self, req_id: str, saved_blocks: int, step: int) -> None:
        """Synchronous saves: the step that carries the save of the last prompt block publishes it
        before it completes; the intents go once that step has completed."""
        m = self._intents.get(req_id)
        if m is not None and m.release_after_step is None and saved_blocks >= m.end_blocks:
            m.release_after_step = step

    def step_done(
        self,
        completed_steps: int,
        invalid_block_ids: set,
        finished_recving: Iterable[str],
        finished_sending: Iterable[str],
        failed_recving: Iterable[str] = (),
    ) -> None:
        for req_id in [r for r, m in self._intents.items() if m.release_after_step is not None]:
            step = self._intents[req_id].release_after_step
            if step is not None and step <= completed_steps:
                self.release(req_id, "its prompt blocks are saved")
        for req_id in finished_sending:  # asynchronous saves: every copy of the request is done
            self.release(req_id, "its saves are done")
        # With tensor parallelism each rank ends a wait on its own and reports its failed blocks
        # in the step it ends it: vLLM unions them per step and reports the request once every
        # rank has. What the request has is the shortest of the ranks' loads, from any step.
        for req_id, pending in self._waiting.items():
            ids = pending.op.block_ids
            bad = next((i for i, b in enumerate(ids) if b in invalid_block_ids), len(ids))
            self._bad[req_id] = min(bad, self._bad.get(req_id, len(ids)))
        failed = set(failed_recving)
        for req_id in finished_recving:
            wait = self._waiting.pop(req_id, None)
            bad = self._bad.pop(req_id, 0)
            # A failed one (a hybrid model's wait that gave up): vLLM recomputes it from scratch.
            if wait is not None and req_id not in failed:
                self._floors[req_id] = wait.op.start_depth + bad

    def loaded_floor(self, req_id: str) -> int:
        """Blocks a request scheduled after its wait already has (not to be saved again)."""
        return self._floors.pop(req_id, 0)

    def release(self, req_id: str, why: str) -> None:
        self._drop_cotoo(req_id)
        m = self._intents.pop(req_id, None)
        if m is not None:
            self._session.call("coalesce", lambda _ns: m.reservation.abort())
            if m.marks is not None:
                self._session.call("coalesce", lambda _ns: m.marks.abort())
            for intent in m.clocks:
                self._session.call("coalesce", lambda ns, i=intent: self._clocks.remove(_plain(ns), i))
            self._log.debug("cxlkv: %s: %d intents released (%s)", req_id, len(m.keys), why)

    def finished(self, req_id: str, saves_in_flight: bool) -> None:
        self._drop_cotoo(req_id)  # its prefill is over: nobody should wait for it any more
        self._pending.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._bad.pop(req_id, None)
        self._floors.pop(req_id, None)
        self._waited.discard(req_id)
        if not saves_in_flight:  # else released with finished_sending
            self.release(req_id, "finished")

    def close(self) -> None:
        for req_id in list(self._intents):
            self.release(req_id, "shutdown")
        for req_id in list(self._cotoo):
            self._drop_cotoo(req_id)

    def holds(self, req_id: str) -> bool:
        return req_id in self._intents

    def held_blocks(self, req_id: str) -> tuple[int, int] | None:
        """[first, end) of the prompt blocks this request holds intents for (tests, logs)."""
        m = self._intents.get(req_id)
        return None if m is None else (m.start, m.start + len(m.keys))


@dataclasses.dataclass
class _Waiting:
    wait: WaitOp
    began: float
    progress_at: float  # when the last new block of the wait appeared (or it began)
    present: int = 0


class CoalesceWorker:
    """Worker side: re-checks every wait each step (vLLM calls get_finished every step, empty ones
    too); loads its blocks once all are there, or the leading ones when the wait gives up."""

    def __init__(
        self,
        session: Any,
        count: Callable[..., None],
        logger: Any,
        clock: Callable[[], float] = time.monotonic,
        groups: list | None = None,
    ) -> None:
        self._session = session
        self._count = count
        self._log = logger
        self._clock = clock
        self._waits: dict[str, _Waiting] = {}
        self._idle = False
        # A hybrid model: each KV cache group's view of the session (vllm_common.GroupSession), and
        # the waits that ended without their blocks (reported in failed_recving: vLLM refuses
        # block-level failures for several groups and recomputes the request).
        self._groups = groups
        self.failed: set[str] = set()

    def add(self, waits: Iterable[WaitOp], idle: bool) -> None:
        now = self._clock()
        for w in waits:
            self._waits[w.op.req_id] = _Waiting(w, now, now, w.already)
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
        for req_id, st in list(self._waits.items()):
            now = self._clock()
            outcome = self._check(st, now)
            if outcome is None:
                continue
            present, cause = outcome
            del self._waits[req_id]
            done.add(req_id)
            errors |= self._finish(st.wait, present, cause, now - st.began, load)
        if self._idle and self._waits and not done:
            # Nothing else runs in this engine: without a pause its loop would spin on a core the
            # writer computes on. The pause is short next to any bound (MIN_STALL_S).
            time.sleep(MAX_IDLE_SLEEP_S)
        return done, errors

    def take_failed(self) -> set[str]:
        failed, self.failed = self.failed, set()
        return failed

    def _present_groups(self, wait: WaitOp) -> int | None:
        """A hybrid wait: the blocks present over its groups' needs (the lookup's common-hit rule:
        the boundary is served once every group has each block it needs); None: pool unusable."""
        groups = self._groups or []
        total = 0
        for op in wait.groups:
            n = groups[op.group].call("coalesce", lambda ns, k=op.keys: ns.match_prefix(k), retry=False)
            if n is None:
                return None
            total += n
        return total

    def _check(self, st: _Waiting, now: float) -> tuple[int, str | None] | None:
        """None: keep waiting; else (blocks present, why the wait gave up or None). One group:
        the leading blocks of its op, and the writer is the first missing block's intent. A hybrid
        wait (all or nothing): the blocks present over its groups' needs, and the writer is the
        boundary's anchor mark."""
        wait = st.wait
        if wait.mark is not None:
            if not wait.groups or not self._groups:
                return 0, "void"
            mark, primary = wait.mark, self._groups[wait.op.group]
            end = wait.op.start_depth + len(wait.op.keys)
            need = sum(len(op.keys) for op in wait.groups)

            def count() -> int | None:
                return self._present_groups(wait)

            def writer(present: int) -> str:
                return primary.call("coalesce", lambda ns: _probe(ns, mark, end))
        else:
            keys = wait.op.keys
            need = len(keys)

            def count() -> int | None:
                return self._session.call("coalesce", lambda ns: ns.match_prefix(keys), retry=False)

            def writer(present: int) -> str:
                # The first missing block: is it still somebody's intent? (Its writer may have
                # died, been preempted, or finished short of it.)
                depth = wait.op.start_depth + present
                return self._session.call("coalesce", lambda ns: _probe(ns, intent_key(keys[present]), depth))

        present = count()
        if present is None:
            return 0, "pool_unavailable"
        if present >= need:
            return present, None
        if present > st.present:
            st.present, st.progress_at = present, now
        if now - st.began >= wait.wait_s:
            return present, "deadline"
        if now - st.progress_at >= wait.stall_s:
            return present, "stalled"
        if writer(present) != "reserved":
            return None  # held ("in_flight"), or not checkable now ("capped", "failed"): bounded
        # Nobody holds it: its writer is done, gone or dropped it; the blocks may have landed meanwhile.
        present = max(present, count() or 0)
        return present, (None if present >= need else "writer_gone")

    def _finish_groups(
        self, wait: WaitOp, cause: str | None, waited_s: float, load: Callable[[BlockOp], int]
    ) -> set[int]:
        """A hybrid wait: every group's blocks loaded, or the request failed (failed_recving):
        vLLM then computes it from scratch (what it had before the wait is looked up again)."""
        op = wait.op
        if cause is None:
            for g in wait.groups:
                if load(g) < len(g.keys):
                    cause = "writer_gone"  # present, then failed its checksum or was evicted
                    break
        self._count("coalesce_wait_s", waited_s)
        if cause is None:
            got = max(0, len(op.keys) - wait.already)
            self._count("coalesced_blocks", got)
            self._count("coalesce_saved_tokens", got * wait.tokens_per_block)
            if wait.uncovered:
                self._count("coalesce_partial_loads")
            self._log.info(
                "cxlkv: %s: %d blocks computed by another engine loaded in %d KV cache groups after %.2f s",
                op.req_id,
                len(op.keys),
                len(wait.groups),
                waited_s,
            )
            return set()
        self.failed.add(op.req_id)
        if cause == "void":  # vLLM granted other blocks than the ones waited for: nothing to wait on
            self._log.warning(
                "cxlkv: %s: wait void (blocks granted short of its boundary); vLLM computes", op.req_id
            )
            return set()
        self._count("coalesce_fallback_" + cause)
        self._count("coalesce_recomputed_blocks", len(op.keys) - wait.already)
        self._log.info(
            "cxlkv: %s: gave up waiting after %.2f s (%s): nothing loaded (several KV cache groups: "
            "all or nothing), vLLM computes the request",
            op.req_id,
            waited_s,
            cause,
        )
        return set()

    def _finish(
        self, wait: WaitOp, present: int, cause: str | None, waited_s: float, load: Callable[[BlockOp], int]
    ) -> set[int]:
        if wait.mark is not None:
            return self._finish_groups(wait, cause, waited_s, load)
        op = wait.op
        n = (
            load(BlockOp(op.req_id, op.keys[:present], op.block_ids[:present], op.start_depth))
            if present
            else 0
        )
        got = max(0, n - wait.already)
        self._count("coalesced_blocks", got)
        self._count("coalesce_saved_tokens", got * wait.tokens_per_block)
        self._count("coalesce_wait_s", waited_s)
        missing = len(op.keys) - n
        if n and (missing or wait.uncovered):
            self._count("coalesce_partial_loads")
        if cause is not None or missing:
            cause = cause or "writer_gone"  # present, then failed its checksum or was evicted
            self._count("coalesce_fallback_" + cause)
            self._count("coalesce_recomputed_blocks", missing)
            self._log.info(
                "cxlkv: %s: gave up waiting after %.2f s (%s): %d of %d blocks loaded, vLLM "
                "recomputes the rest",
                op.req_id,
                waited_s,
                cause,
                n,
                len(op.keys),
            )
        else:
            self._log.info(
                "cxlkv: %s: %d blocks computed by another engine loaded after %.2f s",
                op.req_id,
                n,
                waited_s,
            )
        return set(op.block_ids[n:])

    def close(self) -> None:
        self._waits.clear()


def _plain(ns: Any) -> Any:
    """The namespace's own object (heads.HeadNamespace's raw one): the clock records' keys derive
    from its name."""
    return getattr(ns, "raw", ns)


def _probe(ns: Any, intent: bytes, depth: int) -> str:
    """An intent's state without holding it: a reserve that succeeds means nobody holds it (a
    dead writer's entry counts as absent) and is aborted at once."""
    res = ns.reserve([intent], start_depth=depth, blocks=False)
    state = res.states[0]
    res.abort()
    return str(state)
