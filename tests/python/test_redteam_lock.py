"""Issue 23, "a lock that no forged word can stop" and "bounded intents": the red team's attacks,
with REAL processes as the hosts of a pool in /dev/shm (each its own ``CXLKV_HOST_ID``, so peers
judge it by the heartbeat lease alone, as hosts of a CXL pod would), and a forger that writes the
lock area the way a co-tenant with write access to the pool can.

* a forged ticket naming a live node on its own row, with ``waits`` bumped in bursts of 0.3-4 s,
  used to leave two hosts each waiting on the other forever (each holder's ``waits`` kept moving,
  so the no-progress bound never fired): a waiting holder now rewrites its whole ticket, and every
  claim has an absolute bound (Bakery::kClaimLeases);
* forged tier-1 words naming a live node with the wrong epoch, written once into one row of every
  stripe, used to fail every claim of that row after 3 leases for as long as the node lived: such
  a word is stale and void after one lease of standstill (waiters and the row's own heartbeat),
  one naming a node of another row is void at once, and ``pool check`` names both;
* one process reserving keys with ``blocks=False`` used to take every index slot: intents are
  capped per node (``intent_permille`` at create), and other nodes' puts keep succeeding.

Every wait has a timeout; the bounds asserted are the protocol's, with slack for a loaded machine.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import MiB
from test_multihost_heal import LOCK_AREA_OFF, LOCK_STRIPES, cli, create, node_word, pod  # noqa: F401

LEASE_MS = 1000
CLAIM_LEASES = 6  # arbiter.h Bakery::kClaimLeases


def lock_line_off(info: dict, stripe: int, row: int) -> int:
    return LOCK_AREA_OFF + (stripe * info["lock_hosts"] + row) * 64


def tier1_word(participant1: int, node: int, epoch: int) -> int:
    """format.h make_tier1_word: [1:1][nonce:15][participant+1:16][node:8][epoch:24]."""
    return (1 << 63) | (participant1 & 0xFFFF) << 32 | (node & 0xFF) << 24 | (epoch & 0xFFFFFF)


class Forger:
    """A co-tenant with write access to the lock area (one mapping, plain stores)."""

    def __init__(self, path: str, info: dict):
        self.info = info
        self.f = open(path, "r+b")
        self.m = mmap.mmap(self.f.fileno(), LOCK_AREA_OFF + LOCK_STRIPES * info["lock_hosts"] * 64)

    def ticket(self, row: int, number: int, node: int, word: int) -> None:
        for k in range(LOCK_STRIPES):
            off = lock_line_off(self.info, k, row)
            self.m[off : off + 32] = struct.pack("<4Q", 0, number, node, word)

    def bump_waits(self, row: int) -> None:
        for k in range(LOCK_STRIPES):
            off = lock_line_off(self.info, k, row) + 48
            (w,) = struct.unpack_from("<Q", self.m, off)
            struct.pack_into("<Q", self.m, off, w + 1)

    def tier1(self, row: int, word: int) -> None:
        for k in range(LOCK_STRIPES):
            struct.pack_into("<Q", self.m, lock_line_off(self.info, k, row) + 32, word)

    def read_tier1(self, row: int) -> list[int]:
        return [struct.unpack_from("<Q", self.m, lock_line_off(self.info, k, row) + 32)[0] for k in range(16)]

    def close(self) -> None:
        self.m.close()
        self.f.close()


def send(host, cmd: str) -> None:
    host.proc.stdin.write(cmd + "\n")
    host.proc.stdin.flush()


@pytest.mark.timeout(300)
def test_forged_ticket_with_a_faked_pulse_deadlocks_no_one(pool_path, pod):  # noqa: F811
    info = create(pool_path, LEASE_MS)
    a = pod(pool_path, "lock-a", slot=1)
    b = pod(pool_path, "lock-b", slot=2)
    node_a, node_b = a.hello["node"], b.hello["node"]
    word_a, word_b = node_word(pool_path, info, node_a), node_word(pool_path, info, node_b)
    forger = Forger(pool_path, info)
    rng = random.Random(23)
    try:
        # Both hosts claim all the time while the forger writes tickets naming each live node on
        # its own row (waiters must honour those) and fakes their pulse in bursts of 0.3-4 s.
        send(a, "put a 300")
        send(b, "put b 300")
        t0 = time.monotonic()
        for burst in (0.3, rng.uniform(0.5, 2.0), 4.0):
            forger.ticket(1, 1, node_a, word_a)
            forger.ticket(2, 1, node_b, word_b)
            forger.ticket(9, 1, node_a, word_a)  # a row no host uses: foreign for waiters
            end = time.monotonic() + burst
            while time.monotonic() < end:
                forger.bump_waits(1)
                forger.bump_waits(2)
                forger.bump_waits(9)
                time.sleep(0.06)  # about 60 writes in 4 s, as the red team's forger
        # Each host made progress and returned within its bound (the forger's time, then at most
        # one absolute claim bound for the claim under way): never the endless wait of before.
        bound = (time.monotonic() - t0) + CLAIM_LEASES * LEASE_MS / 1000 + 60
        ra, rb = a.read(timeout=bound), b.read(timeout=bound)
        assert ra == {"put": 300} or ra.get("error") == "LockTimeoutError", ra
        assert rb == {"put": 300} or rb.get("error") == "LockTimeoutError", rb
        # Once the forger stops, everything works again at once, with 0 wrong bytes.
        assert a.ask("put a2 64", timeout=60) == {"put": 64}
        assert b.ask("put b2 64", timeout=60) == {"put": 64}
        assert b.ask("verify a2 64") == {"verified": 64, "wrong": 0}
        assert a.ask("verify b2 64") == {"verified": 64, "wrong": 0}
        if ra == {"put": 300}:
            assert b.ask("verify a 300") == {"verified": 300, "wrong": 0}

        # The ticket left in the unused row is named (stripe, row, what) and repaired.
        r = cli("pool", "check", "--json", pool_path, host="lock-admin", slot=5)
        report = json.loads(r.stdout)
        if node_word(pool_path, info, node_a) == word_a:
            assert r.returncode == 1, r.stdout + r.stderr
            assert any("row 9" in e and "another row" in e for e in report["errors"]), report["errors"]
        else:
            # A was fenced under load (a 1 s lease beside the forger's bursts) and attached again:
            # the ticket names an incarnation that is gone, so it is stale (a warning), not foreign
            found = report["errors"] + report.get("warnings", [])
            assert any("row 9" in m and "stale" in m for m in found), found
        r = cli("pool", "check", "--repair", "--json", pool_path, host="lock-admin", slot=5)
        assert r.returncode == 0, r.stdout + r.stderr
        r = cli("pool", "check", "--json", pool_path, host="lock-admin", slot=5)
        assert r.returncode == 0, r.stdout + r.stderr
        lock = json.loads(r.stdout)["lock_area"]
        assert lock["foreign"] == 0 and lock["stuck"] == 0, lock

        assert a.ask("close", timeout=CLAIM_LEASES * LEASE_MS / 1000 + 60) == {"closed": True}
        assert b.ask("close", timeout=CLAIM_LEASES * LEASE_MS / 1000 + 60) == {"closed": True}
    finally:
        forger.close()
        a.stop()
        b.stop()


@pytest.mark.timeout(300)
def test_forged_tier1_words_written_once_stop_no_claim(pool_path, pod):  # noqa: F811
    info = create(pool_path, LEASE_MS)
    a = pod(pool_path, "lock-a", slot=1)
    b = pod(pool_path, "lock-b", slot=2)
    node_a = a.hello["node"]
    with cxlkv.Pool.open(pool_path, read_only=True) as p:
        epoch_a = next(n["epoch"] for n in p.nodes() if n["node"] == node_a) & 0xFFFFFF
    forger = Forger(pool_path, info)
    try:
        # Written once: in A's own row, a word naming A with the wrong epoch (no participant byte,
        # so only the node table can judge it); in row 3 (no host) the same; in row 4 (no host) a
        # word naming A with its right epoch, although A lives on row 1.
        stale = tier1_word(0, node_a, epoch_a + 5)
        forger.tier1(1, stale)
        forger.tier1(3, stale)
        forger.tier1(4, tier1_word(0, node_a, epoch_a))

        # A's claims go on after at most about a lease (its heartbeat clears its row, and a waiter
        # takes a stale word over after a lease of standstill); before, every one failed with
        # LockTimeoutError after 3 leases for as long as A lived.
        t0 = time.monotonic()
        assert a.ask("put a 64", timeout=120) == {"put": 64}
        took = time.monotonic() - t0
        assert took < 3 * LEASE_MS / 1000 + 20, f"{took:.1f} s: the stale words cost more than a lease"
        assert b.ask("put b 64", timeout=120) == {"put": 64}
        assert forger.read_tier1(1) == [0] * LOCK_STRIPES or all(
            w in (0, stale) for w in forger.read_tier1(1)
        ), [hex(w) for w in forger.read_tier1(1)]
        # A host-mate of A attaches on that row (it could not before).
        a2 = pod(pool_path, "lock-a", slot=1)
        assert "error" not in a2.hello, a2.hello
        assert a2.ask("verify a 64", timeout=120) == {"verified": 64, "wrong": 0}
        assert a2.ask("close", timeout=120) == {"closed": True}
        a2.stop()
        time.sleep(LEASE_MS / 1000 * 1.5)
        assert forger.read_tier1(1) == [0] * LOCK_STRIPES, "A's row heals itself within a lease and a quarter"

        # pool check names both words of the rows no host owns, with the evidence ...
        r = cli("pool", "check", "--json", pool_path, host="lock-admin", slot=6)
        report = json.loads(r.stdout)
        assert r.returncode == 1, r.stdout + r.stderr
        lock = report["lock_area"]
        assert lock["words_foreign"] == LOCK_STRIPES and lock["words_stale"] == LOCK_STRIPES, lock
        assert any("row 4" in e and "tier-1 word" in e and "foreign" in e for e in report["errors"]), report
        assert any(
            "row 3" in w and "stale" in w and f"epoch {epoch_a + 5}" in w for w in report["warnings"]
        ), report
        # ... and --repair clears them (they are what waiters already ignore), nothing else.
        r = cli("pool", "check", "--repair", "--json", pool_path, host="lock-admin", slot=6)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["lock_area"]["words_reset"] == 2 * LOCK_STRIPES, r.stdout
        assert forger.read_tier1(3) == [0] * LOCK_STRIPES and forger.read_tier1(4) == [0] * LOCK_STRIPES
        r = cli("pool", "check", "--json", pool_path, host="lock-admin", slot=6)
        assert r.returncode == 0, r.stdout + r.stderr
        assert b.ask("verify a 64") == {"verified": 64, "wrong": 0}
        assert a.ask("close", timeout=120) == {"closed": True}
        assert b.ask("close", timeout=120) == {"closed": True}
    finally:
        forger.close()
        a.stop()
        b.stop()


# A process that floods the index with intents and keeps them (until told to exit).
FLOODER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["TESTS"])
    import cxlkv, cxlkv_testutil as tu
    pool = cxlkv.Pool.open(os.environ["POOL"])
    ns = pool.namespace(cxlkv.KVLayout(**json.loads(os.environ["LAYOUT"])))
    held, states = [], {}
    for batch in range(20):
        r = ns.reserve([tu.make_key("flood", str(batch), i) for i in range(100)], blocks=False)
        held.append(r)
        for s in r.states:
            states[s] = states.get(s, 0) + 1
    print(json.dumps(dict(node=pool.node_id, states=states, info=pool.info()["intents"])), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.timeout(240)
def test_an_intent_flood_leaves_other_nodes_puts_alone(pool_path):
    from test_multihost_heal import LAYOUT

    with cxlkv.Pool.create(pool_path, 16 * MiB, chunk_size=1 * MiB, intent_permille=50) as p:
        info = p.info()
    cap = info["intent_cap"]
    assert cap == max(1, info["index_slots"] * 50 // 1000), info
    env = dict(os.environ, POOL=pool_path, LAYOUT=json.dumps(LAYOUT), TESTS=tu.here())
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        said = json.loads(flooder.stdout.readline())
        assert said["states"].get("reserved") == cap, said  # 2000 asked for, the cap granted
        assert said["states"].get("capped") == 2000 - cap, said
        assert said["info"] == cap, said
        # Another node's puts all succeed while the flooder sits at its cap; 0 wrong bytes.
        with cxlkv.Pool.open(pool_path) as p:
            ns = p.namespace(cxlkv.KVLayout(**LAYOUT))
            keys = [tu.make_key("other", "k", i) for i in range(200)]
            assert sum(bool(ns.put(k, tu.key_payload(k, 1024))) for k in keys) == 200
            got = [ns.get_bytes(k) for k in keys]
            assert all(g is not None and tu.verify_bytes(k, g, 1024) for k, g in zip(keys, got, strict=True))
            nodes = {n["node"]: n for n in p.nodes()}
            assert nodes[said["node"]]["intents"] == cap, nodes[said["node"]]
        # pool stats shows the count, pool check names the node at its cap.
        r = subprocess.run(
            [sys.executable, "-m", "cxlkv", "pool", "stats", "--json", pool_path],
            capture_output=True,
            text=True,
        )
        assert [n["intents"] for n in json.loads(r.stdout)["nodes"] if n["node"] == said["node"]] == [cap]
        r = subprocess.run(
            [sys.executable, "-m", "cxlkv", "pool", "check", "--json", pool_path],
            capture_output=True,
            text=True,
        )
        report = json.loads(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr  # at the cap is a warning, not an error
        assert report["intents"] == {"held": cap, "cap": cap, "nodes_at_cap": 1}, report["intents"]
        assert any(f"node {said['node']} holds {cap} block-less intents" in w for w in report["warnings"])
    finally:
        flooder.kill()
        flooder.wait(timeout=30)
    # The holder is gone: its intents are released by its reclaim (same kernel: at once).
    r = subprocess.run(
        [sys.executable, "-m", "cxlkv", "pool", "check", "--repair", "--json", pool_path],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "cxlkv", "pool", "check", "--json", pool_path], capture_output=True, text=True
    )
    assert json.loads(r.stdout)["intents"]["held"] == 0, r.stdout
