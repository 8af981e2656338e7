"""A pool that was truncated under its owner is released, not leaked (red-team finding: nanobind
printed "leaked instances" of Pool, Namespace and Lease at the exit of every process whose pool
went bad: PoolGuard kept them alive on purpose, from before the core's SIGBUS guard and its
size check on close). The owner now closes the pool first, then releases its leases; neither
touches the truncated pages. A real pool, a real truncation, in a child process whose exit shows
what nanobind reports (milliseconds, no vLLM)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import logging, os, sys
    import cxlkv
    from cxlkv.integrations.pool_guard import PoolGuard

    path = sys.argv[1]
    cxlkv.Pool.create(path, "16MiB", chunk_size="1MiB").close()
    pool = cxlkv.Pool.open(path)
    guard = PoolGuard(pool, path, logging.getLogger("t"), check_interval_s=0)
    layout = cxlkv.KVLayout(model_id="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=64,
                            tokens_per_block=16, block_bytes=4096)
    ns = pool.namespace(layout, "ns")
    key = bytes(range(32))
    assert ns.put(key, bytes(4096))
    lease = ns.acquire([key])
    assert len(lease) == 1
    os.truncate(path, 4096)
    assert not guard.usable() and guard.truncated
    del ns
    guard.retire(lease)
    del lease
    guard.release_pool()
    del pool, guard
    print("released")
    """
)


def test_truncated_pool_and_its_lease_are_released_not_leaked(pool_path):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, pool_path], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr  # a touch of a truncated page would be SIGBUS
    assert "released" in child.stdout
    assert "leaked" not in child.stderr, child.stderr
