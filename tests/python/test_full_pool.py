"""Full pool and all-pinned pool (issue item 7): put never raises, evicts old blocks, evicts chains
tail-first, and returns False at once when everything is pinned."""

from __future__ import annotations

import time

import numpy as np
import pytest

import cxlkv_testutil as tu
from conftest import KiB, MiB, small_layout


def fill(ns, keys, bb):
    results = []
    for k in keys:
        r = ns.put(k, tu.key_payload(k, bb))
        assert r in (True, False)
        results.append(r)
    return results


@pytest.mark.timeout(120)
def test_overfill_evicts_and_never_returns_wrong_bytes(make_pool):
    bb = 16 * KiB
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    ns = pool.namespace(small_layout(block_bytes=bb))
    n = 3 * (16 * MiB // bb)  # three times more data than the whole pool
    keys = [tu.make_key("overfill", i) for i in range(n)]
    results = fill(ns, keys, bb)
    assert all(results), f"{results.count(False)} puts failed although old blocks were evictable"
    resident = 0
    out = bytearray(bb)
    for k in keys:
        data = ns.get_bytes(k)
        if data is not None:
            assert data == tu.key_payload(k, bb)
            resident += 1
        out[:] = bytes(bb)
        if ns.get(k, out):
            assert bytes(out) == tu.padded_payload(k, bb)
    assert 0 < resident < n
    assert resident >= 0.5 * (16 * MiB // bb), f"only {resident} blocks resident"
    # the newest blocks are resident (LRU/CLOCK both keep the most recent writes)
    assert ns.match_prefix(keys[-5:]) >= 1
    assert all(ns.contains(k) for k in keys[-20:])
    stats = pool.stats()
    evictions = stats.get("evictions")
    if evictions is not None:
        assert evictions >= n - resident
    report = pool.check()
    assert tu.pool_check_problems(report) == [], report


@pytest.mark.timeout(120)
def test_overfill_with_two_namespaces(make_pool):
    """Two models of different block sizes share a full pool: both can keep storing."""
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    a = pool.namespace(small_layout(model_id="test/full-a", block_bytes=16 * KiB))
    b = pool.namespace(small_layout(model_id="test/full-b", block_bytes=8 * KiB))
    ka = [tu.make_key("full-a", i) for i in range(3000)]
    assert all(fill(a, ka, 16 * KiB)), "namespace a could not evict its own blocks"
    kb = [tu.make_key("full-b", i) for i in range(3000)]
    rb = fill(b, kb, 8 * KiB)
    assert any(rb), "namespace b cannot store anything once namespace a filled the pool"
    assert sum(rb) >= 0.9 * len(rb), f"namespace b: {rb.count(False)} of {len(rb)} puts failed"
    for k in kb[-50:]:
        d = b.get_bytes(k)
        assert d is None or d == tu.key_payload(k, 8 * KiB)
    for k in ka[-50:]:
        d = a.get_bytes(k)
        assert d is None or d == tu.key_payload(k, 16 * KiB)
    assert tu.pool_check_problems(pool.check()) == []


def _chain(c, shape, rng):
    """Keys of chain c. 'flat': 8 own blocks. 'tree': a 3-block prefix shared by the chains of its
    group (a common system prompt), then 2-9 own blocks."""
    if shape == "flat":
        return tu.chain_keys(f"tail-{c}", 8)
    shared = tu.chain_keys(f"group-{c % 12}", 3)
    own = int(rng.integers(2, 10))
    return shared + [tu.make_key("tree", c, j) for j in range(own)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["flat", "tree"])
def test_chains_evicted_tail_first(make_pool, shape):
    bb = 16 * KiB
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    ns = pool.namespace(small_layout(block_bytes=bb))
    max_len = 12
    src = np.zeros((max_len, bb), dtype=np.uint8)
    rng = np.random.default_rng(5)
    chains = []
    stored = 0
    c = 0
    while stored < 3 * (16 * MiB // bb):  # three times what fits
        keys = _chain(c, shape, rng)
        c += 1
        for j, k in enumerate(keys):
            src[j] = np.frombuffer(tu.padded_payload(k, bb), dtype=np.uint8)
        assert ns.store(keys, [src], list(range(len(keys))), block_dim=0) == len(keys)
        stored += len(keys)
        chains.append(keys)
        # requests re-read the prefixes of some earlier chains (as a serving engine would)
        for _ in range(2):
            old = chains[int(rng.integers(0, len(chains)))]
            ns.match_prefix(old[: int(rng.integers(1, len(old) + 1))])
    resident_total = 0
    in_prefix = 0
    seen = set()
    for keys in chains:
        present = [ns.contains(k) for k in keys]
        prefix = 0
        while prefix < len(keys) and present[prefix]:
            prefix += 1
        for j, k in enumerate(keys):  # count every resident block once
            if present[j] and k not in seen:
                seen.add(k)
                resident_total += 1
                in_prefix += j < prefix
    assert resident_total > 0
    frac = in_prefix / resident_total
    print(f"tail-first ({shape}): {frac:.1%} of {resident_total} resident blocks in a usable prefix")
    assert frac >= 0.9, (
        f"only {frac:.1%} of the {resident_total} resident blocks are inside "
        "their chain's usable prefix: eviction is not tail-first"
    )
    # bytes of whatever is resident are right
    dst = np.zeros_like(src)
    for keys in chains[-20:]:
        n = ns.load(keys, [dst[: len(keys)]], list(range(len(keys))), block_dim=0)
        for j in range(n):
            assert dst[j].tobytes() == tu.padded_payload(keys[j], bb)
    assert tu.pool_check_problems(pool.check()) == []


@pytest.mark.timeout(60)
def test_all_pinned_put_returns_false(make_pool):
    bb = 16 * KiB
    pool = make_pool(size=8 * MiB, chunk_size=256 * KiB, pin_slots=4096)
    ns = pool.namespace(small_layout(block_bytes=bb))
    keys = [tu.make_key("pinned", i) for i in range(2 * (8 * MiB // bb))]
    assert all(fill(ns, keys, bb))
    resident = [k for k in keys if ns.contains(k)]
    assert 0 < len(resident) < len(keys)
    assert len(resident) < 4096
    lease = ns.acquire(resident)
    assert len(lease) == len(resident)

    # Whatever free blocks remain get used, then put must fail: promptly, without raising.
    failed_at = None
    t0 = time.monotonic()
    for i in range(len(resident) + 64):
        k = tu.make_key("pinned-new", i)
        if ns.put(k, tu.key_payload(k, bb)) is False:
            failed_at = i
            break
    assert failed_at is not None, "put kept succeeding although every block is pinned"
    t_fail = time.monotonic()
    for i in range(20):  # stays full: each attempt returns False at once
        k = tu.make_key("pinned-more", i)
        assert ns.put(k, tu.key_payload(k, bb)) is False
        assert not ns.contains(k)
    assert time.monotonic() - t_fail < 30, "put on an all-pinned pool is not prompt"
    del t0
    # pinned blocks survived every attempt
    for k in resident:
        assert ns.get_bytes(k) == tu.key_payload(k, bb)
    # pinned blocks cannot be deleted either
    assert ns.delete(resident[0]) is False

    lease.release()
    k = tu.make_key("after-release")
    assert ns.put(k, tu.key_payload(k, bb)) is True
    assert ns.get_bytes(k) == tu.key_payload(k, bb)
    # the put above evicted one unpinned block (any of them): delete one that is still there
    survivor = next(k for k in resident if ns.contains(k))
    assert ns.delete(survivor) is True
    assert tu.pool_check_problems(pool.check()) == []


@pytest.mark.timeout(60)
def test_partially_pinned_pool_evicts_unpinned(make_pool):
    bb = 16 * KiB
    pool = make_pool(size=8 * MiB, chunk_size=256 * KiB, pin_slots=4096)
    ns = pool.namespace(small_layout(block_bytes=bb))
    keys = [tu.make_key("half", i) for i in range(2 * (8 * MiB // bb))]
    fill(ns, keys, bb)
    resident = [k for k in keys if ns.contains(k)]
    pinned = resident[::2]
    with ns.acquire(pinned) as lease:
        assert len(lease) == len(pinned)
        more = [tu.make_key("half-more", i) for i in range(len(resident))]
        assert all(fill(ns, more, bb)), "unpinned blocks should have been evicted"
        for k in pinned:
            assert ns.get_bytes(k) == tu.key_payload(k, bb)
    assert tu.pool_check_problems(pool.check()) == []


def _holder(pool_path, code_body):
    """Starts a process that attaches to the pool, runs code_body, prints 'ready' and sleeps."""
    import subprocess
    import sys
    import textwrap

    code = (
        textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {tu.here()!r})
        import cxlkv, cxlkv_testutil as tu
        from conftest import small_layout
        pool = cxlkv.Pool.open({pool_path!r})
    """)
        + textwrap.dedent(code_body)
        + "\nprint('ready', flush=True)\ntime.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "ready":
        p.kill()
        p.wait()
        raise AssertionError(f"holder did not start: {line!r}")
    return p


@pytest.mark.timeout(60)
def test_pins_of_killed_process_are_reclaimed(make_pool, pool_path):
    """A process pins every block and dies by kill -9: a process that was already attached
    notices (put returns False while the pinner lives, then succeeds) without re-opening."""
    bb = 16 * KiB
    pool = make_pool(size=8 * MiB, chunk_size=256 * KiB, pin_slots=4096)
    ns = pool.namespace(small_layout(block_bytes=bb))
    keys = [tu.make_key("dead-pin", i) for i in range(2 * (8 * MiB // bb))]
    assert all(fill(ns, keys, bb))
    resident = [k for k in keys if ns.contains(k)]
    p = _holder(
        pool_path,
        f"""
        ns = pool.namespace(small_layout(block_bytes={bb}))
        keys = [tu.make_key("dead-pin", i) for i in range({len(keys)})]
        lease = ns.acquire([k for k in keys if ns.contains(k)])
        assert len(lease) == {len(resident)}, len(lease)
    """,
    )
    try:
        failed = False
        for i in range(len(resident) + 64):
            k = tu.make_key("dead-pin-new", i)
            if not ns.put(k, tu.key_payload(k, bb)):
                failed = True
                break
        assert failed, "put succeeded although another live process pins every block"
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 10
    ok = False
    while time.monotonic() < deadline:
        k = tu.make_key("dead-pin-after")
        if ns.put(k, tu.key_payload(k, bb)):
            ok = True
            break
        time.sleep(0.05)
    assert ok, "the dead process's pins were never reclaimed by the attached process"
    report = pool.check()
    assert tu.pool_check_problems(report) == [], report
    assert report.get("orphan_pins", 0) == 0
