"""Worker process for the multi-process stress test and the crash-chaos test.

Modes:

``run``     open the pool, do random operations for --duration seconds (or --ops operations),
            verify every byte read, write a JSON summary to --summary, exit 0 (3 on an
            unexpected exception, with the traceback in the summary).
``zygote``  import everything once, then serve commands on stdin so that a supervisor can start
            hundreds of workers cheaply (fork, no re-import) and kill -9 them:
              ``spawn WID SEED [NAME=VALUE...]``
                                  -> fork a worker; replies ``pid WID PID``; the worker sets the
                                     environment variables given (CXLKV_HOST_ID, CXLKV_HOST_SLOT,
                                     CXLKV_TEST_FAULT: each worker its own host), prints
                                     ``ready PID`` once attached to the pool, then runs until killed
              ``wait PID``        -> waitpid; replies ``status PID RAWSTATUS``
              ``quit``
            A child is reaped only on ``wait``, so its pid cannot be reused before the supervisor
            has killed it.

Every mismatch (wrong bytes, a pinned key that could be deleted, ...) is appended, one line each,
to ``<report_dir>/mismatch-<wid>.txt`` with an unbuffered O_APPEND write, so it survives kill -9.
Unexpected exceptions are appended to ``<report_dir>/errors-<wid>.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from typing import ClassVar

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import cxlkv
import cxlkv_testutil as tu

CHAIN_LEN = 8


# Operations per byte of a worker's progress file. Small, because most chaos workers live tens of
# milliseconds: at 256, a loaded machine's lives each did fewer and the supervisor counted 0 ops.
PROGRESS_EVERY = 16


class Reporter:
    """Appends mismatches and errors to per-worker files; each line names the worker's seed, so a
    failure can be replayed (``chaos_worker.py run --seed N``)."""

    def __init__(self, report_dir, wid, seed):
        self.report_dir = report_dir
        self.wid = wid
        self.seed = seed
        self.mismatches = 0
        self.first = []

    def _append(self, name, line):
        fd = os.open(
            os.path.join(self.report_dir, f"{name}-{self.wid}.txt"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT,
            0o644,
        )
        try:
            os.write(fd, (line.rstrip("\n") + "\n").encode())
        finally:
            os.close(fd)

    def mismatch(self, msg):
        self.mismatches += 1
        if len(self.first) < 10:
            self.first.append(msg)
        self._append("mismatch", f"pid={os.getpid()} seed={self.seed} {msg}")

    def error(self, text):
        self._append("errors", f"pid={os.getpid()} seed={self.seed}\n{text}")

    def fenced(self, text):
        self._append("fenced", f"pid={os.getpid()} seed={self.seed} {text}")


# A worker of a multihost pool that its peers judged dead (its heartbeat lapsed on a loaded
# machine, or its attach waited past half a lease for a dead host's lock ticket) is fenced: every
# call raises cxlkv.FencedError ("... open it again"). With CXLKV_CHAOS_REOPEN_FENCED=1
# (test_multihost_procs) the worker does just that and counts it in fenced-<wid>.txt; anything
# else is still an error.
MAX_REOPENS = 1000


def is_fenced(exc):
    return os.environ.get("CXLKV_CHAOS_REOPEN_FENCED") == "1" and isinstance(exc, cxlkv.FencedError)


def open_pool(path, rep):
    for _ in range(MAX_REOPENS):
        try:
            return cxlkv.Pool.open(path)
        except cxlkv.CxlkvError as e:
            if not is_fenced(e):
                raise
            rep.fenced(f"attach: {e}")
    raise RuntimeError(f"fenced at attach {MAX_REOPENS} times in a row")


def run_reopening(pool, rep, make_worker, **run_kwargs):
    """w.run() on a fresh Worker; when fenced (is_fenced: while opening the namespace or in an
    operation), opens the pool again and goes on. Returns (pool, worker, operations)."""
    ops = 0
    path = pool.path
    for attempt in range(MAX_REOPENS):
        w = None
        try:
            w = make_worker(pool, attempt)
            return pool, w, ops + w.run(**run_kwargs)
        except cxlkv.CxlkvError as e:
            if not is_fenced(e):
                raise
            rep.fenced(f"operation: {e}")
            try:
                pool.close()
            except cxlkv.CxlkvError:
                pass
            ops += sum(w.counts.values()) if w else 0
            pool = open_pool(path, rep)
    raise RuntimeError(f"fenced {MAX_REOPENS} times")


class Worker:
    def __init__(self, pool, layout, rep: Reporter, seed, num_chains, num_singles, salt=b""):
        self.pool = pool
        self.ns = pool.namespace(layout)
        self.bb = self.ns.block_bytes
        self.rep = rep
        self.rng = random.Random(seed)
        self.salt = salt
        self.chains = [tu.chain_keys(c, CHAIN_LEN) for c in range(num_chains)]
        self.singles = [tu.make_key("single", i) for i in range(num_singles)]
        self.kv_src = tu.shared_kv(32)
        self.kv_dst = tu.shared_kv(32)
        assert self.kv_src.block_bytes == self.bb, (self.kv_src.block_bytes, self.bb)
        self.out = bytearray(self.bb)
        self.counts = {}
        self.put_false = 0
        self.pinned = 0
        self.pinned_miss = 0

    # key choice: half of the traffic on a hot tenth of the key space (contention)
    def pick_chain(self):
        n = len(self.chains)
        if self.rng.random() < 0.5:
            return self.chains[self.rng.randrange(max(1, n // 10))]
        return self.chains[self.rng.randrange(n)]

    def pick_key(self):
        if self.rng.random() < 0.5:
            return self.rng.choice(self.pick_chain())
        n = len(self.singles)
        if self.rng.random() < 0.5:
            return self.singles[self.rng.randrange(max(1, n // 10))]
        return self.singles[self.rng.randrange(n)]

    def expect_padded(self, k):
        return tu.padded_payload(k, self.bb, self.salt)

    # --- operations -------------------------------------------------------------------------
    def op_put(self):
        k = self.pick_key()
        r = self.ns.put(k, tu.key_payload(k, self.bb, self.salt))
        if r is not True:
            if r is not False:
                self.rep.mismatch(f"put returned {r!r}")
            self.put_false += 1

    def op_get(self):
        k = self.pick_key()
        self.out[:] = bytes(self.bb)
        if self.ns.get(k, self.out) and bytes(self.out) != self.expect_padded(k):
            self.rep.mismatch(f"get {k.hex()}: wrong bytes")

    def op_get_bytes(self):
        k = self.pick_key()
        d = self.ns.get_bytes(k)
        if d is not None and not tu.verify_bytes(k, d, self.bb, self.salt):
            self.rep.mismatch(f"get_bytes {k.hex()}: wrong bytes (len {len(d)})")

    def op_contains(self):
        self.ns.contains(self.pick_key())

    def op_match(self):
        ch = self.pick_chain()
        n = self.ns.match_prefix(ch)
        if not 0 <= n <= len(ch):
            self.rep.mismatch(f"match_prefix returned {n}")

    def op_store(self):
        ch = self.pick_chain()
        ids = self.rng.sample(range(self.kv_src.num_blocks), len(ch))
        for k, b in zip(ch, ids, strict=True):
            self.kv_src.write_block(b, self.expect_padded(k))
        n = self.ns.store(ch, self.kv_src.arrays, ids, block_dim=1)
        if not 0 <= n <= len(ch):
            self.rep.mismatch(f"store returned {n}")

    def op_load(self):
        ch = self.pick_chain()
        ids = self.rng.sample(range(self.kv_dst.num_blocks), len(ch))
        self.kv_dst.zero()
        n = self.ns.load(ch, self.kv_dst.arrays, ids, block_dim=1)
        if not 0 <= n <= len(ch):
            self.rep.mismatch(f"load returned {n}")
            return
        for i in range(n):
            if self.kv_dst.read_block(ids[i]) != self.expect_padded(ch[i]):
                self.rep.mismatch(f"load {ch[i].hex()} (#{i} of chain): wrong bytes")

    def op_delete(self):
        self.ns.delete(self.pick_key())

    def op_acquire(self):
        ch = self.pick_chain()
        lease = self.ns.acquire(ch)
        try:
            m = len(lease)
            if not 0 <= m <= len(ch):
                self.rep.mismatch(f"acquire pinned {m}")
                return
            for i in range(m):
                self.pinned += 1
                self.out[:] = bytes(self.bb)
                if self.ns.get(ch[i], self.out):
                    if bytes(self.out) != self.expect_padded(ch[i]):
                        self.rep.mismatch(f"get of pinned {ch[i].hex()}: wrong bytes")
                else:
                    self.pinned_miss += 1
            if m and self.ns.delete(ch[m - 1]):
                self.rep.mismatch(f"delete of a key pinned by this process succeeded: {ch[m - 1].hex()}")
        finally:
            lease.release()

    OPS: ClassVar = [
        ("put", 25),
        ("get", 25),
        ("get_bytes", 8),
        ("contains", 4),
        ("match", 10),
        ("store", 8),
        ("load", 8),
        ("delete", 6),
        ("acquire", 6),
    ]

    def run(self, deadline=None, max_ops=None, progress=None):
        """progress: called with the op count every PROGRESS_EVERY operations."""
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        fns = {n: getattr(self, "op_" + n) for n in names}
        i = 0
        while True:
            if max_ops is not None and i >= max_ops:
                break
            if i and i % PROGRESS_EVERY == 0 and progress is not None:
                progress(i)
            if (i & 255) == 0 and i and deadline is not None and time.monotonic() >= deadline:
                break
            name = self.rng.choices(names, weights)[0]
            fns[name]()
            self.counts[name] = self.counts.get(name, 0) + 1
            i += 1
        return i


def worker_layout(model):
    lay = dict(tu.SHARED_LAYOUT)
    if model != "a":
        lay["model_id"] = f"test/shared-model-{model}"
    return cxlkv.KVLayout(**lay), (b"" if model == "a" else model.encode())


def run_mode(args):
    rep = Reporter(args.report_dir, args.wid, args.seed)
    summary = {"wid": args.wid, "seed": args.seed, "pid": os.getpid(), "ok": False}
    code = 0
    try:
        layout, salt = worker_layout(args.model)
        t0 = time.monotonic()
        deadline = t0 + args.duration if args.duration else None
        pool, w, n = run_reopening(
            open_pool(args.pool, rep),
            rep,
            lambda pool, k: Worker(pool, layout, rep, args.seed + k, args.chains, args.singles, salt),
            deadline=deadline,
            max_ops=args.ops,
        )
        with pool:
            summary.update(
                ops=n,
                seconds=time.monotonic() - t0,
                counts=w.counts,
                put_false=w.put_false,
                pinned=w.pinned,
                pinned_miss=w.pinned_miss,
                stats=pool.stats(),
                ok=True,
            )
    except BaseException:  # noqa: BLE001 - every failure goes to the report file
        tb = traceback.format_exc()
        rep.error(tb)
        summary["traceback"] = tb
        code = 3
    summary["mismatches"] = rep.mismatches
    summary["first_mismatches"] = rep.first
    with open(args.summary, "w") as f:
        json.dump(summary, f)
    return code


def zygote_child(args, wid, seed):
    rep = Reporter(args.report_dir, wid, seed)
    try:
        pool = open_pool(args.pool, rep)
        layout, salt = worker_layout(args.model)
        os.write(1, f"ready {os.getpid()}\n".encode())
        # every PROGRESS_EVERY operations, one byte in a progress file: the supervisor sums them up
        fd = os.open(
            os.path.join(args.report_dir, f"progress-{wid}.bin"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT,
            0o644,
        )
        pool, _, _ = run_reopening(
            pool,
            rep,
            lambda pool, k: Worker(pool, layout, rep, seed + k, args.chains, args.singles, salt),
            deadline=time.monotonic() + args.duration if args.duration else None,
            progress=lambda i: os.write(fd, b"."),
        )
        pool.close()
        return 0
    except BaseException:  # noqa: BLE001 - every failure goes to the report file
        rep.error(traceback.format_exc())
        return 3


def zygote_mode(args):
    out = sys.stdout
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "spawn":
            wid, seed = int(cmd[1]), int(cmd[2])
            env = dict(kv.split("=", 1) for kv in cmd[3:])
            out.flush()
            pid = os.fork()
            if pid == 0:
                code = 3
                try:
                    os.environ.update(env)  # read by the core at attach (host id, slot, fault)
                    code = zygote_child(args, wid, seed)
                finally:
                    os._exit(code)
            out.write(f"pid {wid} {pid}\n")
            out.flush()
        elif cmd[0] == "wait":
            pid = int(cmd[1])
            _, status = os.waitpid(pid, 0)
            out.write(f"status {pid} {status}\n")
            out.flush()
        elif cmd[0] == "quit":
            break
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "zygote"])
    ap.add_argument("--pool", required=True)
    ap.add_argument("--report-dir", required=True)
    ap.add_argument("--wid", type=int, default=0)
    ap.add_argument(
        "--seed",
        type=int,
        default=int(os.environ.get(tu.SEED_ENV) or "0", 0),
        help=f"random seed of the operations (default ${tu.SEED_ENV}, else 0)",
    )
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--ops", type=int, default=None)
    ap.add_argument("--chains", type=int, default=300)
    ap.add_argument("--singles", type=int, default=2000)
    ap.add_argument("--model", default="a")
    ap.add_argument("--summary", default=None)
    args = ap.parse_args(argv)
    if args.mode == "run":
        if args.summary is None:
            args.summary = os.path.join(args.report_dir, f"summary-{args.wid}.json")
        return run_mode(args)
    return zygote_mode(args)


if __name__ == "__main__":
    sys.exit(main())
