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
import uuid

import numpy as np
import pytest

import cxlkv
from cxlkv.integrations.coalesce import (
    CoalesceConfig,
    CoalesceScheduler,
    CoalesceWorker,
    WaitOp,
    intent_key,
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
def pool_path():
    path = f"/dev/shm/cxlkv-coalesce-{uuid.uuid4().hex}"
    cxlkv.Pool.create(path, "64MiB").close()
    yield path
    if os.path.exists(path):
        os.unlink(path)


class Counts(dict):
    def __call__(self, key: str, n: int = 1) -> None:
        self[key] = self.get(key, 0) + n


def session(path: str) -> PoolSession:
    return PoolSession(
        path,
        LOG,
        lambda create: cxlkv.Pool.open(path),
        lambda pool: pool.namespace(layout(), name="coalesce-test"),
    )


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
    assert CoalesceConfig.from_extra({}) == CoalesceConfig(True, 30.0)  # on by default
    assert CoalesceConfig.from_extra({"coalesce": False, "coalesce_wait_s": 2}) == CoalesceConfig(False, 2.0)
    for bad in (
        {"coalesce": "no"},
        {"coalesce_wait_s": 0},
        {"coalesce_wait_s": "5"},
        {"coalesce_wait_s": True},
    ):
        with pytest.raises(ValueError, match="coalesce"):
            CoalesceConfig.from_extra(bad)


def scheduler(path: str, counts: Counts | None = None, **cfg) -> CoalesceScheduler:
    return CoalesceScheduler(
        CoalesceConfig(**cfg), session(path), Counts() if counts is None else counts, LOG
    )


def test_first_engine_writes_second_waits(pool_path):
    keys = chain(1, 6)
    a_counts, b_counts = Counts(), Counts()
    a, b = scheduler(pool_path, a_counts), scheduler(pool_path, b_counts)
    assert a.on_miss("ra", keys, 0, 0, 6, True, True) is None and a.holds("ra")
    assert a.on_miss("ra", keys, 0, 0, 6, True, True) is None and a.holds("ra")  # looked up again
    assert a.on_miss("ra2", keys, 0, 0, 6, True, True) is None and not a.holds("ra2")  # same engine
    wait = b.on_miss("rb", keys, 0, 0, 6, True, True)
    assert isinstance(wait, WaitOp) and wait.op.keys == keys and wait.marker == intent_key(keys[0])
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
    a, b = scheduler(pool_path), scheduler(pool_path)
    store(pool_path, keys[:1], 5)  # block 0 was in the pool already
    a.on_miss("ra", keys, 0, 1, 4, True, True)
    wait = b.on_miss("rb", keys, 0, 1, 4, True, True)
    assert wait is not None and wait.already == 1
    b.allocated("rb", [8, 9, 10, 11], 4 * BS, BS)
    counts = Counts()
    w = CoalesceWorker(session(pool_path), counts, LOG)
    _, arrays, load = loader(pool_path)
    w.add(b.take_waits(), idle=True)
    for _ in range(5):
        assert w.poll(set(), load) == (set(), set())  # the writer still computes
    store(pool_path, keys, 7)  # its saves (block 0 was present: kept as it was)
    a.finished("ra", saves_in_flight=False)
    assert poll_until_done(w, load) == ({"rb"}, set())
    assert counts == {"coalesced_blocks": 3}
    assert all((arr[:, 9:12] == 7).all() and (arr[:, 8] == 5).all() for arr in arrays)
    b.step_done(1, set(), {"rb"}, ())
    assert b.loaded_floor("rb") == 4


def test_writer_done_with_fewer_blocks_and_deadline(pool_path):
    keys = chain(12, 4)
    a, b = scheduler(pool_path), scheduler(pool_path, wait_s=0.3)
    a.on_miss("ra", keys, 0, 0, 4, True, True)
    b.on_miss("rb", keys, 0, 0, 4, True, True)
    b.allocated("rb", [0, 1, 2, 3], 4 * BS, BS)
    counts = Counts()
    w = CoalesceWorker(session(pool_path), counts, LOG)
    _, _, load = loader(pool_path)
    w.add(b.take_waits(), idle=True)
    store(pool_path, keys[:2], 3)  # the writer's prompt was shorter: two blocks
    a.finished("ra", saves_in_flight=False)
    assert poll_until_done(w, load) == ({"rb"}, {2, 3})
    assert counts == {
        "coalesced_blocks": 2,
        "coalesce_fallback_writer_gone": 1,
        "coalesce_recomputed_blocks": 2,
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
    assert counts == {"coalesced_blocks": 0, "coalesce_fallback_deadline": 1, "coalesce_recomputed_blocks": 2}
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
    s = CoalesceScheduler(CoalesceConfig(), session({path!r}), lambda *a: None, logging.getLogger())
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
        counts = Counts()
        w = CoalesceWorker(session(pool_path), counts, LOG)
        _, _, load = loader(pool_path)
        w.add(b.take_waits(), idle=True)
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
