"""Issue 14, "a pod that heals itself": each case is the reviewer's reproduction, with REAL
processes as the hosts of a `multihost` pool in /dev/shm (each its own ``CXLKV_HOST_ID``, so peers
judge it by the heartbeat lease alone, as hosts of a CXL pod would).

* one stray 32-byte write into an unused lock row, naming a live node, used to stop every claim
  of the pod forever (and ``close()`` spun at 100% CPU): the ticket is now void for waiters,
  ``pool check`` reports it and ``pool check --repair`` clears it;
* a ticket that waiters must honour (it names a live node of that very row) but that never moves
  costs a bounded wait: ``LockTimeoutError`` naming the stripe, row and ticket; ``close()`` returns;
* ``cxlkv pool reap NODE`` from a fresh process of another host used to fence itself before its
  lease of watching was over: the recovery procedure of ARCHITECTURE §11 runs end to end
  (kill -9 a host, reap it from another host's CLI, the survivor's data intact, ``pool check``
  clean), and a fresh ``pool check`` watches undecided nodes instead of calling the pool
  consistent;
* observers (``pool check``/``stats``, the exporter, ``top``) take nothing a host needs (issue 23
  item 7): no row and no node slot while they only read, so four of them on a 4-slot pool never make
  a host's attach fail (``NodeTableFullError``), nor a host configured onto any row
  (``HostSlotBusyError``); hosts that leave ``CXLKV_HOST_SLOT`` unset probe a free row.

Every wait has a timeout; no timing is asserted.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import MiB
from test_multihost_procs import LAYOUT as SLOW_HOST_LAYOUT

LAYOUT = dict(SLOW_HOST_LAYOUT, model_id="heal")  # opaque 1 KiB blocks
LOCK_AREA_OFF = 8192  # format.h kLockAreaOff
LOCK_STRIPES = 16  # format.h kLockStripes
NODE_SLOT_BYTES = 128

# A host: attaches (or observes, OBSERVER=1), says who it is, then obeys one command per line.
HOST = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["TESTS"])
    import cxlkv, cxlkv_testutil as tu
    LAYOUT = cxlkv.KVLayout(**json.loads(os.environ["LAYOUT"]))
    def say(**kw): print(json.dumps(kw), flush=True)
    def key(tag, i): return tu.make_key("heal", tag, i)
    try:
        pool = cxlkv.Pool.open(os.environ["POOL"], attach=os.environ.get("OBSERVER") != "1")
    except cxlkv.CxlkvError as e:
        say(error=type(e).__name__, msg=str(e)); sys.exit(0)
    say(node=pool.node_id, slot=pool.info()["host_slot"])
    ns = None
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "put":
                ns = ns or pool.namespace(LAYOUT)
                tag, n = args[0], int(args[1])
                say(put=sum(bool(ns.put(key(tag, i), tu.key_payload(key(tag, i), 1024))) for i in range(n)))
            elif cmd == "verify":
                ns = ns or pool.namespace(LAYOUT)
                tag, n = args[0], int(args[1])
                got = [ns.get_bytes(key(tag, i)) for i in range(n)]
                say(verified=sum(g is not None and tu.verify_bytes(key(tag, i), g, 1024)
                                 for i, g in enumerate(got)),
                    wrong=sum(g is not None and not tu.verify_bytes(key(tag, i), g, 1024)
                              for i, g in enumerate(got)))
            elif cmd == "stats":
                say(stats=pool.stats()["puts"], node=pool.node_id, slot=pool.info()["host_slot"])
            elif cmd == "check":
                r = pool.check(wait=None)  # watch other hosts for a lease
                say(ok=r["ok"], errors=r["errors"], node=pool.node_id, slot=pool.info()["host_slot"])
            elif cmd == "close":
                pool.close(); say(closed=True)
            elif cmd == "exit":
                break
        except cxlkv.CxlkvError as e:
            say(error=type(e).__name__, msg=str(e))
""")


class Host:
    """One host of the pod: a process with its own host id (and host slot, if given)."""

    def __init__(self, pool_path: str, host_id: str, slot: int | None = None, observer: bool = False):
        env = dict(
            os.environ, POOL=pool_path, LAYOUT=json.dumps(LAYOUT), TESTS=tu.here(), CXLKV_HOST_ID=host_id
        )
        env.pop("CXLKV_HOST_SLOT", None)
        if slot is not None:
            env["CXLKV_HOST_SLOT"] = str(slot)
        if observer:
            env["OBSERVER"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.hello = self.read()

    def read(self, timeout: float = 60.0) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"host pid {self.proc.pid} said nothing for {timeout} s (hung?)")
        line = self.proc.stdout.readline()
        assert line, f"host pid {self.proc.pid} exited: {self.proc.wait()}"
        return json.loads(line)

    def ask(self, cmd: str, timeout: float = 60.0) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def pod():
    hosts: list[Host] = []

    def start(*args, **kwargs) -> Host:
        h = Host(*args, **kwargs)
        hosts.append(h)
        return h

    yield start
    for h in hosts:
        h.kill()


def cli(*args: str, host: str, slot: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`cxlkv ARGS` as a fresh process of another host (the way an operator runs it)."""
    env = dict(os.environ, CXLKV_HOST_ID=host)
    env.pop("CXLKV_HOST_SLOT", None)
    if slot is not None:
        env["CXLKV_HOST_SLOT"] = str(slot)
    return subprocess.run(
        [sys.executable, "-m", "cxlkv", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def create(path: str, lease_ms: int, **kwargs) -> dict:
    with cxlkv.Pool.create(
        path, 16 * MiB, chunk_size=1 * MiB, backend="multihost", lease_ms=lease_ms, **kwargs
    ) as p:
        return p.info()


def node_word(path: str, info: dict, node: int) -> int:
    with open(path, "rb") as f:
        f.seek(info["node_table_off"] + (node - 1) * NODE_SLOT_BYTES)
        return struct.unpack("<Q", f.read(8))[0]


def write_tickets(path: str, info: dict, row: int, choosing: int, number: int, node: int, word: int) -> None:
    """The reviewer's stray write: one ticket (32 bytes) into `row` of every stripe."""
    with (
        open(path, "r+b") as f,
        mmap.mmap(f.fileno(), LOCK_AREA_OFF + LOCK_STRIPES * info["lock_hosts"] * 64) as m,
    ):
        for k in range(LOCK_STRIPES):
            off = LOCK_AREA_OFF + (k * info["lock_hosts"] + row) * 64
            m[off : off + 32] = struct.pack("<4Q", choosing, number, node, word)


@pytest.mark.timeout(240)
def test_a_stray_ticket_naming_a_live_node_wedges_nothing(pool_path, pod):
    info = create(pool_path, 500)
    a = pod(pool_path, "heal-a", slot=1)
    b = pod(pool_path, "heal-b", slot=2)
    assert a.ask("put a 16") == {"put": 16}
    # Row 9: no host uses it. The ticket names A, a live node, with its current state word.
    write_tickets(pool_path, info, 9, 0, 1, a.hello["node"], node_word(pool_path, info, a.hello["node"]))
    # Before issue 14 every claim of every process stopped here, forever.
    assert a.ask("put a2 64") == {"put": 64}
    assert b.ask("put b 64") == {"put": 64}
    assert b.ask("verify a2 64") == {"verified": 64, "wrong": 0}

    # An operator's check from another host names the foreign tickets (waiters ignore them) ...
    r = cli("pool", "check", "--json", pool_path, host="heal-admin")
    report = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert report["lock_area"]["foreign"] == LOCK_STRIPES, report
    assert any("row 9" in e for e in report["errors"]), report["errors"]
    # ... and a repair resets them: row 9 has no live node.
    with cxlkv.Pool.open(pool_path, attach=False) as admin:
        repaired = admin.check(repair=True)
    assert repaired["lock_area"]["reset"] >= LOCK_STRIPES, repaired
    r = cli("pool", "check", "--json", pool_path, host="heal-admin")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["lock_area"]["foreign"] == 0
    assert b.ask("verify b 64") == {"verified": 64, "wrong": 0}
    assert a.ask("close") == {"closed": True}, "close() must return"
    b.stop()


@pytest.mark.timeout(240)
def test_a_stray_ticket_on_a_live_hosts_own_row_is_healed_by_its_heartbeat(pool_path, pod):
    """A ticket in A's own row naming A with its word: every waiter must honour it (it could be
    A's), but A is not in the lock and never moves it. A's heartbeat resets what no process of A
    holds in its row; a waiter that still found it after Bakery::kWaitLeases leases would fail its
    claim with LockTimeoutError (tests/cpp/test_host_slot.cpp) instead of waiting forever."""
    info = create(pool_path, 2000)  # 2 s: on a loaded machine a 500 ms lease fenced A (heartbeat starved)
    a = pod(pool_path, "heal-a", slot=1)  # alive and idle: its heartbeat advances
    b = pod(pool_path, "heal-b", slot=2)
    write_tickets(pool_path, info, 1, 0, 1, a.hello["node"], node_word(pool_path, info, a.hello["node"]))
    assert b.ask("put b 64", timeout=120) == {"put": 64}
    assert b.ask("close", timeout=120) == {"closed": True}
    assert a.ask("verify b 64") == {"verified": 64, "wrong": 0}
    with open(pool_path, "rb") as f:  # every stripe of row 1 was reset
        for k in range(LOCK_STRIPES):
            f.seek(LOCK_AREA_OFF + (k * info["lock_hosts"] + 1) * 64)
            assert struct.unpack("<2Q", f.read(16)) == (0, 0), f"stripe {k}"
    b.stop()
    a.stop()


@pytest.mark.timeout(240)
def test_recovery_procedure_kill9_reap_from_another_hosts_cli(pool_path, pod):
    """ARCHITECTURE §11, end to end: kill -9 one host, reap it from another host's CLI."""
    create(pool_path, 1000)
    survivor = pod(pool_path, "heal-survivor", slot=2)
    victim = pod(pool_path, "heal-victim", slot=1)
    assert survivor.ask("put s 32") == {"put": 32}
    assert victim.ask("put v 32") == {"put": 32}
    dead = victim.hello["node"]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)

    # A fresh process of a third host (its own slot, as §11 tells operators) watches a lease, then
    # reclaims. It used to fence itself at half a lease and exit 2.
    r = cli("pool", "reap", str(dead), pool_path, "--json", host="heal-admin", slot=3)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["reclaimed"] is True and res["verdict"] == "dead", res
    # The survivor's data is intact, and so are the dead host's finished blocks.
    assert survivor.ask("verify s 32") == {"verified": 32, "wrong": 0}
    assert survivor.ask("verify v 32") == {"verified": 32, "wrong": 0}
    r = cli("pool", "check", pool_path, host="heal-admin")  # no slot: it probes a free row
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pool is consistent" in r.stdout

    # Without a reap: a fresh check must not call the pool consistent while it cannot judge the
    # dead node; it watches the lease, reclaims it, and then it may.
    victim2 = pod(pool_path, "heal-victim2", slot=1)
    assert victim2.ask("put w 8") == {"put": 8}
    victim2.proc.send_signal(signal.SIGKILL)
    victim2.proc.wait(timeout=30)
    r = cli("pool", "check", "--json", pool_path, host="heal-admin2")
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert report["reclaimed_nodes"] >= 1 and report["undecided_nodes"] == 0, report
    with cxlkv.Pool.open(pool_path, read_only=True) as p:
        assert [n for n in p.nodes() if n["node"] == victim2.hello["node"]] == [], p.nodes()
    survivor.stop()


@pytest.mark.timeout(240)
def test_observers_take_no_row_and_no_node_slot(pool_path, pod):
    """Issue 23 item 7: four observers stay open on a pool of 4 node slots and 4 rows; four hosts,
    each configured onto a row, still attach (no NodeTableFullError, no HostSlotBusyError), and the
    observers still read and check the full pool without taking anything."""
    create(pool_path, 1000, lock_hosts=4, max_nodes=4)
    observers = [pod(pool_path, f"heal-obs{i}", observer=True) for i in range(4)]
    for o in observers:
        assert o.hello == {"node": 0, "slot": -1}, o.hello  # no node slot, no row
    hosts = [pod(pool_path, f"heal-h{i}", slot=i) for i in range(4)]
    for i, h in enumerate(hosts):
        assert "error" not in h.hello and h.hello["slot"] == i and h.hello["node"] > 0, h.hello
    assert hosts[0].ask("put o 4") == {"put": 4}
    assert hosts[3].ask("verify o 4") == {"verified": 4, "wrong": 0}
    for o in observers:  # a full node table: observers still read, and check without a row
        assert o.ask("stats") == {"stats": 4, "node": 0, "slot": -1}
    assert observers[0].ask("check") == {"ok": True, "errors": [], "node": 0, "slot": -1}
    # The CLI's observers too, while the table is full.
    for cmd in (["pool", "stats"], ["pool", "check"]):
        r = subprocess.run(
            [sys.executable, "-m", "cxlkv", *cmd, pool_path],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, CXLKV_HOST_ID="heal-cli"),
        )
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    with cxlkv.Pool.open(pool_path, read_only=True) as p:
        assert sorted(n["node"] for n in p.nodes()) == sorted(h.hello["node"] for h in hosts), p.nodes()
    for h in hosts + observers:
        h.stop()


@pytest.mark.timeout(120)
def test_observers_take_no_node_slot_on_a_single_host_pool(pool_path, pod):
    """The same on the coherent backend: four observers on a 4-slot pool, four hosts still attach."""
    with cxlkv.Pool.create(pool_path, 16 * MiB, chunk_size=1 * MiB, max_nodes=4):
        pass
    observers = [pod(pool_path, "heal-one", observer=True) for _ in range(4)]
    assert all(o.hello == {"node": 0, "slot": -1} for o in observers), [o.hello for o in observers]
    hosts = [pod(pool_path, "heal-one") for _ in range(4)]
    assert all(h.hello["node"] > 0 for h in hosts), [h.hello for h in hosts]
    assert hosts[1].ask("put c 2") == {"put": 2} and hosts[2].ask("verify c 2") == {"verified": 2, "wrong": 0}
    for h in hosts + observers:
        h.stop()


@pytest.mark.timeout(120)
def test_an_observer_looking_while_a_node_crosses_its_lease_gets_no_error(pool_path):
    """A row-less observer's reap pass asks first whether any node is dead (then it becomes a
    writer), then reaps: a node of another kernel whose lease ran out between the two was claimed
    through the row-less arbiter, so a mere look (`pool check`, stats, the exporter) failed with
    ReadOnlyError, about one try in seven. Now that node waits for the next pass, which takes a row
    and reclaims it. Each try: a fresh never-beating node of another kernel, a fresh observer
    that reaps in a tight loop across the node's lease (100 ms).

    The observer that became a writer is a node with that lease too: on a loaded machine its own
    heartbeat thread can stall past half a lease, and it then fences itself (FencedError, correct:
    at a 50 ms lease, 14 tries in 400 at load 11). Such a try says nothing about the race: it is
    retried with a fresh observer (which reaps the fenced one's slot first, so it is not counted
    either), and 30 tries must see the crossing. A ReadOnlyError still fails the test at once."""
    try:
        info = create(pool_path, 100, max_nodes=4)
    except cxlkv.FencedError:  # the creator stalled so (its slot is reaped by the first try)
        with cxlkv.Pool.open(pool_path, read_only=True) as p:
            info = p.info()
    conclusive = fenced = 0
    for attempt in range(90):
        if conclusive == 30:
            break
        forged = (1 << 56) | (0xABCDE << 24) | (attempt + 1)  # CLAIMED, another kernel's domain
        with open(pool_path, "r+b") as f:
            f.seek(info["node_table_off"] + 1 * NODE_SLOT_BYTES)
            f.write(struct.pack("<Q", forged))
        with cxlkv.Pool.open(pool_path, attach=False) as obs:
            assert obs.info()["host_slot"] == -1
            reaped, deadline = 0, time.monotonic() + 30
            try:
                while node_word(pool_path, info, 2) >> 56 != 0 and time.monotonic() < deadline:
                    reaped += obs.reap_dead_nodes()  # no ReadOnlyError
            except cxlkv.FencedError:
                fenced += 1
                continue
            assert reaped >= 1 and obs.info()["host_slot"] >= 0, (attempt, reaped)
        assert node_word(pool_path, info, 2) >> 56 == 0  # FREE again
        # Two: it also reaped the slot of an observer fenced in an earlier try, and so became a
        # writer before the crossing (no race seen): not counted.
        conclusive += reaped == 1
    assert conclusive == 30, f"only {conclusive} tries of 90 ran to the end ({fenced} observers fenced)"


@pytest.mark.timeout(180)
def test_an_observer_that_must_write_takes_a_visible_row(pool_path, pod):
    """An observer that has something to write (here `pool reap`) becomes a writer: a probed row and a
    node slot, published like any host's, so no other host can take its row unseen; closing it gives
    both back and a host configured onto that row attaches."""
    create(pool_path, 1000, lock_hosts=2)
    a = pod(pool_path, "heal-a", slot=0)
    obs = pod(pool_path, "heal-obs", observer=True)
    assert obs.hello == {"node": 0, "slot": -1}, obs.hello
    c = pod(pool_path, "heal-c", slot=1)  # the observer took no row: the configured host attaches
    assert c.hello["slot"] == 1 and c.hello["node"] > 0, c.hello
    c.stop()
    with cxlkv.Pool.open(pool_path, attach=False) as admin:  # reaping a FREE slot is still a write
        admin.reap_node(2)
        assert admin.info()["host_slot"] == 1 and admin.node_id > 0
        with cxlkv.Pool.open(pool_path, read_only=True) as p:
            seen = {n["node"]: n for n in p.nodes()}
        assert seen[admin.node_id]["observer"] is True and seen[admin.node_id]["host_slot"] == 1, seen
        d = pod(pool_path, "heal-d")  # a prober: no row is free while the writer holds one
        assert d.hello.get("error") == "HostSlotBusyError" and "every one of its 2" in d.hello["msg"], d.hello
    c = pod(pool_path, "heal-c", slot=1)
    assert c.hello["slot"] == 1 and c.hello["node"] > 0, c.hello
    for h in (a, c, obs):
        h.stop()


@pytest.mark.timeout(180)
def test_hosts_without_a_configured_slot_never_share_a_row(pool_path, pod):
    """Two hosts whose default rows (host_id % lock_hosts) collide used to be refused: the second
    now probes the next free row. With 2 rows, several pairs include collisions."""
    create(pool_path, 1000, lock_hosts=2)
    for i in range(4):
        x = pod(pool_path, f"heal-x{i}")
        y = pod(pool_path, f"heal-y{i}")
        assert "error" not in x.hello and "error" not in y.hello, (x.hello, y.hello)
        assert {x.hello["slot"], y.hello["slot"]} == {0, 1}, (x.hello, y.hello)
        assert x.ask("put x 4") == {"put": 4} and y.ask("verify x 4") == {"verified": 4, "wrong": 0}
        x.stop()
        y.stop()
