"""Crash chaos: a supervisor kill -9s random workers at random moments, hundreds of times, and
restarts them. Workers loop put/get/store/load/acquire/delete on a shared pool and verify every byte
they read. Afterwards the pool must check clean: no leaked blocks, no entries stuck in
WRITING/EVICTING, no orphan pins; and no worker ever saw wrong bytes.

Workers are forked from a zygote process (chaos_worker.py zygote) that has already imported numpy
and cxlkv, so a restart costs a fork, not an interpreter start: that is what makes hundreds of
kills fit in a few seconds on two cores. Each worker is a real process killed with SIGKILL at a
random point: while attaching, inside put/store (WRITING), inside eviction, holding a lease...
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import cxlkv
import cxlkv_testutil as tu
from chaos_worker import PROGRESS_EVERY
from conftest import KiB, MiB

WORKER = os.path.join(tu.here(), "chaos_worker.py")
N_WORKERS = 4
TARGET_KILLS = 300
MIN_KILLS = 200
CHAOS_BUDGET_S = 35.0
# How long a worker lives before its kill -9 (seconds, drawn uniformly): a kill within
# ATTACH_WINDOW_S of the spawn lands while attaching; most workers then die within SHORT_LIFE_S of
# being ready (inside put/store/acquire), one in ten lives LONG_LIFE_S, long enough to fill the
# pool and evict.
KILL_ANYWHERE_P, KILL_SHORT_P = 0.15, 0.9
ATTACH_WINDOW_S = 0.004
SHORT_LIFE_S = 0.03
LONG_LIFE_S = (0.05, 0.25)
READY_TIMEOUT_S = 20
# A pool creation of 256 MiB takes a few hundred ms on a small machine: kills spread over this
# window land before, during and after it.
CREATE_KILL_WINDOW_S = 0.4


class Zygote:
    def __init__(self, pool_path, report_dir, *, chains, singles):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "zygote",
                "--pool",
                pool_path,
                "--report-dir",
                str(report_dir),
                "--chains",
                str(chains),
                "--singles",
                str(singles),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self.events = queue.Queue()
        self.ready = set()
        self.status = {}
        self.pids = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.events.put(line.split())
        self.events.put(["eof"])

    def _pump(self, timeout):
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            return False
        if ev[0] == "pid":
            self.pids[int(ev[1])] = int(ev[2])
        elif ev[0] == "ready":
            self.ready.add(int(ev[1]))
        elif ev[0] == "status":
            self.status[int(ev[1])] = int(ev[2])
        elif ev[0] == "eof":
            raise RuntimeError("zygote died: " + self.proc.stderr.read())
        return True

    def _until(self, pred, timeout, what):
        end = time.monotonic() + timeout
        while not pred():
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(what)
            self._pump(min(left, 0.5))

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def spawn(self, wid, seed, env=None):
        """env: environment variables of this worker only (its host id, host slot, fault point)."""
        self.pids.pop(wid, None)
        extra = "".join(f" {k}={v}" for k, v in (env or {}).items())
        self.send(f"spawn {wid} {seed}{extra}")
        self._until(lambda: wid in self.pids, 30, "spawn reply")
        return self.pids[wid]

    def wait_ready(self, pid, timeout):
        try:
            self._until(lambda: pid in self.ready, timeout, "ready")
            return True
        except TimeoutError:
            return False

    def drain(self):
        while self._pump(0):
            pass

    def reap(self, pid):
        self.send(f"wait {pid}")
        self._until(lambda: pid in self.status, 30, f"status of {pid}")
        return self.status.pop(pid)

    def quit(self):
        try:
            self.send("quit")
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)  # it stops at the end of stdout
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def read_reports(report_dir, prefix):
    out = []
    for name in sorted(os.listdir(report_dir)):
        if name.startswith(prefix):
            with open(os.path.join(report_dir, name)) as f:
                out.append(f"{name}:\n{f.read()}")
    return out


class OneHost:
    """Where the chaos workers live: here, every process on this kernel (one host). A dead node is
    judged by its kernel lock, so whoever attaches next reclaims it at once. test_multihost_procs
    runs the same chaos with every worker a separate host of a multihost pool (DistinctHosts)."""

    target_kills, min_kills, budget_s, min_ops = TARGET_KILLS, MIN_KILLS, CHAOS_BUDGET_S, 20000
    may_fence = False  # a node of this kernel is judged by its kernel lock: never fenced alive

    def create(self, path, size, **kwargs):
        return cxlkv.Pool.create(path, size, **kwargs)

    def start(self, path):
        """Called once the pool exists, before the first worker."""

    def spawn_env(self, wid):
        """Environment of the next worker (its host identity); waits until one is available."""
        return None

    def killed(self, wid, pid):
        """Worker `wid` (process `pid`) was just killed with SIGKILL."""

    def settle(self):
        """Every killed worker's node is reclaimed when this returns."""

    def verifier(self):
        """An attached pool to verify with (attaching reclaims what the dead left)."""
        return cxlkv.Pool.open(self.path)

    def close(self):
        pass


def chaos_kill9(pool_path, tmp_path, hosts):
    """kill -9 chaos on `hosts` (OneHost, or DistinctHosts in test_multihost_procs.py)."""
    chains, singles = 300, 2000
    size = 8 * MiB  # much smaller than the working set: constant eviction
    assert size < (chains * 8 + singles) * 4 * KiB / 2
    hosts.path = pool_path
    with hosts.create(pool_path, size, chunk_size=256 * KiB, max_nodes=16) as pool:
        pool.namespace(tu.shared_layout())
    seed = tu.random_test_seed("chaos kill -9")
    rng = random.Random(seed)
    hosts.start(pool_path)
    zy = Zygote(pool_path, tmp_path, chains=chains, singles=singles)
    kills = 0
    kills_before_ready = 0
    unexpected = []
    live = {}
    try:
        for wid in range(N_WORKERS):
            live[wid] = zy.spawn(wid, rng.randrange(1 << 30), hosts.spawn_env(wid))
        t_end = time.monotonic() + hosts.budget_s
        while kills < hosts.target_kills and time.monotonic() < t_end:
            wid = rng.randrange(N_WORKERS)
            pid = live[wid]
            r = rng.random()
            if r < KILL_ANYWHERE_P:
                # anywhere, including while attaching to the pool (node slot half claimed)
                time.sleep(rng.uniform(0, ATTACH_WINDOW_S))
            else:
                if not zy.wait_ready(pid, READY_TIMEOUT_S):
                    unexpected.append(f"worker {wid} pid {pid} never became ready")
                # mostly short lifetimes, sometimes long enough to fill the pool and evict
                time.sleep(rng.uniform(0, SHORT_LIFE_S) if r < KILL_SHORT_P else rng.uniform(*LONG_LIFE_S))
            zy.drain()
            if pid not in zy.ready:
                kills_before_ready += 1
            os.kill(pid, signal.SIGKILL)
            status = zy.reap(pid)
            hosts.killed(wid, pid)
            zy.ready.discard(pid)
            if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                unexpected.append(f"worker {wid} pid {pid} ended by itself, status {status}")
            kills += 1
            live[wid] = zy.spawn(wid, rng.randrange(1 << 30), hosts.spawn_env(wid))
        # end of chaos: kill the survivors too (they die holding whatever they held)
        for wid, pid in live.items():
            os.kill(pid, signal.SIGKILL)
            zy.reap(pid)
            hosts.killed(wid, pid)
            kills += 1
        live.clear()
    finally:
        for pid in live.values():  # a failure above must not leave a worker running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        zy.quit()

    elapsed = time.monotonic() - t_end + hosts.budget_s
    ops = PROGRESS_EVERY * sum(
        os.path.getsize(os.path.join(tmp_path, n)) for n in os.listdir(tmp_path) if n.startswith("progress-")
    )
    print(
        f"chaos: {kills} kills ({kills_before_ready} before the worker was attached) in "
        f"{elapsed:.1f} s, about {ops} operations"
    )
    errors = read_reports(tmp_path, "errors-")
    mismatches = read_reports(tmp_path, "mismatch-")
    fenced = read_reports(tmp_path, "fenced-")
    print(
        f"chaos: {sum(r.count(chr(10)) - 1 for r in fenced)} times a worker was fenced and opened the pool again"
    )
    assert hosts.may_fence or not fenced, fenced
    assert not mismatches, "readers observed wrong bytes:\n" + "\n".join(mismatches)[:4000]
    assert not errors, "workers raised:\n" + "\n".join(errors)[:4000]
    assert not unexpected, unexpected
    assert kills >= hosts.min_kills, f"only {kills} kills in {hosts.budget_s} s"
    assert ops >= hosts.min_ops, f"workers did only about {ops} operations between kills"

    # The dead nodes are reclaimed: their pins, half-written blocks, evictions in progress.
    hosts.settle()
    with hosts.verifier() as pool:
        report = pool.check()
        print("chaos: check after reopening:", json.dumps(report))
        assert tu.pool_check_problems(report) == [], json.dumps(report, indent=1)[:4000]
        # no capacity leaked: the pool can be filled again completely
        ns = pool.namespace(tu.shared_layout())
        assert ns.block_bytes == 4 * KiB
        tu.assert_kv_intact_and_refillable(
            ns, chains, singles, size // (4 * KiB) + 200, "chaos", "post-chaos"
        )
        report = pool.check()
        assert tu.pool_check_problems(report) == [], json.dumps(report, indent=1)[:4000]

    # and the pool keeps working for new processes, concurrently
    procs = []
    for wid in range(2):
        summary = os.path.join(tmp_path, f"post-{wid}.json")
        env = dict(os.environ, **(hosts.spawn_env(100 + wid) or {}))
        procs.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        WORKER,
                        "run",
                        "--pool",
                        pool_path,
                        "--report-dir",
                        str(tmp_path),
                        "--wid",
                        str(100 + wid),
                        "--seed",
                        str(seed + wid),
                        "--duration",
                        "2",
                        "--chains",
                        str(chains),
                        "--singles",
                        str(singles),
                        "--summary",
                        summary,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                ),
                summary,
            )
        )
    for p, summary in procs:
        _, err = p.communicate(timeout=60)
        with open(summary) as f:
            s = json.load(f)
        assert p.returncode == 0 and s["ok"], s.get("traceback", err)
        assert s["mismatches"] == 0, s["first_mismatches"]
        assert s["ops"] > 100
    with hosts.verifier() as pool:
        assert tu.pool_check_problems(pool.check()) == []
    hosts.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chaos_kill9(pool_path, tmp_path):
    chaos_kill9(pool_path, tmp_path, OneHost())


@pytest.mark.timeout(60)
def test_killed_processes_free_their_node_slots(pool_path):
    """max_nodes=3: processes that attach and die by kill -9 must not use up the node table."""
    import textwrap

    with cxlkv.Pool.create(pool_path, 16 * MiB, chunk_size=1 * MiB, max_nodes=3) as pool:
        pool.namespace(tu.shared_layout())
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {tu.here()!r})
        import cxlkv, cxlkv_testutil as tu
        pool = cxlkv.Pool.open({pool_path!r})
        ns = pool.namespace(tu.shared_layout())
        k = tu.make_key("slot", pool.node_id)
        ns.put(k, tu.key_payload(k, ns.block_bytes))
        lease = ns.acquire([k])
        print("ready", flush=True)
        time.sleep(120)
    """)
    for _round in range(3):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(3)
        ]
        for p in procs:
            line = p.stdout.readline().strip()
            assert line == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        # the table is full of live nodes now
        with pytest.raises(cxlkv.NodeTableFullError, match="node"):
            cxlkv.Pool.open(pool_path)
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    with cxlkv.Pool.open(pool_path) as pool:
        report = pool.check()
        assert tu.pool_check_problems(report) == [], report
        assert report.get("orphan_pins", 0) == 0


@pytest.mark.timeout(60)
def test_concurrent_open_or_create_and_namespace(pool_path, tmp_path):
    """Processes racing to create the same pool and namespace all end up in one pool and one
    namespace."""
    import textwrap

    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {tu.here()!r})
        import cxlkv, cxlkv_testutil as tu
        start = float(sys.argv[1])
        while time.time() < start:
            pass
        with cxlkv.Pool.open_or_create({pool_path!r}, 32 << 20, chunk_size=1 << 20) as pool:
            ns = pool.namespace(tu.shared_layout())
            k = tu.make_key("race", pool.node_id)
            assert ns.put(k, tu.key_payload(k, ns.block_bytes))
            print(pool.uuid, ns.id, flush=True)
    """)
    start = time.time() + 1.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out.split())
    assert len({o[0] for o in outs}) == 1, f"several pools were created: {outs}"
    assert len({o[1] for o in outs}) == 1, f"several namespaces were created: {outs}"
    leftovers = [
        n for n in os.listdir(os.path.dirname(pool_path)) if n.startswith(os.path.basename(pool_path) + ".")
    ]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    with cxlkv.Pool.open(pool_path) as pool:
        assert len(pool.namespaces()) == 1
        assert tu.pool_check_problems(pool.check()) == []


@pytest.mark.timeout(120)
def test_creator_killed_mid_create(pool_path):
    """kill -9 of the creating process at random moments: the path either does not exist or holds
    a complete pool; a half-initialized pool is never visible, and open_or_create works after."""
    import textwrap

    code = textwrap.dedent(f"""
        import cxlkv
        print("go", flush=True)
        cxlkv.Pool.create({pool_path!r}, 256 << 20, chunk_size=4 << 20).close()
        print("done", flush=True)
    """)
    rng = random.Random(tu.random_test_seed("creator kill -9"))
    for _i in range(8):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "go"
        time.sleep(rng.uniform(0, CREATE_KILL_WINDOW_S))
        p.kill()
        p.wait()
        # temporaries of the dead creator (<path>.init-*) may remain; the pool path itself is
        # either absent or complete
        for tmp in glob.glob(pool_path + ".*"):
            os.unlink(tmp)
        if os.path.exists(pool_path):
            with cxlkv.Pool.open(pool_path) as pool:
                assert pool.size == 256 << 20
                assert tu.pool_check_problems(pool.check()) == []
            cxlkv.Pool.destroy(pool_path)
        else:
            with pytest.raises(FileNotFoundError):
                cxlkv.Pool.open(pool_path)
    with cxlkv.Pool.open_or_create(pool_path, 32 * MiB, chunk_size=1 * MiB) as pool:
        ns = pool.namespace(tu.shared_layout())
        k = tu.make_key("after-creator-kill")
        assert ns.put(k, tu.key_payload(k, ns.block_bytes))
        assert tu.pool_check_problems(pool.check()) == []
