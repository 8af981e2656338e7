"""A Hypothesis state machine of the index and allocator against a Python model.

One namespace in a pool small enough that puts keep evicting. Every block's bytes derive from its
key alone, so the model only has to know which keys may be present (`stored`: put or stored and not
deleted since; eviction may drop them at any time) and which are leased (must stay present with
their exact bytes). Invariants after every step: no read ever returns wrong bytes or touches guard
bytes; a leased key is never evicted; contains/get/match_prefix agree; `pool.check()` is consistent.
The seed is printed; CXLKV_FUZZ_SEED replays it; CXLKV_MODEL_EXAMPLES sets the number of runs.
"""

from __future__ import annotations

import os
import random

import numpy as np
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import cxlkv_testutil as tu
from conftest import SHM_DIR, TEST_BACKEND, _remove, small_layout

BLOCK = 64 << 10  # 16 blocks per 1 MiB chunk: a few dozen puts fill the pool
POOL_BYTES = 4 << 20  # 3 chunks: 48 blocks for 56 keys plus fillers
GUARD = 64
PUT_KEYS = [tu.make_key("model-put", i) for i in range(40)]  # variable lengths, written by put
STORE_KEYS = [tu.make_key("model-store", i) for i in range(16)]  # whole blocks, written by store or put


def expected(k: bytes) -> bytes:
    n = BLOCK if k in _STORE_SET else tu.payload_len(k, BLOCK)
    return tu.payload(k, n)


_STORE_SET = set(STORE_KEYS)
EVICTIONS: list[int] = []  # per run: proves the runs reached the eviction path
any_key = st.sampled_from(PUT_KEYS + STORE_KEYS)


class PoolModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import cxlkv

        self.path = os.path.join(SHM_DIR, f"cxlkv-model-{os.getpid()}-{random.getrandbits(32):08x}")
        self.pool = cxlkv.Pool.create(self.path, POOL_BYTES, chunk_size=1 << 20, backend=TEST_BACKEND)
        self.ns = self.pool.namespace(small_layout(block_bytes=BLOCK))
        self.stored: set[bytes] = set()
        self.leases: list = []  # (lease, keys it pins)
        self.fillers = 0
        self.steps = 0

    def teardown(self):
        EVICTIONS.append(self.pool.stats()["evictions"])
        for lease, _ in self.leases:
            lease.release()
        self.pool.close()
        _remove(self.path)

    # -- helpers ---------------------------------------------------------------------------------
    def leased(self) -> set[bytes]:
        return {k for _, keys in self.leases for k in keys}

    def read(self, k: bytes):
        """get into a guarded buffer; returns the bytes on a hit, None on a miss."""
        whole = np.full(BLOCK + 2 * GUARD, 0xA5, dtype=np.uint8)
        hit = self.ns.get(k, whole[GUARD : GUARD + BLOCK])
        assert (whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all(), (
            "get wrote outside its buffer"
        )
        if not hit:
            return None
        exp = expected(k)
        got = bytes(whole[GUARD : GUARD + len(exp)])
        assert got == exp, f"wrong bytes for key {k.hex()[:12]}"
        return got

    def put(self, k: bytes) -> None:
        assert self.ns.put(k, expected(k)), f"put failed with {len(self.leased())} leased keys"
        self.stored.add(k)

    # -- rules -----------------------------------------------------------------------------------
    @rule(k=any_key)
    def put_key(self, k):
        self.put(k)

    @rule(n=st.integers(4, 24))
    def churn(self, n):
        """Fresh keys that push older blocks out (eviction)."""
        for _ in range(n):
            self.fillers += 1
            k = tu.make_key("model-filler", self.fillers)
            assert self.ns.put(k, expected(k)), "put of a filler failed"
            self.stored.add(k)

    @rule(k=any_key)
    def get(self, k):
        got = self.read(k)
        if k not in self.stored:
            assert got is None, "a key never stored (or deleted) was found"
        if k in self.leased():
            assert got is not None, "a leased key was evicted"
        b = self.ns.get_bytes(k)
        assert (b is None) == (got is None) and (b is None or b == expected(k))
        assert self.ns.contains(k) == (got is not None)

    @rule(k=any_key)
    def delete(self, k):
        removed = self.ns.delete(k)
        if k in self.leased():
            assert not removed, "a leased key was deleted"
        if removed:
            assert k in self.stored
            self.stored.discard(k)
        if k not in self.leased():
            assert not self.ns.contains(k)
            self.stored.discard(k)

    @rule(keys=st.lists(any_key, min_size=1, max_size=8))
    def match_prefix(self, keys):
        n = self.ns.match_prefix(keys)
        assert 0 <= n <= len(keys)
        assert all(self.ns.contains(k) and k in self.stored for k in keys[:n])
        if n < len(keys):
            assert not self.ns.contains(keys[n])

    @rule(keys=st.lists(st.sampled_from(STORE_KEYS), min_size=1, max_size=4, unique=True))
    def store(self, keys):
        src = np.zeros((len(keys) + 2, BLOCK), dtype=np.uint8)
        ids = [j + 2 for j in range(len(keys))][::-1]
        for k, i in zip(keys, ids, strict=True):
            src[i] = np.frombuffer(expected(k), dtype=np.uint8)
        n = self.ns.store(keys, [src], ids)
        assert n == len(keys), f"store kept {n} of {len(keys)} blocks"
        self.stored.update(keys)

    @rule(keys=st.lists(st.sampled_from(STORE_KEYS), min_size=1, max_size=4, unique=True))
    def load(self, keys):
        rows = len(keys) + 2
        whole = np.full(rows * BLOCK + 2 * GUARD, 0xA5, dtype=np.uint8)
        dst = whole[GUARD : GUARD + rows * BLOCK].reshape(rows, BLOCK)
        ids = [rows - 1 - j for j in range(len(keys))]
        n = self.ns.load(keys, [dst], ids)
        assert (whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all(), "load wrote outside"
        for k, i in zip(keys[:n], ids, strict=False):  # ids has a row per key; n <= len(keys)
            assert k in self.stored and bytes(dst[i]) == expected(k), "load delivered wrong bytes"
        if n < len(keys):
            assert keys[n] not in self.leased(), "a leased key failed to load"

    @precondition(lambda self: len(self.leases) < 3)
    @rule(keys=st.lists(any_key, min_size=1, max_size=6, unique=True))
    def acquire(self, keys):
        lease = self.ns.acquire(keys)
        n = len(lease)
        assert all(k in self.stored for k in keys[:n])
        if n < len(keys):
            assert not self.ns.contains(keys[n])
        self.leases.append((lease, keys[:n]))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease, _ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        lease.release()

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def leased_keys_stay(self):
        for k in self.leased():
            assert self.read(k) is not None, "a leased key was evicted"

    @invariant()
    def pool_consistent(self):
        self.steps += 1
        if self.steps % 4 == 0:  # check() walks the whole pool: every few steps is enough
            rep = self.pool.check()
            assert rep["ok"], tu.pool_check_problems(rep)


def test_pool_against_model():
    s = int(os.environ.get("CXLKV_FUZZ_SEED") or random.randrange(1 << 31))
    print(f"model state machine seed {s}: replay with CXLKV_FUZZ_SEED={s}")
    cfg = settings(
        max_examples=int(os.environ.get("CXLKV_MODEL_EXAMPLES", "100")),
        stateful_step_count=40,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    EVICTIONS.clear()
    run_state_machine_as_test(seed(s)(PoolModel), settings=cfg)
    assert sum(EVICTIONS) > 0, "no run evicted anything: the model never tested eviction"
    print(f"runs {len(EVICTIONS)}, evictions {sum(EVICTIONS)}")
