"""Asynchronous saves (integrations/transfer.py) on a real pool, without vLLM.

* A block is never visible before its bytes are: a writer process saves through CpuTransfer's
  thread, overwriting its source blocks as soon as each save is done, while a reader process
  polls every key; whatever the reader finds has exactly the bytes it was saved with, and no read
  ever fails its checksum.
* The save runs off the caller's thread: submit returns while the copy is still to be done.
* A fence during saves: the transfer thread's session opens the pool again and the saves land.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import time

import numpy as np
import pytest

import cxlkv
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.transfer import SAVE_DELAY_ENV, BlockOp, CpuTransfer

LAYERS, BLOCK_ELEMS = 4, 64 * 1024  # 4 layers x 128 KiB of uint16: 512 KiB per block
NUM_BLOCKS, BATCH, ROUNDS = 16, 8, 12
LAYOUT = dict(model_id="test/transfer", dtype="bf16", num_layers=LAYERS, block_bytes=LAYERS * BLOCK_ELEMS * 2)


def key(rnd: int, i: int) -> bytes:
    return hashlib.sha256(f"{rnd}/{i}".encode()).digest()


def payload(rnd: int, i: int) -> np.ndarray:
    """The bytes block i of round rnd is saved with, per layer (seeded: the reader recomputes them)."""
    return np.random.default_rng(rnd * 1000 + i).integers(0, 1 << 16, (LAYERS, BLOCK_ELEMS), dtype=np.uint16)


def session(path: str) -> PoolSession:
    return PoolSession(
        path,
        logging.getLogger("test_transfer"),
        lambda create: cxlkv.Pool.open(path),
        lambda pool: pool.namespace(cxlkv.KVLayout(**LAYOUT)),
    )


def writer(path: str, go, out) -> None:
    s = session(path)
    arrays = [np.zeros((NUM_BLOCKS, BLOCK_ELEMS), np.uint16) for _ in range(LAYERS)]
    t = CpuTransfer(s, arrays, 0)
    stored = 0
    go.wait()
    for rnd in range(ROUNDS):
        # Two batches in flight at once, on alternate halves of the KV blocks.
        half = (rnd % 2) * BATCH
        ids = list(range(half, half + BATCH))
        for j, b in enumerate(ids):
            p = payload(rnd, j)
            for layer in range(LAYERS):
                arrays[layer][b] = p[layer]
        h = t.submit_save(BlockOp(f"r{rnd}", [key(rnd, j) for j in range(BATCH)], ids))
        if rnd:
            stored += prev.result()  # noqa: F821 - set below, one round earlier
            # Its blocks are reused by the next round as soon as its save is done.
        prev = h
    stored += prev.result()
    t.close()
    out.put(stored)
    s.close()


def reader(path: str, ready, go, stop, out) -> None:
    s = session(path)
    seen, wrong = 0, []
    ready.set()
    go.wait()
    while True:
        # Read stop before the pass, so one whole pass always runs after the writer is done: on
        # a busy 2-core machine the writer can finish before this process is scheduled at all,
        # and the last rounds' blocks are then still there to be checked.
        last = stop.is_set()
        for rnd in range(ROUNDS):
            for j in range(BATCH):
                got = s.ns.get_bytes(key(rnd, j))
                if got is None:
                    continue
                seen += 1
                if bytes(got) != payload(rnd, j).tobytes():
                    wrong.append((rnd, j))
        if last:
            break
    out.put(json.dumps({"seen": seen, "wrong": wrong}))
    s.close()


def test_block_never_visible_before_its_bytes(pool_path):
    cxlkv.Pool.create(pool_path, "64MiB", chunk_size="4MiB").close()
    ctx = mp.get_context("spawn")
    ready, go, stop, wq, rq = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=writer, args=(pool_path, go, wq))
    r = ctx.Process(target=reader, args=(pool_path, ready, go, stop, rq))
    w.start(), r.start()
    assert ready.wait(120), "the reader process never opened the pool"
    go.set()
    stored = wq.get(timeout=120)
    stop.set()
    report = json.loads(rq.get(timeout=120))
    w.join(30), r.join(30)
    assert stored == ROUNDS * BATCH
    assert report["seen"] > 0, "the reader never saw a block: the test checked nothing"
    assert report["wrong"] == [], f"blocks visible with other bytes than saved: {report['wrong']}"
    with cxlkv.Pool.open(pool_path) as pool:
        assert pool.stats()["checksum_failures"] == 0
        assert pool.check()["ok"]


def test_submit_returns_before_the_copy(pool_path, monkeypatch):
    cxlkv.Pool.create(pool_path, "64MiB", chunk_size="4MiB").close()
    monkeypatch.setenv(SAVE_DELAY_ENV, "0.3")
    s = session(pool_path)
    arrays = [np.ones((NUM_BLOCKS, BLOCK_ELEMS), np.uint16) for _ in range(LAYERS)]
    t = CpuTransfer(s, arrays, 0)
    keys = [key(99, j) for j in range(4)]
    t0 = time.monotonic()
    h = t.submit_save(BlockOp("r", keys, [0, 1, 2, 3]))
    assert time.monotonic() - t0 < 0.3 and not h.done()
    assert s.ns.match_prefix(keys) == 0  # nothing visible while it has not copied
    assert h.result() == 4 and h.done() and not h.refused
    assert s.ns.match_prefix(keys) == 4
    assert t.load(BlockOp("r", keys, [4, 5, 6, 7])) == 4
    assert all(np.array_equal(a[4:8], a[0:4]) for a in arrays)
    t.close()
    assert t.submit_save(BlockOp("r", keys, [0, 1, 2, 3])).refused  # closed: refused, never hangs
    s.close()


@pytest.mark.parametrize("backend", ["coherent"])
def test_saves_land_across_a_fence(pool_path, backend):
    cxlkv.Pool.create(pool_path, "64MiB", chunk_size="4MiB", backend=backend, lease_ms=6000).close()
    s = session(pool_path)
    arrays = [np.full((NUM_BLOCKS, BLOCK_ELEMS), 7, np.uint16) for _ in range(LAYERS)]
    t = CpuTransfer(s, arrays, 0)
    assert t.submit_save(BlockOp("a", [key(50, 0)], [0])).result() == 1
    old = s.node
    with cxlkv.Pool.open(pool_path, attach=False) as obs:
        assert obs.reap_node(old, force=True)["reclaimed"]
    deadline = time.monotonic() + 60
    while True:  # the heartbeat notices the forced reap (bounded)
        try:
            s.pool.info()
        except cxlkv.FencedError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    h = t.submit_save(BlockOp("b", [key(51, 0), key(51, 1)], [1, 2]))
    assert h.result() == 2 and not h.refused
    assert s.fences == 1 and s.ns.match_prefix([key(51, 0), key(51, 1)]) == 2
    t.close()
    s.close()
