"""The core's device-transfer protocol (src/core/transfer/transfer.cpp): a save in two phases (reserve ->
bytes written at the block's pool offset -> commit checksums the pool bytes and publishes; abort
or dropping the reservation publishes nothing) and a verified load (pin_verified / recheck):
corruption anywhere is a miss, never wrong bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import small_layout

BB = 4096


def keys(n):
    return [os.urandom(32) for _ in range(n)]


def write(view, offset, data):
    view[offset : offset + len(data)] = np.frombuffer(data, np.uint8)


def reserve_filled(pool, ns, ks):
    """A reservation of `ks`, each block filled with random bytes as a device would (not yet
    committed), and the pool's transfer view it was written through."""
    r = ns.reserve(ks)
    view = pool.transfer_view()
    for o in r.offsets:
        write(view, o, os.urandom(BB))
    return r, view


def test_commit_publishes_only_after_the_checksum(small_ns):
    pool, ns = small_ns
    ks = keys(3)
    r = ns.reserve(ks, start_depth=5)
    assert r.states == ["reserved"] * 3 and len(set(r.offsets)) == 3
    view = pool.transfer_view()
    data = [os.urandom(BB) for _ in ks]
    for o, d in zip(r.offsets, data, strict=False):
        write(view, o, d)
    assert not any(ns.contains(k) for k in ks)  # written, not published
    assert ns.get_bytes(ks[0]) is None
    assert ns.reserve(ks[:1]).states == ["in_flight"]  # another writer sees it in flight
    assert r.commit() == 3
    assert [ns.get_bytes(k) for k in ks] == data
    assert ns.reserve(ks).states == ["present"] * 3
    with ns.pin_verified(ks) as lease:
        assert len(lease) == 3 and lease.offsets == r.offsets and lease.recheck() == 3
    assert pool.check()["ok"]


def test_abort_and_a_dropped_reservation_leave_nothing(small_ns):
    pool, ns = small_ns
    used = pool.stats()["blocks"]["used"] if "blocks" in pool.stats() else None
    ks = keys(4)
    r = ns.reserve(ks)
    r.abort()
    assert r.states == ["aborted"] * 4 and r.commit() == 0
    assert not any(ns.contains(k) for k in ks)
    r2 = ns.reserve(ks)
    assert r2.states == ["reserved"] * 4
    del r2  # never committed: aborted when it goes
    assert ns.reserve(ks).states == ["reserved"] * 4  # (and aborted again at once)
    rep = pool.check()
    assert rep["ok"], rep
    if used is not None:
        assert pool.stats()["blocks"]["used"] == used


def test_a_corrupted_reservation_is_not_published(small_ns):
    pool, ns = small_ns
    ks = keys(2)
    r, view = reserve_filled(pool, ns, ks)
    # A stray write into the reserved entry (it names the key from the reserve on): the commit
    # reads the entry back and refuses to publish what is no longer its own.
    at = bytes(view).find(ks[1])
    assert at > 0
    view[at] ^= 0xFF
    assert r.commit() == 1
    assert r.states == ["committed", "aborted"]
    assert ns.contains(ks[0]) and not ns.contains(ks[1])


def test_a_corrupted_published_block_is_a_miss(small_ns):
    pool, ns = small_ns
    ks = keys(3)
    r, view = reserve_filled(pool, ns, ks)
    assert r.commit() == 3
    view[r.offsets[1] + 100] ^= 0x01  # a bit flips in the pool
    with ns.pin_verified(ks) as lease:
        assert len(lease) == 1  # the leading intact block only
    assert ns.get_bytes(ks[1]) is None and not ns.contains(ks[1])  # condemned: a miss everywhere


def test_recheck_catches_a_change_while_the_device_reads(small_ns):
    pool, ns = small_ns
    ks = keys(3)
    r, view = reserve_filled(pool, ns, ks)
    r.commit()
    lease = ns.pin_verified(ks)
    assert len(lease) == 3
    view[lease.offsets[2] + 7] ^= 0x80  # after the verify, before the recheck
    assert lease.recheck() == 2
    lease.release()
    assert ns.get_bytes(ks[2]) is None
    assert ns.get_bytes(ks[0]) is not None


def test_the_view_outlives_close_and_ranges_keep_blocks_whole(make_pool):
    pool = make_pool(size=64 << 20, chunk_size=1 << 20)
    ns = pool.namespace(small_layout(block_bytes=BB))
    r = ns.reserve(keys(200))
    offs = [o for o in r.offsets if o >= 0]
    assert len(offs) == 200
    most = (pool.info()["arena_off"] + (3 << 20)) // 4096 * 4096  # the metadata, then 3 chunks
    ranges = pool.transfer_ranges(most)
    assert len(ranges) > 3 and ranges[0][0] == 0 and sum(n for _, n in ranges) == pool.size
    assert all(n <= most and o % 4096 == 0 for o, n in ranges)
    cuts = [o for o, _ in ranges[1:]]
    assert not any(o < c < o + BB for o in offs for c in cuts)
    with pytest.raises(ValueError, match="chunk boundary"):
        pool.transfer_ranges(64 << 10)
    view = pool.transfer_view()
    r.abort()
    pool.close()
    view[offs[0]] = 1  # still mapped: the view owns the mapping now
    assert view[offs[0]] == 1


_DIE_MID_SAVE = r"""
import os, signal, sys
import cxlkv
sys.path.insert(0, {tests!r})
from conftest import small_layout
pool = cxlkv.Pool.open({path!r})
ns = pool.namespace(small_layout(block_bytes={bb}))
r = ns.reserve([bytes.fromhex(k) for k in {keys!r}], blocks={blocks!r})
assert r.states == ["reserved"] * len({keys!r}), r.states
print("reserved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the device copy never completes, nothing commits
"""


def die_holding(pool, ks, blocks=True) -> None:
    """A child process reserves `ks` (with blocks, or intents only) and is killed with SIGKILL
    while it holds them."""
    import subprocess
    import sys
    from pathlib import Path

    code = _DIE_MID_SAVE.format(
        tests=str(Path(__file__).parent), path=pool.path, bb=BB, keys=[k.hex() for k in ks], blocks=blocks
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "reserved" in p.stdout and p.returncode == -9, p.stderr


def test_a_writer_killed_mid_save_leaves_nothing_published_and_nothing_lost(small_ns):
    pool, ns = small_ns
    ks = keys(3)
    die_holding(pool, ks)
    assert not any(ns.contains(k) for k in ks)
    r = ns.reserve(ks)  # the dead writer's entries do not block the keys
    assert r.states == ["reserved"] * 3
    view = pool.transfer_view()
    data = [os.urandom(BB) for _ in ks]
    for o, d in zip(r.offsets, data, strict=True):
        write(view, o, d)
    assert r.commit() == 3 and [ns.get_bytes(k) for k in ks] == data
    rep = pool.check(repair=True)
    assert rep["ok"], rep


def _fill(pool, ns, bb: int) -> list:
    """Puts blocks until the namespace has no free block left; the keys, all READY."""
    stored = []
    for _ in range(4096):
        if pool.stats()["free_blocks"] == 0 and stored:
            break
        k = os.urandom(32)
        ns.put(k, os.urandom(bb))
        stored.append(k)
    return stored


def test_an_intent_holds_an_index_entry_and_no_block(make_pool):
    """reserve(blocks=False): an intent marker (coalescing). In a full pool it takes no block, so no
    READY KV is evicted for it; others see the key in flight; it never publishes; abort frees it."""
    pool = make_pool(size=4 << 20, chunk_size=1 << 20)
    ns = pool.namespace(small_layout(block_bytes=64 << 10))
    stored = _fill(pool, ns, 64 << 10)
    evictions = pool.stats()["evictions"]
    assert pool.stats()["free_blocks"] == 0 and len(stored) > 4
    marker = os.urandom(32)
    r = ns.reserve([marker], start_depth=3, blocks=False)
    assert r.states == ["reserved"] and r.offsets == [-1]
    assert ns.match_prefix(stored) == len(stored)  # nothing evicted for it
    assert pool.stats()["evictions"] == evictions and pool.stats()["free_blocks"] == 0
    assert ns.reserve([marker]).states == ["in_flight"]  # a block save of the key waits for it
    assert ns.reserve([marker], blocks=False).states == ["in_flight"]
    assert not ns.contains(marker) and ns.get_bytes(marker) is None
    with pytest.raises(ValueError, match="intent"):  # the core's ArgumentError
        r.commit()
    rep = pool.check()
    assert rep["ok"] and rep["blocks"]["ready"] == len(stored), rep
    r.abort()
    assert r.states == ["aborted"]
    again = ns.reserve([marker], blocks=False)
    assert again.states == ["reserved"]
    del again  # dropped: aborted
    assert ns.reserve([marker], blocks=False).states == ["reserved"]
    assert pool.check()["ok"] and ns.match_prefix(stored) == len(stored)


def test_an_intent_of_a_killed_holder_is_released(small_ns):
    pool, ns = small_ns
    marker = os.urandom(32)
    die_holding(pool, [marker], blocks=False)
    assert ns.reserve([marker], blocks=False).states == ["reserved"]  # the dead holder's is absent
    rep = pool.check(repair=True)
    assert rep["ok"] and rep["stuck_entries"] == 0, rep


_VIEW_WHILE_COMMITTING = r"""
import os, sys, threading
import cxlkv
pool = cxlkv.Pool.open(sys.argv[1])
ns = pool.namespace(cxlkv.KVLayout(model_id="test/view-race", dtype="bf16", num_layers=2,
                                   num_kv_heads=2, head_size=16, tokens_per_block=4, block_bytes=4096))
stop = False

def saves():
    while not stop:
        r = ns.reserve([os.urandom(32) for _ in range(4)])
        r.commit()  # holds the pool's guard shared, without the GIL, then takes the GIL back

t = threading.Thread(target=saves)
t.start()
for _ in range(3000):
    pool.transfer_view()  # takes the guard exclusively
stop = True
t.join()
print("done")
"""


def test_a_view_taken_while_another_thread_commits_never_deadlocks(make_pool, tmp_path):
    """A device path's second transfer (a TP rank's second head or state unit, heads.PerHeadTransfer)
    asks for the pool's view while the first one's save thread commits: transfer_view takes the
    pool's guard exclusively, and it once did so holding the GIL, while the committing thread held
    the guard shared and waited for the GIL to return; both waited forever. In a child process, so
    a deadlock fails this test instead of hanging the run."""
    import subprocess
    import sys

    pool = make_pool()
    script = tmp_path / "race.py"
    script.write_text(_VIEW_WHILE_COMMITTING)
    try:
        out = subprocess.run(
            [sys.executable, str(script), pool.path], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("transfer_view and a concurrent commit deadlocked (the child did not finish in 120 s)")
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
    assert pool.check()["ok"]
