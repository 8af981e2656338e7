"""Coalescing of new prefixes (integrations/coalesce.py) without vLLM: intent markers on a real
pool, each engine a real node (its own PoolSession), a writer killed with kill -9 in a real child
process. The real-engine tests are tests/vllm/test_coalesce.py."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest

import cxlkv
from cxlkv.integrations.coalesce import (
    DEFAULT_PREFILL_TPS,
    CoalesceConfig,
    CoalesceScheduler,
    CoalesceWorker,
    PrefillRate,
    WaitOp,
    WriterClock,
    compute_place,
    cotoo_marker,
    intent_key,
)
from cxlkv.integrations.coalesce_clock import (
    CLOCK_NAMESPACE,
    CLOCK_RECORD,
    MIN_CLOCK_CHUNKS,
    ClockBoard,
    clock_key,
    clock_layout,
)
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.transfer import BlockOp

LOG = logging.getLogger("test-coalesce")
LAYERS, BLOCKS, BS, HEADS, HEAD = 2, 16, 4, 1, 8


def layout() -> cxlkv.KVLayout:
    return cxlkv.KVLayout(
        "coalesce-test",
        dtype="bf16",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        tokens_per_block=BS,
    )


@pytest.fixture
def pool_path(pool_path):
    """conftest's pool path (removed after the test), with a 64 MiB pool created there."""
    cxlkv.Pool.create(pool_path, "64MiB").close()
    return pool_path


class Counts(dict):
    """The connector's counters as vLLM sees them (zero increments are never sent)."""

    def __call__(self, key: str, n: float = 1) -> None:
        if n:
            self[key] = self.get(key, 0) + n

    def blocks(self) -> dict:
        """Without the seconds waited (a wall-clock figure)."""
        return {k: v for k, v in self.items() if k != "coalesce_wait_s"}


def session(path: str) -> PoolSession:
    return PoolSession(
        path,
        LOG,
        lambda create: cxlkv.Pool.open(path),
        lambda pool: pool.namespace(layout(), name="coalesce-test"),
    )


class Records:
    """The pool's clock-record namespace as a third node sees it (coalesce_clock.py); keys of the
    KV namespace "coalesce-test"."""

    def __init__(self, path: str) -> None:
        self.pool = cxlkv.Pool.open(path)
        self.ns = self.pool.namespace(clock_layout(), name=CLOCK_NAMESPACE)

    def get(self, intent: bytes) -> bytes | None:
        return self.ns.get_bytes(clock_key(intent, "coalesce-test"))

    def put(self, intent: bytes, raw: bytes) -> bool:
        self.ns.delete(clock_key(intent, "coalesce-test"))
        return self.ns.put(clock_key(intent, "coalesce-test"), raw)

    def close(self) -> None:
        self.pool.close()


def chain(seed: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def kv() -> list:
    return [np.zeros((2, BLOCKS, BS, HEADS, HEAD), np.uint16) for _ in range(LAYERS)]  # K and V


def state_of(path: str, marker: bytes) -> str:
    """What a third node finds: in_flight (held) or reserved (nobody holds it)."""
    s = session(path)
    try:
        res = s.ns.reserve([marker], blocks=False)
        state = res.states[0]
        res.abort()
        return state
    finally:
        s.close()


def test_marker_derivation():
    k = bytes(range(32))
    m = intent_key(k)
    assert m == hashlib.sha256(k + b"cxlkv-intent").digest()  # the documented derivation
    assert len(m) == 32 and m != k and intent_key(k) == m
    assert intent_key(bytes(32)) != m  # another chain, another marker
    with pytest.raises(ValueError, match="32 bytes"):
        intent_key(b"short")


def test_config_defaults_and_errors():
    assert CoalesceConfig.from_extra({}) == CoalesceConfig(True, 30.0, DEFAULT_PREFILL_TPS, False)  # on
    assert DEFAULT_PREFILL_TPS == 250.0  # documented (README, ARCHITECTURE §9)
    assert CoalesceConfig.from_extra({"coalesce": False, "coalesce_wait_s": 2}) == CoalesceConfig(False, 2.0)
    fixed = CoalesceConfig.from_extra({"coalesce_prefill_tokens_per_s": 50})
    assert fixed.prefill_tps == 50.0 and fixed.fixed_rate
    for bad in (
        {"coalesce": "no"},
        {"coalesce_wait_s": 0},
        {"coalesce_wait_s": "5"},
        {"coalesce_wait_s": True},
        {"coalesce_prefill_tokens_per_s": 0},
        {"coalesce_prefill_tokens_per_s": "fast"},
    ):
        with pytest.raises(ValueError, match="coalesce"):
            CoalesceConfig.from_extra(bad)


def scheduler(
    path: str, counts: Counts | None = None, wall=time.time, place=(0, 0), **cfg
) -> CoalesceScheduler:
    cfg.setdefault("prefill_tps", 1.0)  # a slow engine: the bound is wait_s unless a test sets it
    return CoalesceScheduler(
        CoalesceConfig(**cfg, fixed_rate=True),
        session(path),
        Counts() if counts is None else counts,
        LOG,
        BS,
        wall=wall,
        place=place,
    )


def writer(path: str, counts: Counts | None = None, **cfg) -> CoalesceScheduler:
    """An engine far faster than `scheduler`'s: its blocks are expected long before a waiter could
    compute them, so a waiter waits (the tests of what a wait does)."""
    cfg.setdefault("prefill_tps", 1e6)
    return scheduler(path, counts, **cfg)


def test_first_engine_writes_second_waits(pool_path):
    keys = chain(1, 6)
    a_counts, b_counts = Counts(), Counts()
    a, b = writer(pool_path, a_counts), scheduler(pool_path, b_counts)
    assert a.on_miss("ra", keys, 0, 0, 6, True, True) is None and a.holds("ra")
    assert a.on_miss("ra", keys, 0, 0, 6, True, True) is None and a.holds("ra")  # looked up again
    assert a.on_miss("ra2", keys, 0, 0, 6, True, True) is None and not a.holds("ra2")  # same engine
    wait = b.on_miss("rb", keys, 0, 0, 6, True, True)
    assert isinstance(wait, WaitOp) and wait.op.keys == keys and wait.uncovered == 0
    assert all(state_of(pool_path, intent_key(k)) == "in_flight" for k in keys)  # A's: one per block
    b.lookup_started("rb")  # not scheduled: vLLM looks it up again, and this time it does not wait
    assert not b.allocated("rb", list(range(10, 16)), 6 * BS, BS)
    assert b.on_miss("rb", keys, 0, 0, 6, True, True) is not None
    assert b.allocated("rb", list(range(10, 16)), 6 * BS, BS)
    assert [w.op.block_ids for w in b.take_waits()] == [list(range(10, 16))]
    assert a_counts == {"coalesce_intents": 1} and b_counts == {"coalesce_waits": 1}
    # Off: neither takes a marker nor waits.
    off = scheduler(pool_path, enabled=False)
    assert off.on_miss("rc", chain(2, 3), 0, 0, 3, True, True) is None and not off.holds("rc")
    # A local hit beyond the pool's: no waiting; a consumer that never saves: no marker.
    assert b.on_miss("rd", keys, 2, 0, 6, True, True) is None
    assert b.on_miss("re", chain(3, 3), 0, 0, 3, False, True) is None and not b.holds("re")
    assert state_of(pool_path, intent_key(chain(3, 3)[0])) == "reserved"


@pytest.mark.parametrize("path", ["finished", "saves_in_flight", "preempted", "saved", "shutdown", "remiss"])
def test_marker_released_on_every_path(pool_path, path):
    keys = chain(7, 4)
    marker = intent_key(keys[0])
    a = scheduler(pool_path)
    a.on_miss("r", keys, 0, 0, 4, True, True)
    assert state_of(pool_path, marker) == "in_flight"
    if path == "finished":
        a.finished("r", saves_in_flight=False)
    elif path == "saves_in_flight":  # asynchronous saves: held until every copy is done
        a.finished("r", saves_in_flight=True)
        a.step_done(1, set(), (), ())
        assert state_of(pool_path, marker) == "in_flight"
        a.step_done(2, set(), (), {"r"})
    elif path == "preempted":
        a.release("r", "preempted")
    elif path == "saved":  # synchronous saves: once the step carrying the last block completed
        a.saves_planned("r", 3, step=5)
        a.step_done(5, set(), (), ())
        assert state_of(pool_path, marker) == "in_flight"
        a.saves_planned("r", 4, step=6)
        a.step_done(5, set(), (), ())
        assert state_of(pool_path, marker) == "in_flight"
        a.step_done(6, set(), (), ())
    elif path == "shutdown":
        a.close()
    elif path == "remiss":  # looked up again, now missing at another block: the old one goes
        a.on_miss("r", keys, 0, 1, 4, True, True)
        assert a.holds("r") and state_of(pool_path, intent_key(keys[1])) == "in_flight"
        a.release("r", "test")
    assert not a.holds("r")
    assert state_of(pool_path, marker) == "reserved"


def loader(path: str):
    s = session(path)
    arrays = kv()

    def load(op: BlockOp) -> int:
        return (
            s.call("load", lambda ns: ns.load(op.keys, arrays, op.block_ids, block_dim=1), retry=False) or 0
        )

    return s, arrays, load


def waiting(path: str, sched: CoalesceScheduler, idle: bool, clock=time.monotonic):
    """A coalescing worker given ``sched``'s new waits (``idle``: its engine computes nothing
    meanwhile), with its counters, and a loader's arrays and load function."""
    counts = Counts()
    w = CoalesceWorker(session(path), counts, LOG, clock=clock)
    _, arrays, load = loader(path)
    w.add(sched.take_waits(), idle=idle)
    return w, counts, arrays, load


def store(path: str, keys: list, value: int) -> None:
    s = session(path)
    arrays = kv()
    for a in arrays:
        a[:] = value
    assert s.ns.store(keys, arrays, list(range(len(keys))), block_dim=1) == len(keys)
    s.close()


def poll_until_done(worker: CoalesceWorker, load, bound: int = 2000) -> tuple[set, set]:
    for _ in range(bound):
        done, errors = worker.poll(set(), load)
        if done:
            return done, errors
    raise AssertionError("the wait never ended")


def test_waiter_loads_blocks_once_the_writer_publishes_them(pool_path):
    keys = chain(11, 4)
    a, b = writer(pool_path), scheduler(pool_path)
    store(pool_path, keys[:1], 5)  # block 0 was in the pool already
    a.on_miss("ra", keys, 0, 1, 4, True, True)
    wait = b.on_miss("rb", keys, 0, 1, 4, True, True)
    assert wait is not None and wait.already == 1
    b.allocated("rb", [8, 9, 10, 11], 4 * BS, BS)
    w, counts, arrays, load = waiting(pool_path, b, idle=True)
    for _ in range(5):
        assert w.poll(set(), load) == (set(), set())  # the writer still computes
    store(pool_path, keys, 7)  # its saves (block 0 was present: kept as it was)
    a.finished("ra", saves_in_flight=False)
    assert poll_until_done(w, load) == ({"rb"}, set())
    assert counts.blocks() == {"coalesced_blocks": 3, "coalesce_saved_tokens": 3 * BS}
    assert all((arr[:, 9:12] == 7).all() and (arr[:, 8] == 5).all() for arr in arrays)
    b.step_done(1, set(), {"rb"}, ())
    assert b.loaded_floor("rb") == 4


def test_writer_done_with_fewer_blocks_and_deadline(pool_path):
    keys = chain(12, 4)
    a, b = writer(pool_path), scheduler(pool_path, wait_s=0.3)
    a.on_miss("ra", keys, 0, 0, 4, True, True)
    b.on_miss("rb", keys, 0, 0, 4, True, True)
    b.allocated("rb", [0, 1, 2, 3], 4 * BS, BS)
    w, counts, _, load = waiting(pool_path, b, idle=True)
    store(pool_path, keys[:2], 3)  # the writer's prompt was shorter: two blocks
    a.finished("ra", saves_in_flight=False)
    assert poll_until_done(w, load) == ({"rb"}, {2, 3})
    assert counts.blocks() == {
        "coalesced_blocks": 2,
        "coalesce_saved_tokens": 2 * BS,
        "coalesce_fallback_writer_gone": 1,
        "coalesce_recomputed_blocks": 2,
        "coalesce_partial_loads": 1,
    }
    b.step_done(1, {2, 3}, {"rb"}, ())
    assert b.loaded_floor("rb") == 2

    # A writer that holds its marker and publishes nothing: the deadline ends the wait.
    keys = chain(13, 2)
    a.on_miss("ra", keys, 0, 0, 2, True, True)
    b.on_miss("rc", keys, 0, 0, 2, True, True)
    b.allocated("rc", [4, 5], 2 * BS, BS)
    counts.clear()
    w.add(b.take_waits(), idle=True)
    assert poll_until_done(w, load) == ({"rc"}, {4, 5})
    assert counts.blocks() == {"coalesce_fallback_deadline": 1, "coalesce_recomputed_blocks": 2}
    # vLLM looks the request up again to recompute: the marker is still held, but it does not
    # wait twice (one coalesce_wait_s per request at most); once finished, the id may wait again.
    b.step_done(2, {4, 5}, {"rc"}, ())
    assert b.on_miss("rc", keys, 0, 0, 2, True, True) is None and not b.holds("rc")
    b.finished("rc", saves_in_flight=False)
    assert b.on_miss("rc", keys, 0, 0, 2, True, True) is not None
    b.finished("rc", saves_in_flight=False)
    # A waiter aborted meanwhile is reported at once, with nothing loaded.
    b.on_miss("rd", keys, 0, 0, 2, True, True)
    b.allocated("rd", [6, 7], 2 * BS, BS)
    w.add(b.take_waits(), idle=False)
    assert w.poll({"rd"}, load) == ({"rd"}, set())
    a.close()


WRITER = textwrap.dedent(
    """
    import sys, time, cxlkv
    sys.path.insert(0, {here!r})
    from test_coalesce_unit import session, chain
    from cxlkv.integrations.coalesce import CoalesceConfig, CoalesceScheduler
    import logging
    s = CoalesceScheduler(CoalesceConfig(), session({path!r}), lambda *a: None, logging.getLogger(), 4)
    s.on_miss("writer", chain(21, 3), 0, 0, 3, True, True)
    print("HOLDING", flush=True)
    time.sleep(600)
    """
)


def test_writer_killed_waiter_recomputes(pool_path):
    keys = chain(21, 3)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(here=here, path=pool_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "HOLDING"
        b = scheduler(pool_path)
        assert b.on_miss("rb", keys, 0, 0, 3, True, True) is not None  # the child holds it
        b.allocated("rb", [1, 2, 3], 3 * BS, BS)
        w, counts, _, load = waiting(pool_path, b, idle=True)
        assert w.poll(set(), load) == (set(), set())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        assert poll_until_done(w, load) == ({"rb"}, {1, 2, 3})
        assert counts["coalesce_fallback_writer_gone"] == 1
        # The dead writer's marker is free for the next engine that misses there.
        assert b.on_miss("rc", keys, 0, 0, 3, True, True) is None and b.holds("rc")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)


# ---------------------------------------------------------------------------------------------
# Issue 24 item 2: a wait covers only what another engine's intents cover, and is bounded by the
# estimated time to compute it; a writer dead, stalled or short releases its waiters at once.


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_next_turn_waits_only_for_the_blocks_the_turn_in_flight_covers(pool_path):
    """Turn 1 (4 blocks) is in flight on A; turn 2 on B shares them and adds 2: B waits for the 4
    and takes the intents of the 2 it computes; C, with turn 2 too, waits for all 6 (A's and B's).
    A prompt that diverges at block 3 waits for blocks 0-2 only."""
    turn1 = chain(31, 4)
    turn2 = turn1 + [hashlib.sha256(b"turn2/%d" % i).digest() for i in range(2)]
    counts = Counts()
    a, b, c = writer(pool_path), scheduler(pool_path, counts), scheduler(pool_path)
    assert a.on_miss("t1", turn1, 0, 0, 4, True, True) is None and a.held_blocks("t1") == (0, 4)
    wait = b.on_miss("t2", turn2, 0, 0, 6, True, True)
    assert wait is not None and wait.op.keys == turn1 and wait.uncovered == 2
    assert b.held_blocks("t2") == (4, 6)  # the blocks it computes at once: others may wait for them
    assert b.allocated("t2", list(range(20, 26)), 4 * BS, BS)  # vLLM: 4 blocks external
    assert counts == {"coalesce_intents": 1, "coalesce_waits": 1, "coalesce_uncovered_blocks": 2}
    wait_c = c.on_miss("t2c", turn2, 0, 0, 6, True, True)
    assert wait_c is not None and wait_c.op.keys == turn2 and wait_c.uncovered == 0
    assert not c.holds("t2c")  # every block is somebody's
    diverged = turn1[:3] + [hashlib.sha256(b"other").digest()]
    wait_d = c.on_miss("d", diverged, 0, 0, 4, True, True)
    assert wait_d is not None and wait_d.op.keys == turn1[:3] and wait_d.uncovered == 1
    assert c.held_blocks("d") == (3, 4)
    # Nothing in flight at the first missing block: no wait at all, even if later ones are.
    assert (
        scheduler(pool_path).on_miss("e", [hashlib.sha256(b"x").digest(), *turn1], 0, 0, 5, True, True)
        is None
    )
    for s in (a, b, c):
        s.close()


def test_wait_loads_the_covered_part_and_counts_it(pool_path):
    turn1 = chain(32, 3)
    turn2 = turn1 + chain(33, 2)
    a, b = writer(pool_path), scheduler(pool_path)
    a.on_miss("t1", turn1, 0, 0, 3, True, True)
    b.on_miss("t2", turn2, 0, 0, 5, True, True)
    b.allocated("t2", [5, 6, 7, 8, 9], 3 * BS, BS)
    w, counts, _, load = waiting(pool_path, b, idle=False)
    assert w.poll(set(), load) == (set(), set())
    store(pool_path, turn1, 4)
    assert w.poll(set(), load) == ({"t2"}, set())  # the step after they landed
    assert counts["coalesced_blocks"] == 3 and counts["coalesce_saved_tokens"] == 3 * BS
    assert counts["coalesce_partial_loads"] == 1  # the 2 uncovered blocks are computed
    assert "coalesce_recomputed_blocks" not in counts and counts["coalesce_wait_s"] >= 0
    a.close()
    b.close()


def test_prefill_rate_measured_from_steps():
    clock = Clock()
    rate = PrefillRate(1000.0, clock=clock)
    assert rate.seconds_for(500) == 0.5 and not rate.measured  # the default before a measurement
    rate.step_planned(2000)
    clock.t += 0.5
    rate.step_done()
    assert rate.measured and rate.tps == pytest.approx(4000)
    rate.step_planned(4)  # a decode step: too few prompt tokens to say anything
    clock.t += 1.0
    rate.step_done()
    assert rate.tps == pytest.approx(4000)
    # Asynchronous scheduling: the next step was planned before this one completed; it runs from
    # the completion of the previous one.
    rate.step_planned(1000)
    rate.step_planned(1000)
    clock.t += 1.0
    rate.step_done()
    clock.t += 1.0
    rate.step_done()
    # tokens over seconds, each sum decayed by 0.7 per step: not an average of the steps' rates
    assert rate.tps == pytest.approx((2000 * 0.7**2 + 1000 * 0.7 + 1000) / (0.5 * 0.7**2 + 1.0 * 0.7 + 1.0))
    # A short step whose time is mostly a step's fixed cost moves the rate little.
    before = rate.tps
    rate.step_planned(64)
    clock.t += 0.25  # 256 tokens/s for this step alone
    rate.step_done()
    assert 0.8 * before < rate.tps < before
    fixed = PrefillRate(100.0, fixed=True, clock=clock)
    fixed.step_planned(5000)
    clock.t += 0.1
    fixed.step_done()
    assert fixed.tps == 100.0  # an operator's rate is kept


def test_wait_bound_from_the_prefill_rate(pool_path):
    """The bound is the time this engine would take to compute the blocks waited for: a writer
    slower than that loses its waiter at the bound (deadline), which loads what landed."""
    keys = chain(34, 4)
    a = writer(pool_path)
    b = scheduler(pool_path, prefill_tps=float(BS * 4) / 2.0, wait_s=30.0)  # 4 blocks: 2 s
    assert b.bounds(4 * BS) == (pytest.approx(2.0), pytest.approx(4.0))
    assert b.bounds(10**9)[0] == 30.0  # capped by coalesce_wait_s
    # Other requests' prompt tokens still to compute here would share the steps: a longer bound.
    assert b.bounds(4 * BS, backlog=4 * BS)[0] == pytest.approx(4.0)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    wait = b.on_miss("r", keys, 0, 0, 4, True, True)
    assert wait is not None and wait.wait_s == pytest.approx(2.0)
    b.allocated("r", [0, 1, 2, 3], 4 * BS, BS)
    clock = Clock()
    w, counts, _, load = waiting(pool_path, b, idle=False, clock=clock)
    for _ in range(3):
        clock.t += 0.5
        store(pool_path, keys[: 1 + _], 2)  # progress: no stall
        assert w.poll(set(), load) == (set(), set())
    clock.t += 0.5  # 2 s: the bound
    assert w.poll(set(), load) == ({"r"}, {3})
    assert counts["coalesce_fallback_deadline"] == 1 and counts["coalesced_blocks"] == 3
    assert counts["coalesce_partial_loads"] == 1 and counts["coalesce_recomputed_blocks"] == 1
    # The bound follows the measured rate: a faster engine waits less.
    b.rate.tps *= 4
    assert b.bounds(4 * BS)[0] == pytest.approx(0.5)
    a.close()


def test_stalled_writer_releases_its_waiter(pool_path):
    """A writer that holds its intents and makes no progress (e.g. queued behind other work) is
    given up after STALL_FACTOR x one chunk's estimated compute, long before the bound."""
    keys = chain(35, 8)
    a = writer(pool_path)
    b = CoalesceScheduler(
        CoalesceConfig(prefill_tps=BS, fixed_rate=True),
        session(pool_path),
        Counts(),
        LOG,
        BS,
        chunk_tokens=BS,
    )
    a.on_miss("w", keys, 0, 0, 8, True, True)
    wait = b.on_miss("r", keys, 0, 0, 8, True, True)
    assert wait is not None and wait.wait_s == pytest.approx(8.0) and wait.stall_s == pytest.approx(2.0)
    b.allocated("r", list(range(8)), 8 * BS, BS)
    clock = Clock()
    w, counts, _, load = waiting(pool_path, b, idle=False, clock=clock)
    clock.t += 1.5
    store(pool_path, keys[:2], 1)
    assert w.poll(set(), load) == (set(), set())  # progress at 1.5 s
    clock.t += 1.9
    assert w.poll(set(), load) == (set(), set())
    clock.t += 0.1  # 2 s without a new block
    assert w.poll(set(), load) == ({"r"}, set(range(2, 8)))
    assert counts["coalesce_fallback_stalled"] == 1 and counts["coalesced_blocks"] == 2
    a.close()


@pytest.mark.parametrize("how", ["short", "preempted"])
def test_writer_short_or_preempted_releases_its_waiter_within_a_step(pool_path, how):
    keys = chain(36, 4)
    a, b = writer(pool_path), scheduler(pool_path)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    b.on_miss("r", keys, 0, 0, 4, True, True)
    b.allocated("r", [4, 5, 6, 7], 4 * BS, BS)
    w, counts, _, load = waiting(pool_path, b, idle=False)
    assert w.poll(set(), load) == (set(), set())
    if how == "short":  # it saved 1 block, then finished (its saves of the rest failed)
        store(pool_path, keys[:1], 9)
        a.finished("w", saves_in_flight=False)
    else:
        a.release("w", "preempted")
    done, errors = w.poll(set(), load)  # the very next step
    assert done == {"r"} and errors == ({5, 6, 7} if how == "short" else {4, 5, 6, 7})
    assert counts["coalesce_fallback_writer_gone"] == 1
    a.close()


def test_simultaneous_starts_compute_staggered_arrivals_wait(pool_path):
    """Wait only when waiting is clearly shorter than computing now (issue 24 item 2): two engines
    of the same speed that begin one new prefix at the same moment both compute it (the rule
    before waited, and lost: a tie costs the polls and the load); one that arrives when the writer
    is nearly done, or with a long prefill backlog of its own, waits."""
    wall = Clock()
    wall.t = 1_000_000.0
    tps = 4.0 * BS  # 4 blocks a second in both engines
    counts = Counts()
    a = scheduler(pool_path, wall=wall, prefill_tps=tps)
    b = scheduler(pool_path, counts, wall=wall, prefill_tps=tps)
    keys = chain(41, 8)  # 2 s to compute in either engine
    assert a.on_miss("w", keys, 0, 0, 8, True, True) is None and a.holds("w")
    assert b.on_miss("r", keys, 0, 0, 8, True, True) is None  # same moment, same speed: compute
    assert counts == {"coalesce_declined": 1}
    # A longer backlog here than the writer's: computing would take 2 + 4 s, the writer 2 s.
    assert b.on_miss("r2", keys, 0, 0, 8, True, True, backlog=16 * BS) is not None
    # Staggered: the writer began 1.8 s ago; 0.2 s (+ the settle) left against 2 s here.
    keys2 = chain(42, 8)
    a.on_miss("w2", keys2, 0, 0, 8, True, True)
    wall.t += 1.8
    wait = b.on_miss("r3", keys2, 0, 0, 8, True, True)
    assert wait is not None and wait.wait_s == pytest.approx(2.0)
    # A writer whose engine has a long backlog publishes it: a waiter without one computes.
    keys3 = chain(43, 8)
    a.on_miss("w3", keys3, 0, 0, 8, True, True, backlog=32 * BS)
    wall.t += 1.0
    assert b.on_miss("r4", keys3, 0, 0, 8, True, True, backlog=8 * BS) is None
    assert counts["coalesce_declined"] == 2
    # A run that begins inside the writer's (its first 3 blocks saved meanwhile) ends at its last
    # block, where the clock is: 0.5 s left (+ the settle) against 1.25 s for 5 blocks here.
    keys4 = chain(47, 8)
    wall.t += 100
    a.on_miss("w4", keys4, 0, 0, 8, True, True)
    wall.t += 1.5
    store(pool_path, keys4[:3], 1)
    wait = b.on_miss("r5", keys4, 0, 3, 8, True, True)
    assert wait is not None and wait.op.keys == keys4[:8] and wait.already == 3
    a.close()
    b.close()


def test_writer_clock_is_validated_and_released(pool_path):
    """The writer's clock record comes from the pool (untrusted): anything malformed, from the
    future or a dead writer's leftover long past its expected end counts as no clock (the writer
    is assumed to have just begun). The record goes with the writer's intents."""
    now = 1_000_000.0
    good = WriterClock(now - 1.0, 100.0, 200)
    assert WriterClock.decode(good.encode(), now) == good and good.remaining(now) == pytest.approx(1.0)
    for raw in (
        None,
        b"",
        good.encode()[:-1],
        good.encode() + b"\0",
        b"x" * len(good.encode()),
        WriterClock(now, float("nan"), 1).encode(),
        WriterClock(now, 0.0, 1).encode(),
        WriterClock(now, -5.0, 1).encode(),
        WriterClock(float("inf"), 1.0, 1).encode(),
        WriterClock(now + 60, 1.0, 1).encode(),  # begins a minute from now
        WriterClock(now, 1.0, 1 << 30).encode(),
    ):
        assert WriterClock.decode(raw, now) is None
    wall = Clock()
    wall.t = now
    keys = chain(44, 4)
    a = scheduler(pool_path, wall=wall, prefill_tps=1e6)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    s = Records(pool_path)
    assert s.get(intent_key(keys[0])) == s.get(intent_key(keys[-1])) is not None
    rec = WriterClock.decode(s.get(intent_key(keys[0])), now)  # beside its first intent and its last
    assert rec is not None and rec.start == now and rec.work == 4 * BS and rec.tps == 1e6
    b = scheduler(pool_path, wall=wall, prefill_tps=1.0)
    assert b.on_miss("r", keys, 0, 0, 4, True, True) is not None  # a fast writer: wait
    # A leftover of a writer that began an hour ago: no clock, assumed to begin now at b's rate.
    for k in (keys[0], keys[-1]):
        assert s.put(intent_key(k), WriterClock(now - 3600, 1e6, 16).encode())
    b2 = scheduler(pool_path, wall=wall, prefill_tps=1.0)
    assert b2.on_miss("r", keys, 0, 0, 4, True, True) is None
    a.release("w", "done")
    assert s.get(intent_key(keys[0])) is None and s.get(intent_key(keys[-1])) is None
    for x in (a, b, b2, s):
        x.close()


def test_writer_clock_through_a_per_head_namespace(pool_path):
    """Engines see the pool through heads.HeadNamespace (one entry per KV head of a block): a
    clock record is one plain entry, read and written under its own key, not as a block's heads."""
    from cxlkv.integrations.heads import HeadNamespace, HeadPlan

    def engine(tps: float) -> CoalesceScheduler:
        s = PoolSession(
            pool_path,
            LOG,
            lambda create: cxlkv.Pool.open(pool_path),
            lambda pool: HeadNamespace(pool.namespace(layout(), name="coalesce-test"), HeadPlan(2)),
        )
        return CoalesceScheduler(CoalesceConfig(prefill_tps=tps, fixed_rate=True), s, Counts(), LOG, BS)

    keys = chain(45, 4)
    a, b = engine(1e6), engine(1.0)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    assert b.on_miss("r", keys, 0, 0, 4, True, True) is not None  # a's clock read: a fast writer
    a.release("w", "done")
    s = Records(pool_path)
    assert not any(s.get(intent_key(k)) for k in keys)
    for x in (a, b, s):
        x.close()


def test_tensor_parallel_ranks_wait_for_every_head_and_the_shortest_load_counts(pool_path):
    """TP > 1 (issue 22: coalescing was off): each rank polls a wait with its own session, whose
    lookups ask for every KV head's entry (heads.HeadNamespace), so no rank loads a block before
    every rank's entry of it is READY. A rank that gives up reports its failed blocks in the step
    it does; vLLM reports the request once every rank has: the scheduler keeps the shortest load
    of any step (blocks it has, not to be saved again)."""
    from cxlkv.integrations.heads import HeadNamespace, HeadPlan, head_key

    def rank_session(r: int) -> PoolSession:
        return PoolSession(
            pool_path,
            LOG,
            lambda create: cxlkv.Pool.open(pool_path),
            lambda pool: HeadNamespace(pool.namespace(layout(), name="coalesce-test"), HeadPlan(2, 2, r)),
        )

    keys = chain(46, 4)
    a, b = writer(pool_path), scheduler(pool_path)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    assert b.on_miss("r", keys, 0, 0, 4, True, True) is not None
    b.allocated("r", [10, 11, 12, 13], 4 * BS, BS)
    waits = b.take_waits()
    ranks = [rank_session(r) for r in (0, 1)]
    workers = [CoalesceWorker(s, Counts(), LOG) for s in ranks]
    for w in workers:
        w.add(waits, idle=False)

    def load_heads(r: int):  # the leading blocks whose entry of rank r's head is present
        return lambda op: ranks[r].ns.raw.match_prefix([head_key(k, r) for k in op.keys])

    store(pool_path, keys, 3)  # head 0's entries (rank 0 saved); head 1's not yet
    for r, w in enumerate(workers):
        assert w.poll(set(), load_heads(r)) == (set(), set())
    store(pool_path, [head_key(k, 1) for k in keys], 3)  # rank 1 saved
    for r, w in enumerate(workers):
        assert w.poll(set(), load_heads(r)) == ({"r"}, set())
    # Rank 0 loaded 2 blocks (step 1), rank 1 all 4 (step 2): the request has 2.
    b.step_done(1, {12, 13}, set(), ())
    b.step_done(2, set(), {"r"}, ())
    assert b.loaded_floor("r") == 2
    a.close()
    b.close()
    for s in ranks:
        s.close()


def test_bench_serve_reads_each_requests_coalescing_timeline(tmp_path):
    """bench serve's per-request records carry the coalescing lines of the servers' logs (the
    decision, the wait and its outcome), by the bench's request id."""
    from cxlkv.tools.serve_report import coalesce_events, timeline

    log = tmp_path / "cxlkv-0.log"
    log.write_text(
        "(EngineCore pid=1) INFO 11-28 01:09:31 [coalesce.py:350] cxlkv: cmpl-prc4-2-0-833f3505: blocks "
        "0-15 are being computed by another engine, expected in 1.00 s (its clock); computing them "
        "here would take 8.19 s (0 tokens of backlog at 250 tokens/s): wait\n"
        "(APIServer pid=2) INFO 11-28 01:09:31 [loggers.py:1] Engine 000: Avg prompt throughput\n"
        "(Worker pid=3) INFO 11-28 01:09:33 [coalesce.py:465] cxlkv: cmpl-prc4-2-0-833f3505: 16 blocks "
        "computed by another engine loaded after 2.10 s\n"
        "(EngineCore pid=1) INFO 11-28 01:09:40 [coalesce.py:350] cxlkv: cmpl-moc4-u0-t1-0-9da249e4: "
        "blocks 0-16 ...: compute\n"
    )
    ev = coalesce_events([str(log), str(tmp_path / "missing.log")])
    assert set(ev) == {"prc4-2", "moc4-u0-t1"}
    assert ev["prc4-2"][0].startswith("01:09:31 blocks 0-15") and ev["prc4-2"][0].endswith(": wait")
    assert ev["prc4-2"][1] == "01:09:33 16 blocks computed by another engine loaded after 2.10 s"
    assert ev["moc4-u0-t1"] == ["01:09:40 blocks 0-16 ...: compute"]
    rows = [{"request_id": "prc4-2", "backend": 1, "ttft_s": 2.5}, {"request_id": "prc4-3", "ttft_s": 1.0}]
    assert timeline(rows, ev) == [
        {"request": "prc4-2", "backend": 1, "ttft_ms": 2500, "events": ev["prc4-2"]}
    ]


def test_engines_on_shared_cores_wait_on_a_tie(pool_path, monkeypatch):
    """Two engines of one speed that begin a prefix together: with cores of their own both
    compute it, but when the writer computes on this engine's CPUs (same host, overlapping cores:
    its clock says where), computing too would halve both, so the second waits."""
    wall = Clock()
    wall.t = 2_000_000.0
    tps = 4.0 * BS

    def engine(place):
        return scheduler(pool_path, wall=wall, prefill_tps=tps, place=place)

    for i, (writer_place, waiter_place, waits) in enumerate(
        [
            ((7, 0b01), (7, 0b11), True),  # core 0 is both engines'
            ((7, 0b01), (7, 0b10), False),  # a core each
            ((7, 0b01), (8, 0b01), False),  # another host
            ((0, 0), (0, 0), False),  # not known (a GPU engine)
        ]
    ):
        a, b = engine(writer_place), engine(waiter_place)
        keys = chain(50 + i, 8)
        a.on_miss("w", keys, 0, 0, 8, True, True)
        assert (b.on_miss("r", keys, 0, 0, 8, True, True) is not None) == waits, (writer_place, waiter_place)
        a.close()
        b.close()
    assert compute_place("cuda") == (0, 0)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-2|67")
    host, cpus = compute_place("cpu")
    assert host != 0 and cpus == 0b1111  # CPU 67 folds onto bit 3
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert compute_place("cpu")[1] == sum(1 << (c % 64) for c in os.sched_getaffinity(0))


def test_writer_clock_work_and_lateness(pool_path):
    """A writer that declined to wait computes its whole miss, and says so; a writer late by L is
    expected to need about L more (it was slower than its clock said), not nothing."""
    c = WriterClock(100.0, 10.0, 50)  # expected to end at 105
    assert c.remaining(101.0) == pytest.approx(4.0)
    assert c.remaining(107.0) == pytest.approx(2.0)  # 2 s late: about 2 s more
    assert c.remaining(200.0) == pytest.approx(5.0)  # at most its whole work's time again
    wall = Clock()
    wall.t = 3_000_000.0
    a = scheduler(pool_path, wall=wall, prefill_tps=4.0 * BS)
    b = scheduler(pool_path, wall=wall, prefill_tps=4.0 * BS)
    turn1 = chain(60, 4)
    turn2 = turn1 + chain(61, 2)
    a.on_miss("t1", turn1, 0, 0, 4, True, True)
    assert b.on_miss("t2", turn2, 0, 0, 6, True, True) is None  # a tie: computes all 6 blocks
    s = Records(pool_path)
    rec = WriterClock.decode(s.get(intent_key(turn2[-1])), wall.t)
    assert rec is not None and rec.work == 6 * BS  # not only its own 2 intents' blocks
    for x in (a, b, s):
        x.close()


def test_clock_records_cost_no_kv_block_and_no_tenant_quota(pool_path):
    """A writer's clock records (44 bytes each) live in the pool's small-record namespace, 64-byte
    blocks: the KV namespace holds no block for them (they used to take a whole KV block each,
    evicting real KV in a full pool), the records' namespace costs one chunk, and they are charged
    to no tenant, so they never put a tenant's KV over its quota."""
    pool = cxlkv.Pool.open(pool_path)
    assert pool.info()["chunk_count"] >= MIN_CLOCK_CHUNKS
    pool.set_quota(tenant="team-a", max_bytes=1 << 20)
    s = PoolSession(
        pool_path,
        LOG,
        lambda create: cxlkv.Pool.open(pool_path),
        lambda p: p.namespace(layout(), name="coalesce-test", tenant="team-a"),
    )
    a = CoalesceScheduler(CoalesceConfig(prefill_tps=1e6, fixed_rate=True), s, Counts(), LOG, BS)
    keys = chain(70, 4)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    assert a.holds("w")

    def usage(name: str) -> dict:
        nid = pool.namespace_id(name)
        return next(u for u in pool.namespace_usage() if u["id"] == nid)

    kv, rec = usage("coalesce-test"), usage(CLOCK_NAMESPACE)
    assert kv["used_blocks"] == 0  # intents and clocks: no KV block
    assert rec["used_blocks"] == 2 and rec["chunks"] == 1  # its first intent's and its last's
    info = next(n for n in pool.namespaces() if n["name"] == CLOCK_NAMESPACE)
    assert info["block_bytes"] == 64 and info["blocks_per_chunk"] == pool.info()["chunk_bytes"] // 1024
    [team] = [q for q in pool.quotas() if q["tenant"] == "team-a"]
    assert team["usage_bytes"] == 0
    a.release("w", "done")
    assert usage(CLOCK_NAMESPACE)["used_blocks"] == 0
    a.close()
    s.close()
    pool.close()


def test_forged_or_foreign_clock_records_make_the_waiter_compute(pool_path):
    """Records are untrusted input: junk under a writer's clock key is no clock (the waiter, slow
    next to an unknown writer, computes at once, it does not raise); a namespace of the records'
    name with another layout means no clocks, one warning, and the pool stays usable."""
    keys = chain(71, 4)
    a = scheduler(pool_path, prefill_tps=1e6)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    r = Records(pool_path)
    for k in (keys[0], keys[-1]):
        assert r.put(intent_key(k), os.urandom(CLOCK_RECORD.size))
    b = scheduler(pool_path, prefill_tps=1.0)
    assert b.on_miss("r", keys, 0, 0, 4, True, True) is None  # no clock: a tie, computes now
    r.close()
    for x in (a, b):
        x.close()

    other = f"{pool_path}-other"
    cxlkv.Pool.create(other, "64MiB").close()
    try:
        with cxlkv.Pool.open(other) as p:  # not ours: 128-byte blocks under the records' name
            p.namespace(
                cxlkv.KVLayout(
                    "x",
                    dtype="uint8",
                    num_layers=1,
                    num_kv_heads=1,
                    head_size=128,
                    tokens_per_block=1,
                    kind="opaque",
                ),
                name=CLOCK_NAMESPACE,
            )
        w = scheduler(other, prefill_tps=1e6)
        w.on_miss("w", keys, 0, 0, 4, True, True)
        assert w.holds("w") and w._session.usable()
        v = scheduler(other, prefill_tps=1.0)
        assert v.on_miss("r", keys, 0, 0, 4, True, True) is None and v._session.usable()
        for x in (w, v):
            x.close()
    finally:
        cxlkv.Pool.destroy(other, ignore_attached=True)


def test_a_pool_of_few_chunks_publishes_no_clocks(pool_path):
    """Below MIN_CLOCK_CHUNKS chunks the records' chunk would be too large a share of the KV: no
    clocks (no namespace, no block); intents still say what a writer computes."""
    cxlkv.Pool.destroy(pool_path)
    cxlkv.Pool.create(pool_path, "4MiB", chunk_size="1MiB").close()
    keys = chain(72, 4)
    a = scheduler(pool_path, prefill_tps=1e6)
    a.on_miss("w", keys, 0, 0, 4, True, True)
    assert a.holds("w")
    with cxlkv.Pool.open(pool_path) as p:
        assert p.info()["chunk_count"] < MIN_CLOCK_CHUNKS
        assert [n["name"] for n in p.namespaces()] == ["coalesce-test"]
        assert p.stats()["used_blocks"] == 0
    b = scheduler(pool_path, prefill_tps=1.0)
    assert b.on_miss("r", keys, 0, 0, 4, True, True) is None  # unknown writer, a tie: computes
    for x in (a, b):
        x.close()


def test_an_engine_computing_too_on_these_cores_is_waited_for(pool_path):
    """Three engines on two cores (issue 24 item 2, BENCHMARKS.md's three-server run): the writer
    on core 1; the first comer on core 0 ties with it and computes the run too, and says so (it
    holds the run's "computing too" marker for its host and cores, an intent, and publishes its
    clock beside the run's ends); the second comer on core 0 then waits, for whichever of the two
    is done first, rather than halving the first comer's core, with a bound that counts the shared
    core. An engine on another core, one whose marker is gone (its request finished), or one that
    publishes no place (a GPU engine) computes."""
    wall = Clock()
    wall.t = 4_000_000.0
    tps = 4.0 * BS
    core0 = (7, 0b01)

    def engine(place, counts=None):
        return scheduler(pool_path, counts, wall=wall, prefill_tps=tps, place=place)

    counts = Counts()
    a, b, c = engine((7, 0b10)), engine(core0, counts), engine(core0)
    keys = chain(70, 8)  # 2 s in any engine
    marker = cotoo_marker(intent_key(keys[0]), core0)
    a.on_miss("w", keys, 0, 0, 8, True, True)
    assert b.on_miss("r1", keys, 0, 0, 8, True, True) is None  # a core of its own: a tie, computes
    assert counts == {"coalesce_declined": 1} and state_of(pool_path, marker) == "in_flight"
    assert b.on_miss("r1", keys, 0, 0, 8, True, True) is None  # looked up again: not its own waiter
    assert b.on_miss("r1b", keys, 0, 0, 8, True, True) is None  # its engine's own: vLLM's business
    assert counts == {"coalesce_declined": 2}
    s = Records(pool_path)
    co = [s.ns.get_bytes(clock_key(intent_key(k), "coalesce-test", core0)) for k in keys]
    assert [x is not None for x in co] == [True] + [False] * 6 + [True]  # beside the run's ends
    rec = WriterClock.decode(co[0], wall.t)
    assert rec is not None and rec.shares(core0) and rec.work == 8 * BS
    wait = c.on_miss("r2", keys, 0, 0, 8, True, True)
    assert wait is not None and wait.op.keys == keys
    assert wait.wait_s == pytest.approx(4.0)  # 2 s here, doubled: the cores are shared
    assert engine((7, 0b100)).on_miss("r3", keys, 0, 0, 8, True, True) is None  # core 2: computes
    gpu = engine((0, 0))
    assert gpu.on_miss("r4", keys, 0, 0, 8, True, True) is None and not gpu._cotoo  # place not known
    # Its clock gone (or unbelievable), the marker still says it computes: assumed just begun.
    s.ns.delete(clock_key(intent_key(keys[0]), "coalesce-test", core0))
    s.ns.delete(clock_key(intent_key(keys[-1]), "coalesce-test", core0))
    assert engine(core0).on_miss("r5", keys, 0, 0, 8, True, True) is not None
    # A record read at one place that names another is not believed.
    third = session(pool_path)
    board, plain = ClockBoard(third, LOG), third.ns
    board.publish(plain, intent_key(keys[1]), WriterClock(wall.t, tps, 32, 7, 0b1000), core0)
    assert board.read(plain, intent_key(keys[1]), wall.t, core0) is None
    assert board.read(plain, intent_key(keys[1]), wall.t, (7, 0b1000)) is None  # another key
    # The first comer's request finishes: its marker and records go; the next on core 0 computes.
    b.finished("r1", saves_in_flight=False)
    assert state_of(pool_path, marker) == "reserved"
    assert s.ns.get_bytes(clock_key(intent_key(keys[-1]), "coalesce-test", core0)) is None
    assert engine(core0).on_miss("r6", keys, 0, 0, 8, True, True) is None
    for x in (a, b, c, s, third):
        x.close()


def test_the_clock_namespace_is_capped_to_one_chunk(pool_path):
    """The first engine to open the records' namespace caps it with a namespace quota of one chunk's
    blocks: records past that evict the namespace's own oldest records; a node whose home chunk is
    full never carves another or steals one of KV (red-team review: leftovers of killed writers
    grew it). Each writing node still carves its own home chunk (the allocator's per-node heaps)."""
    a = scheduler(pool_path, prefill_tps=1e6)
    a.on_miss("w", chain(73, 4), 0, 0, 4, True, True)
    r = Records(pool_path)
    info = next(n for n in r.pool.namespaces() if n["name"] == CLOCK_NAMESPACE)
    per_chunk = info["blocks_per_chunk"]
    [cap] = [q for q in r.pool.quotas() if q["namespace"] == CLOCK_NAMESPACE]
    assert cap["kind"] == "namespace" and cap["max_bytes"] == per_chunk * 64
    for i in range(per_chunk + 100):  # more records than one chunk holds
        assert r.put(i.to_bytes(32, "little"), bytes(CLOCK_RECORD.size))
    nid = r.pool.namespace_id(CLOCK_NAMESPACE)
    # two writing nodes (the engine, this handle): a home chunk each, and never a third
    assert next(u for u in r.pool.namespace_usage() if u["id"] == nid)["chunks"] == 2
    assert r.get((per_chunk + 99).to_bytes(32, "little")) is not None  # the newest is kept
    b = scheduler(pool_path, prefill_tps=1e6)  # a second engine sets no second row
    b.on_miss("w2", chain(74, 4), 0, 0, 4, True, True)
    assert len([q for q in r.pool.quotas() if q["namespace"] == CLOCK_NAMESPACE]) == 1
    r.close()
    for x in (a, b):
        x.close()


def test_a_pool_error_opening_the_clocks_is_no_clocks_not_a_broken_cache(pool_path):
    """Clocks are an optimisation: a pool error while opening their namespace (here a read-only
    handle, which cannot create it; a namespace-table lock timeout takes the same path and is
    retried later) means no clocks and one warning; it never escapes into the session's guard,
    which would serve without the KV cache from then on."""
    with cxlkv.Pool.open(pool_path, read_only=True) as ro:
        board = ClockBoard(types.SimpleNamespace(pool=ro), LOG)
        assert board.records() is None and board.records() is None
        assert (
            board.publish(types.SimpleNamespace(name="coalesce-test"), b"k" * 32, WriterClock(1.0, 1.0, 1))
            is False
        )
