"""Issue 9 with REAL processes: every process a separate host of a `multihost` pool in /dev/shm.

Each process gets its own ``CXLKV_HOST_ID`` (so peers judge it by the heartbeat lease, never by
the kernel lock: exactly what hosts of a CXL pod can do) and its own ``CXLKV_HOST_SLOT`` (its
bakery row). A long-lived supervisor process (this test, itself a host) observes every node, so
it can declare a silent one dead after one lease and reclaim it.

* kill -9 chaos: the foundation's chaos workload (test_chaos.chaos_kill9, chaos_worker.py) with
  DistinctHosts instead of one host;
* kill -9 at each named fault point (insert.claimed, insert.copied, evict.claimed, alloc.claimed,
  alloc.carving, lock.held), armed in the worker by ``CXLKV_TEST_FAULT`` (src/core/coherence/fault_trap.h):
  the worker SIGKILLs itself exactly there, a survivor keeps working through the lease, then the
  pool checks clean and every resident block reads back its own bytes;
* slow, not dead: a process holding pins and stopped (SIGSTOP by its own fault trap) in the middle
  of a put is reclaimed after the lease, then resumed: it is fenced before it publishes anything,
  and works again once it opens the pool again.

Random choices print their seed (``CXLKV_TEST_SEED`` replays them). No timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import KiB, MiB
from cxlkv.testing.layouts import opaque_layout
from test_chaos import OneHost, Zygote, chaos_kill9, read_reports

LOCK_HOSTS = 16  # the default lock area: slot 0 is the supervisor's, 1..14 the workers'
WORKER_SLOTS = range(1, LOCK_HOSTS - 1)  # the last row is the default of observers (pool check)
FAULT_POINTS = (
    "insert.claimed",
    "insert.copied",
    "evict.claimed",
    "alloc.claimed",
    "alloc.carving",
    "lock.held",
)


def _pid_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (R, S, T stopped, Z dead and unreaped); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return ""


class DistinctHosts(OneHost):
    """Every worker a separate host: a fresh host id each, a host slot that no live or
    not-yet-reclaimed node holds, and this process as the supervisor that reclaims the dead after
    a lease (a fresh process cannot: it has not watched them fall silent)."""

    # min_ops only proves the workers worked between kills (2 shared cores, a lease per death).
    target_kills, min_kills, budget_s, min_ops = 100, 10, 20.0, 200
    may_fence = True  # judged by the lease: a worker starved of CPU may be fenced (and re-opens)

    def __init__(self, lease_ms: int, tag: str = "chaos"):
        self.lease_ms = lease_ms
        self.tag = tag
        self.sup: cxlkv.Pool | None = None
        self.spawned = 0
        self.slot_of_wid: dict[int, int] = {}
        self.dead: list[tuple[int, int]] = []  # (host slot, pid) until its node is reclaimed
        self.last_of_wid: dict[int, tuple[int, int]] = {}  # the last (slot, pid) killed per worker

    def create(self, path, size, **kwargs):
        kwargs["max_nodes"] = 32  # dead nodes wait a lease for their reclaim
        return cxlkv.Pool.create(path, size, backend="multihost", lease_ms=self.lease_ms, **kwargs)

    def start(self, path):
        self.path = path
        os.environ.update(CXLKV_HOST_ID=f"{self.tag}-supervisor", CXLKV_HOST_SLOT="0")
        try:
            self.sup = cxlkv.Pool.open(path)
        finally:
            del os.environ["CXLKV_HOST_ID"], os.environ["CXLKV_HOST_SLOT"]
        # The library reclaims a dead node only when someone notices (an attach, a failed
        # allocation, check, reap), and only a judge that watched it fall silent can declare it
        # dead: the supervisor watches all the time, as a long-lived host of a pod would.
        self.stop = threading.Event()
        self.reaper = threading.Thread(target=self._reap_forever, daemon=True)
        self.reaper.start()

    def _reap_forever(self):
        while not self.stop.wait(self.lease_ms / 10000):
            self.sup.reap_dead_nodes()

    def _nodes(self) -> list[dict]:
        assert self.sup is not None
        self.sup.reap_dead_nodes()
        return [n for n in self.sup.nodes() if n["state"] != "free" and not n["self"]]

    def _resolve_dead(self) -> None:
        pids = {n["pid"] for n in self._nodes()}
        self.dead = [(s, pid) for s, pid in self.dead if pid in pids]

    def spawn_env(self, wid):
        """A worker replacing one that died before it was attached takes the dead one's host slot,
        as a host restarting its process would: the dead attacher may have left a lock ticket
        that names no node (see test_attach_after_a_host_died_attaching_with_a_lock_held), and only
        the row's new owner rewrites it. Any other worker takes a slot no node holds."""
        prev = self.last_of_wid.pop(wid, None)
        deadline = time.monotonic() + 20 * self.lease_ms / 1000
        while True:
            self._resolve_dead()
            if prev is not None and prev[1] not in {n["pid"] for n in self._nodes() if n["state"] == "alive"}:
                slot = prev[0]
                self.dead = [d for d in self.dead if d != prev]
                break
            busy = set(self.slot_of_wid.values()) | {s for s, _ in self.dead}
            free = [s for s in WORKER_SLOTS if s not in busy]
            if free:
                slot = free[self.spawned % len(free)]
                break
            assert time.monotonic() < deadline, f"no host slot reclaimed in 20 leases: {self._nodes()}"
            time.sleep(self.lease_ms / 20000)
        self.spawned += 1
        self.slot_of_wid[wid] = slot
        return {
            "CXLKV_HOST_ID": f"{self.tag}-{self.spawned}",
            "CXLKV_HOST_SLOT": str(slot),
            "CXLKV_CHAOS_REOPEN_FENCED": "1",  # chaos_worker.is_fenced
        }

    def killed(self, wid, pid):
        dead = (self.slot_of_wid.pop(wid), pid)
        self.dead.append(dead)
        self.last_of_wid[wid] = dead

    def settle(self):
        deadline = time.monotonic() + 20 * self.lease_ms / 1000
        while nodes := self._nodes():
            assert time.monotonic() < deadline, f"dead nodes not reclaimed in 20 leases: {nodes}"
            time.sleep(self.lease_ms / 20000)
        self.dead.clear()

    def verifier(self):
        return contextlib.nullcontext(self.sup)

    def close(self):
        if getattr(self, "reaper", None) is not None:
            self.stop.set()
            self.reaper.join()
            self.reaper = None
        if self.sup is not None:
            self.sup.close()
            self.sup = None


@pytest.fixture
def hosts():
    made: list[DistinctHosts] = []

    def make(lease_ms: int, tag: str = "chaos") -> DistinctHosts:
        made.append(DistinctHosts(lease_ms, tag))
        return made[-1]

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------------------------------------
# kill -9 chaos, every worker its own host


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chaos_kill9_distinct_hosts(pool_path, tmp_path, hosts):
    # Every dead host costs its peers up to a lease (its lock tickets, its slots): a short lease
    # keeps the kills coming; 1 s, not less, so that the supervisor's own heartbeat survives the
    # CPU starvation of 2 shared cores (at 500 ms it was fenced once in three runs). A live worker starved of CPU for half of it fences itself and opens
    # the pool again (counted and printed; chaos_worker.is_fenced).
    chaos_kill9(pool_path, tmp_path, hosts(lease_ms=1000))


# ------------------------------------------------------------------------------------------------
# kill -9 at each named fault point

# How many hits of each point a worker may pass before its trap fires (drawn uniformly from 1..N):
# a point that is hit rarely (carving a chunk, evicting) gets a small N so that it fires at all.
MAX_HIT = {
    "insert.claimed": 100,
    "insert.copied": 100,
    "evict.claimed": 5,
    "alloc.claimed": 100,
    "alloc.carving": 2,
    "lock.held": 200,
}
FAULT_LEASE_MS = 400
POINT_TIMEOUT_S = 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_kill9_at_fault_point(point, pool_path, tmp_path, hosts):
    chains, singles = 100, 600
    seed = tu.random_test_seed(f"kill -9 at {point}")
    rng = random.Random(seed)
    h = hosts(FAULT_LEASE_MS, tag=point)
    h.path = pool_path
    size = 4 * MiB  # smaller than the working set: puts evict
    with h.create(pool_path, size, chunk_size=256 * KiB) as pool:
        pool.namespace(tu.shared_layout())
    h.start(pool_path)
    zy = Zygote(pool_path, tmp_path, chains=chains, singles=singles)
    unexpected = []
    live: list[int] = []
    try:
        # The armed worker and a survivor start together: on a fresh pool both carve chunks, both
        # fill it, then both evict. Carving, though, happens only while no chunk of the namespace
        # has room, so a survivor could do all of it: there the armed worker starts alone.
        n = rng.randint(1, MAX_HIT[point])
        armed_env = dict(h.spawn_env(0), CXLKV_TEST_FAULT=f"{point}:kill@{n}")
        armed = zy.spawn(0, rng.randrange(1 << 30), armed_env)
        live.append(armed)
        survivor_env = h.spawn_env(1)
        if point != "alloc.carving":
            live.append(survivor := zy.spawn(1, rng.randrange(1 << 30), survivor_env))
        deadline = time.monotonic() + POINT_TIMEOUT_S
        while _pid_state(armed) not in ("Z", "") and time.monotonic() < deadline:
            time.sleep(0.01)
            h.sup.reap_dead_nodes()  # the supervisor keeps watching every node
        reached = _pid_state(armed) in ("Z", "")
        if not reached:
            os.kill(armed, signal.SIGKILL)
        status = zy.reap(armed)
        live.remove(armed)
        h.killed(0, armed)
        assert reached, f"{point}@{n} was not reached in {POINT_TIMEOUT_S} s"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        if point == "alloc.carving":
            live.append(survivor := zy.spawn(1, rng.randrange(1 << 30), survivor_env))
        # The survivor works on through the dead host's leftovers (its lock ticket, WRITING or
        # EVICTING entry, claimed block or carving chunk) until they are reclaimed, and longer.
        end = time.monotonic() + 2.5 * FAULT_LEASE_MS / 1000
        while time.monotonic() < end:
            h.sup.reap_dead_nodes()
            time.sleep(0.02)
        live.remove(survivor)
        if _pid_state(survivor) in ("Z", ""):
            unexpected.append(f"the survivor {survivor} died by itself: status {zy.reap(survivor)}")
        else:
            os.kill(survivor, signal.SIGKILL)  # dies holding whatever it held: reclaimed as well
            zy.reap(survivor)
        h.killed(1, survivor)
    finally:
        for pid in live:  # a failure above must not leave a worker running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        zy.quit()
    assert not read_reports(tmp_path, "mismatch-"), read_reports(tmp_path, "mismatch-")
    assert not read_reports(tmp_path, "errors-"), read_reports(tmp_path, "errors-")
    assert not unexpected, unexpected
    print(f"{point}: the worker killed itself at hit {n}; survivor ran {2.5} leases after")

    h.settle()
    pool = h.sup
    report = pool.check()
    assert tu.pool_check_problems(report) == [], json.dumps(report, indent=1)[:4000]
    assert pool.stats()["reclaimed_nodes"] >= 2  # the armed worker and the survivor
    # Nothing leaked: the whole pool can be filled again.
    ns = pool.namespace(tu.shared_layout())
    tu.assert_kv_intact_and_refillable(ns, chains, singles, report["blocks"]["capacity"], point)
    assert tu.pool_check_problems(pool.check()) == []


def _end_child(child: subprocess.Popen) -> None:
    """A child that may be stopped (SIGSTOP, a stop fault) and still running after a failure:
    resumed so that SIGKILL is delivered at once, reaped, its pipes closed."""
    if child.poll() is None:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()
    for f in (child.stdin, child.stdout, child.stderr):
        if f is not None:
            f.close()


# ------------------------------------------------------------------------------------------------
# slow, not dead

SLOW_LEASE_MS = 500
LAYOUT = opaque_layout("slow-host")
SLOW_CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["TESTS"])
    import cxlkv, cxlkv_testutil as tu
    LAYOUT = cxlkv.KVLayout(**json.loads(os.environ["LAYOUT"]))
    def say(**kw): print(json.dumps(kw), flush=True)
    def key(i): return tu.make_key("slow", i)
    def verify(ns, keys):
        bad, seen = [], 0
        for k in keys:
            d = ns.get_bytes(k)
            if d is not None:
                seen += 1
                if not tu.verify_bytes(k, d, 1024):
                    bad.append(k.hex())
        return bad, seen

    path = os.environ["POOL"]
    pool = cxlkv.Pool.open(path)
    ns = pool.namespace(LAYOUT)
    lease = ns.acquire([key(i) for i in range(4)])
    say(node=pool.node_id, pinned=len(lease))
    sys.stdin.readline()
    # The fault trap stops this process inside the put (CXLKV_TEST_FAULT=<point>:stop).
    try:
        say(put=ns.put(key(100), tu.key_payload(key(100), 1024)))
    except cxlkv.CxlkvError as e:
        say(put_error=f"{type(e).__name__}: {e}")
    # Every later operation of the stale attachment fails and publishes nothing.
    stale = {}
    for name, op in [("put", lambda: ns.put(key(101), tu.key_payload(key(101), 1024))),
                     ("get", lambda: verify(ns, [key(0)])[0]),
                     ("release", lease.release)]:
        try:
            stale[name] = repr(op())
        except cxlkv.CxlkvError as e:
            stale[name] = "error: " + str(e)
    try:
        pool.close()
    except cxlkv.CxlkvError as e:
        stale["close"] = "error: " + str(e)
    say(stale=stale)
    # Re-attach: a new node, which works.
    with cxlkv.Pool.open(path) as pool:
        ns = pool.namespace(LAYOUT)
        bad, seen = verify(ns, [key(i) for i in range(102)])
        ok = ns.put(key(100), tu.key_payload(key(100), 1024))
        got = ns.get_bytes(key(100))
        say(node=pool.node_id, bad=bad, seen=seen, put=ok,
            readback=got is not None and tu.verify_bytes(key(100), got, 1024))
""")


def _slow_key(i: int) -> bytes:
    return tu.make_key("slow", i)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("point", ["insert.claimed", "alloc.claimed", "insert.copied"])
def test_slow_host_is_fenced_then_reattaches(point, pool_path, hosts):
    """A host stopped past its lease while it holds pins and a half-written entry (WRITING, with or
    without its block) is reclaimed; resumed, it finds itself fenced before any publish."""
    h = hosts(SLOW_LEASE_MS, tag="judge")
    layout = cxlkv.KVLayout(**LAYOUT)
    with h.create(pool_path, 16 * MiB, chunk_size=1 * MiB) as pool:
        ns = pool.namespace(layout)
        for i in range(8):
            assert ns.put(_slow_key(i), tu.key_payload(_slow_key(i), 1024))
    h.start(pool_path)
    judge = h.sup
    ns = judge.namespace(layout)
    env = dict(
        os.environ,
        POOL=pool_path,
        TESTS=tu.here(),
        LAYOUT=json.dumps(LAYOUT),
        CXLKV_HOST_ID="slow-host",
        CXLKV_HOST_SLOT="1",
        CXLKV_TEST_FAULT=f"{point}:stop",
    )
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def read() -> dict:
        line = child.stdout.readline()
        assert line, f"child died: rc={child.wait()} stderr={child.stderr.read()[-3000:]}"
        return json.loads(line)

    try:
        first = read()
        assert first["pinned"] == 4, first
        slow_node = first["node"]
        assert not ns.delete(_slow_key(3)), "a block pinned by a live host was deleted"
        child.stdin.write("go\n")
        child.stdin.flush()
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # stopped by its own trap, at the point
        assert os.WIFSTOPPED(status), status

        # Stopped past its lease: the judge declares it dead and reclaims its node.
        t_stop = time.monotonic()
        while any(n["node"] == slow_node and n["state"] != "free" for n in judge.nodes()):
            assert time.monotonic() - t_stop < 20 * SLOW_LEASE_MS / 1000, judge.nodes()
            judge.reap_dead_nodes()
            time.sleep(0.02)
        report = judge.check()
        assert tu.pool_check_problems(report) == [], json.dumps(report, indent=1)
        assert ns.delete(_slow_key(3)), "the pins of the reclaimed host were not released"
        assert ns.get_bytes(_slow_key(100)) is None, "a half-written entry became visible"
        # Others go on using the pool, and the blocks the slow host held return to use.
        for i in [3, *range(8, 64)]:
            assert ns.put(_slow_key(i), tu.key_payload(_slow_key(i), 1024))

        os.kill(child.pid, signal.SIGCONT)
        resumed = read()
        assert "put_error" in resumed, f"the slow host's put went on after its reclaim: {resumed}"
        assert resumed["put_error"].startswith("FencedError: "), resumed
        stale = read()["stale"]
        print(f"{point}: resumed: {resumed}; stale attachment: {stale}")
        assert stale["put"].startswith("error:"), f"a fenced node could still put: {stale}"
        assert stale["release"].startswith("error:") or stale["release"] == "None", stale
        assert stale["get"] in ("[]",) or stale["get"].startswith("error:"), f"wrong bytes: {stale}"
        last = read()
        assert last["bad"] == [], f"wrong bytes after re-attaching: {last}"
        assert last["put"] is True and last["readback"] is True, last
        assert last["node"] != 0
        assert child.wait(timeout=30) == 0, child.stderr.read()[-3000:]
    finally:
        _end_child(child)

    # Nothing the fenced attachment tried after its reclaim reached the pool; every read checks.
    assert ns.get_bytes(_slow_key(101)) is None, "the fenced node published key 101"
    bad = [
        i
        for i in range(102)
        if (d := ns.get_bytes(_slow_key(i))) is not None and not tu.verify_bytes(_slow_key(i), d, 1024)
    ]
    assert bad == [], f"wrong bytes for keys {bad}"
    assert ns.get_bytes(_slow_key(100)) is not None
    report = judge.check()
    assert tu.pool_check_problems(report) == [], json.dumps(report, indent=1)
    assert judge.stats()["reclaimed_nodes"] >= 1


PAUSED_ATTACHER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["TESTS"])
    import cxlkv, cxlkv_testutil as tu
    LAYOUT = cxlkv.KVLayout(**json.loads(os.environ["LAYOUT"]))
    try:  # stopped by its trap while it holds the cross-host lock of its node slot claim
        cxlkv.Pool.open(os.environ["POOL"]).close()
        print(json.dumps({"first": "attached"}), flush=True)
    except cxlkv.CxlkvError as e:
        print(json.dumps({"first": f"{type(e).__name__}: {e}"}), flush=True)
    with cxlkv.Pool.open(os.environ["POOL"]) as pool:
        k = tu.make_key("slow", 200)
        ok = pool.namespace(LAYOUT).put(k, tu.key_payload(k, 1024))
        print(json.dumps({"node": pool.node_id, "put": ok}), flush=True)
""")


@pytest.mark.timeout(90)
def test_host_paused_holding_the_cross_host_lock(pool_path, hosts):
    """A host stopped inside the bakery's critical section (lock.held, while claiming its node
    slot) for longer than a lease: the others get past its ticket and keep working; resumed, it
    stores nothing (its attach fails, fenced) and attaches on a second try."""
    h = hosts(SLOW_LEASE_MS, tag="judge")
    h.create(pool_path, 16 * MiB, chunk_size=1 * MiB).close()
    h.start(pool_path)
    ns = h.sup.namespace(cxlkv.KVLayout(**LAYOUT))
    env = dict(
        os.environ,
        POOL=pool_path,
        TESTS=tu.here(),
        LAYOUT=json.dumps(LAYOUT),
        CXLKV_HOST_ID="paused-host",
        CXLKV_HOST_SLOT="1",
        CXLKV_TEST_FAULT="lock.held:stop@1",
    )
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_ATTACHER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        t_stop = time.monotonic()
        for i in range(64):  # some of these claims need the stripe the stopped host holds
            k = _slow_key(300 + i)
            assert ns.put(k, tu.key_payload(k, 1024))
        time.sleep(max(0.0, 1.5 * SLOW_LEASE_MS / 1000 - (time.monotonic() - t_stop)))
        os.kill(child.pid, signal.SIGCONT)
        first = json.loads(child.stdout.readline())
        assert first["first"].startswith("FencedError: "), f"the paused host went on after a lease: {first}"
        last = json.loads(child.stdout.readline())
        assert last["put"] is True and last["node"] > 0, last
        assert child.wait(timeout=30) == 0
    finally:
        _end_child(child)
    for i in [*range(300, 364), 200]:
        d = ns.get_bytes(_slow_key(i))
        assert d is not None and tu.verify_bytes(_slow_key(i), d, 1024), i
    assert tu.pool_check_problems(h.sup.check()) == []


SLOW_ATTACHER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, os.environ["TESTS"])
    import cxlkv, cxlkv_testutil as tu
    LAYOUT = cxlkv.KVLayout(**json.loads(os.environ["LAYOUT"]))
    lease_s = int(os.environ["LEASE_MS"]) / 1000
    for attempt in range(2):  # the first may fail, fenced, if its pause exceeded half a lease
        try:
            pool = cxlkv.Pool.open(os.environ["POOL"])
            break
        except cxlkv.CxlkvError as e:
            print(json.dumps({"open_failed": str(e)}), flush=True)
    print(json.dumps({"attached": pool.node_id, "attempt": attempt}), flush=True)
    try:
        ns = pool.namespace(LAYOUT)
        end = time.monotonic() + 2 * lease_s
        while time.monotonic() < end:
            k = tu.make_key("slow", 0)
            d = ns.get_bytes(k)
            assert d is None or tu.verify_bytes(k, d, 1024)
            time.sleep(lease_s / 20)
        print(json.dumps({"ok": True}), flush=True)
    except cxlkv.CxlkvError as e:
        print(json.dumps({"fenced_after_attach": str(e)}), flush=True)
""")


@pytest.mark.timeout(60)
def test_slow_attach_that_succeeded_is_not_fenced_by_its_first_beat(pool_path, hosts):
    """An attach that took between a quarter and half a lease (here: stopped for 0.3 lease while
    claiming its node slot) publishes its node and its first beat in time; its heartbeat thread's
    first beat comes a quarter lease later. Regression: that first beat measured the gap from
    before the attach, found it over half a lease and fenced a node that had just attached."""
    lease_ms = 1000
    h = hosts(lease_ms, tag="judge")
    h.create(pool_path, 16 * MiB, chunk_size=1 * MiB).close()
    h.start(pool_path)
    env = dict(
        os.environ,
        POOL=pool_path,
        TESTS=tu.here(),
        LAYOUT=json.dumps(LAYOUT),
        LEASE_MS=str(lease_ms),
        CXLKV_HOST_ID="slow-attacher",
        CXLKV_HOST_SLOT="1",
        CXLKV_TEST_FAULT="lock.held:stop@1",
    )
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_ATTACHER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        time.sleep(0.3 * lease_ms / 1000)
        os.kill(child.pid, signal.SIGCONT)
        out = [json.loads(line) for line in child.stdout]
        assert child.wait(timeout=30) == 0
    finally:
        _end_child(child)
    print(out)
    assert out[-1] == {"ok": True}, f"a node that attached was fenced by its own first beat: {out}"


# ------------------------------------------------------------------------------------------------
# Found by these tests in the cross-host lock (arbiter.cpp). A reclaimed ticket holder whose node
# slot a live attachment reuses used to block its stripe (Bakery::lock now voids the ticket of a
# holder whose node slot changed). An attach behind a ticket that names no node used to lapse its
# own fence while it waited a lease (it has no heartbeat yet): such a waiter now publishes its
# progress in its line's `waits` and runs its fence from that (issue 14).

BUG_LEASE_MS = 300
PUTTER = textwrap.dedent("""
    import hashlib, os, sys, time, cxlkv
    pool = cxlkv.Pool.open(os.environ["POOL"])
    ns = pool.namespace(cxlkv.KVLayout(**__import__("json").loads(os.environ["LAYOUT"])))
    print(pool.node_id, flush=True)
    if sys.argv[1] == "put":
        for i in range(1 << 20):
            k = hashlib.sha256(b"putter%d" % i).digest()
            ns.put(k, k * 32)
    time.sleep(20 * int(os.environ["LEASE_MS"]) / 1000)  # idle: a live host, beating
""")


def _putter(pool_path: str, host: str, slot: int, mode: str, fault: str | None = None) -> subprocess.Popen:
    env = dict(
        os.environ,
        POOL=pool_path,
        LAYOUT=json.dumps(LAYOUT),
        LEASE_MS=str(BUG_LEASE_MS),
        CXLKV_HOST_ID=host,
        CXLKV_HOST_SLOT=str(slot),
    )
    if fault:
        env["CXLKV_TEST_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-c", PUTTER, mode], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(60)
def test_reclaimed_lock_holder_does_not_block_when_its_node_slot_is_reused(pool_path, hosts):
    """Regression: the put blocked until B exited (forever, for a B that stays)."""
    h = hosts(BUG_LEASE_MS, tag="bug-a")
    h.create(pool_path, 16 * MiB, chunk_size=1 * MiB).close()
    h.start(pool_path)
    ns = h.sup.namespace(cxlkv.KVLayout(**LAYOUT))
    # A dies holding a cross-host lock in the middle of its puts (after its attach: its ticket
    # names its node), and is reclaimed after a lease.
    a = _putter(pool_path, "bug-a-holder", 1, "put", fault="lock.held:kill@40")
    a_node = int(a.stdout.readline())
    assert a.wait(timeout=30) == -signal.SIGKILL
    a.stdout.close()
    h.settle()
    # B attaches on another host slot and takes A's free node slot, and lives on.
    b = _putter(pool_path, "bug-a-reuser", 2, "idle")
    try:
        assert int(b.stdout.readline()) == a_node, "B did not reuse A's node slot: the test proves nothing"
        for i in range(256):  # every lock stripe, many times
            k = tu.make_key("bug-a", i)
            assert ns.put(k, tu.key_payload(k, 1024))
            assert b.poll() is None, f"put {i} completed only after B exited: it waited for B's node slot"
    finally:
        b.kill()
        b.wait()
        b.stdout.close()


@pytest.mark.timeout(60)
def test_attach_after_a_host_died_attaching_with_a_lock_held(pool_path, hosts):
    h = hosts(BUG_LEASE_MS, tag="bug-c")
    h.create(pool_path, 16 * MiB, chunk_size=1 * MiB).close()
    # A dies at the first cross-host lock it holds: while claiming its node slot.
    a = _putter(pool_path, "bug-c-attacher", 1, "idle", fault="lock.held:kill@1")
    assert a.wait(timeout=30) == -signal.SIGKILL
    a.stdout.close()
    h.start(pool_path)  # the supervisor attaches (host slot 0): this raised before issue 14
    assert h.sup.node_id > 0
