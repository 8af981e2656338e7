"""The connector after a fence (pool_session.py), without an engine: the scheduler-side and
worker-side connectors of test_connector_unit.py's fake engine, on a real pool whose nodes are
reaped by force from another handle (the way `cxlkv pool reap --force` fences a live process).
The real-engine version (SIGSTOP past the lease, reaped by another host) is
tests/vllm/test_fence_recovery.py."""

from __future__ import annotations

import time

import pytest

import cxlkv

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytest.importorskip("torch")
from cxlkv.integrations import pool_session
from test_connector_unit import BS, Engine, published, tokens


def fence(pool_path: str, *sessions) -> list[int]:
    """Reaps the sessions' nodes by force and waits (bounded) until each node knows (its
    heartbeat saw its slot taken); returns the fenced node ids. (A node id is a slot: the new node
    may get the same one, in a new epoch.)"""
    nodes = [s.node for s in sessions]
    with cxlkv.Pool.open(pool_path, attach=False) as obs:
        for n in nodes:
            assert obs.reap_node(n, force=True)["reclaimed"], n
    deadline = time.monotonic() + 60
    for s in sessions:
        while True:
            try:
                s.pool.info()
            except cxlkv.FencedError:
                break
            assert time.monotonic() < deadline, "the heartbeat never noticed the forced reap"
            time.sleep(0.01)
    return nodes


def fenced_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was fenced (seen in" in r.getMessage()]


@pytest.mark.parametrize("backend", ["coherent", "multihost"])
def test_fenced_engine_opens_the_pool_again_and_keeps_the_cache(pool_path, model_dir, caplog, backend):
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", backend=backend, lease_ms=6000).close()
    toks = tokens(30, 6 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    fenced_pools = (b.sched._session.pool, b.worker._session.pool)
    old = fence(pool_path, b.sched._session, b.worker._session)
    # The scheduler's lookup sees the fence, attaches again and answers from the new node.
    assert b.add("r", toks) == 6 * BS
    assert b.sched._session.fences == 1 and b.sched._session.pool is not fenced_pools[0]
    assert fenced_pools[0].closed
    # The worker's load sees its own fence: not retried (its blocks were pinned by a fenced
    # lease), reported as failed blocks, vLLM recomputes; the worker attaches again.
    b.step({"r": 1})
    assert b.reqs["r"]["computed"] == 0 and b.stats.data["load_failed_blocks"] == 6
    assert b.worker._session.fences == 1 and fenced_pools[1].closed
    b.step({"r": len(toks)})
    b.finish("r")
    # Both new nodes serve: a hit, loaded.
    assert b.add("r2", toks) == 6 * BS
    b.step({"r2": 1})
    assert b.reqs["r2"]["computed"] == 6 * BS + 1 and b.stats.data["load_blocks"] == 6
    b.finish("r2")
    assert b.stats.data["pool_fenced"] == 2 and b.stats.data["pool_disabled"] == 0
    lines = fenced_lines(caplog)
    assert len(lines) == 2, lines  # once per fence: the scheduler's node and the worker's
    for s, n in zip((b.sched._session, b.worker._session), old, strict=True):
        assert any(f"node {n} was fenced" in ln and f"as new node {s.node}" in ln for ln in lines), lines
    assert all(pool_path in ln for ln in lines)
    a.close(), b.close()
    with cxlkv.Pool.open(pool_path, attach=False) as p:
        report = p.check()
    assert report["ok"], report["errors"]
    assert report["orphan_pins"] == 0


def test_lease_of_the_fenced_node_is_dropped_untouched(pool_path, model_dir, caplog):
    """A lease taken before the fence is released after it: a no-op on the closed handle (the
    reclaimer cleared its pins), not a pool failure; the cache stays on."""
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", backend="multihost", lease_ms=6000).close()
    toks = tokens(31, 4 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    assert b.add("r", toks) == 4 * BS  # holds a lease of the node about to be fenced
    fenced_pool = b.sched._session.pool
    fence(pool_path, b.sched._session, b.worker._session)
    b.finish("r")  # the old lease is dropped untouched
    assert b.add("r2", toks) == 4 * BS
    assert b.sched._session.fences == 1 and fenced_pool.closed
    assert not b.sched._session.disabled
    b.finish("r2")
    a.close(), b.close()


def test_reopen_failing_falls_back_to_no_cache(pool_path, model_dir, caplog, monkeypatch):
    """Bounded: a reopen that keeps failing ends in the guard's verdict (no cache, one ERROR
    line), not in a retry per step forever."""
    monkeypatch.setattr(pool_session, "RETRY_DELAY_S", 0.0)
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", lease_ms=6000).close()
    toks = tokens(32, 4 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    s = b.sched._session
    opens = []

    def refuse(create: bool):
        opens.append(create)
        raise cxlkv.NodeTableFullError("test: every node slot is taken")

    monkeypatch.setattr(s, "_open_pool", refuse)
    (old,) = fence(pool_path, s)
    for _ in range(pool_session.MAX_REOPENS + 2):
        assert b.add("r", toks) == 0
        b.finish("r")
    assert opens == [False] * pool_session.MAX_REOPENS  # never created, never more than the bound
    assert s.disabled and "failed 3 times" in s.guard.cause and "NodeTableFullError" in s.guard.cause
    errors = [r.getMessage() for r in caplog.records if "no longer usable" in r.getMessage()]
    assert len(errors) == 1 and f"node {old} was fenced" in errors[0] and pool_path in errors[0]
    a.close(), b.close()
