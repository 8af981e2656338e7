"""``pool ping`` and ``bench rpc``: the shared-memory RPC channel (src/core/rpc/rpc.h), as tools that
return results (the CLI, cxlkv/cli, parses and prints).

``pool ping NODE`` sends requests through node NODE's admin mailbox (every attached process
answers from a small responder thread) and prints each round trip with the responder's identity.

``bench rpc`` measures round trips between two real processes over the shared-memory channel and,
in the same run, over a bare cache-line bounce (``line``: the floor of any shared-memory round
trip), TCP loopback and a Unix socket, each both blocking and busy-polled
(``*_spin``; all timed in C++ with the same 64-byte echo protocol, see src/bench/rpc_bench.h), and
ZeroMQ ipc (pyzmq, timed in Python: labelled as such). The ratio is against the best of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from cxlkv.errors import CommandError, ExitCode

TRANSPORTS_CPP = ("rpc", "line", "tcp", "uds", "tcp_spin", "uds_spin")
SOCKETS = ("tcp", "uds", "tcp_spin", "uds_spin", "zmq")
ZMQ_NOTE = "pyzmq PAIR over ipc://, echo loop timed in Python (not C++): includes interpreter overhead"


class PingFailed(CommandError):
    """A ping that got no valid answer: one line, exit 1 (the CLI's "a check failed")."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=ExitCode.CHECK_FAILED)


# ---------------------------------------------------------------------------------------------
# pool ping


def ping(pool_path: str, node: int, count: int = 3, timeout_ms: int = 1000) -> list[dict]:
    """``count`` round trips to ``node``; raises PingFailed on the first that gets no answer."""
    import cxlkv

    out = []
    with cxlkv.Pool.open(pool_path) as pool:  # attached: our node id is our request slot
        if pool.node_id == node:  # the slot was free (its dead owner reaped by our open): we took it
            raise PingFailed(
                f"node {node} is not attached (its slot was free; this ping's own attachment took it)"
            )
        for _ in range(count):
            r = dict(pool._core.ping(node, timeout_ms))
            if r["outcome"] != "answered":
                raise PingFailed(r["detail"])
            out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# bench rpc: ZeroMQ half (the C++ transports are in the core)


def _zmq_serve(addr: str, cpu: int) -> None:
    import zmq

    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.bind(addr)
    s.send(b"ready")
    while True:
        m = s.recv()
        if m == b"stop":
            break
        s.send(m, copy=False)
    s.close(linger=0)
    ctx.term()


def _frame(seq: int) -> bytes:
    # 64 bytes like the C++ transports: seq, op, len, then 48 bytes that depend on seq
    head = seq.to_bytes(8, "little") + (1).to_bytes(4, "little") + (48).to_bytes(4, "little")
    return head + bytes((seq * 131 + k * 7 + 0x5A) & 0xFF for k in range(48))


def bench_zmq(iterations: int, warmup: int, depth: int, batches: int, cpus: tuple[int, int]) -> dict:
    """Depth-1 p50/p99 and messages/s, and messages/s at ``depth``, over pyzmq PAIR ipc."""
    import zmq

    server_cpu, client_cpu = cpus
    with tempfile.TemporaryDirectory(prefix="cxlkv-zmq-") as d:
        addr = f"ipc://{d}/echo"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from cxlkv.tools.rpc import _zmq_serve; _zmq_serve({addr!r}, {server_cpu})",
            ]
        )
        ctx = zmq.Context()
        s = ctx.socket(zmq.PAIR)
        s.setsockopt(zmq.RCVTIMEO, 30000)
        saved = os.sched_getaffinity(0)
        try:
            s.connect(addr)
            if s.recv() != b"ready":
                raise RuntimeError("zmq server did not start")
            if client_cpu >= 0:
                os.sched_setaffinity(0, {client_cpu})
            frames = [_frame(i) for i in range(depth)]  # payload built outside the timed loops

            def one(f: bytes) -> None:
                s.send(f)
                if s.recv() != f:
                    raise RuntimeError("zmq: wrong echo")

            for i in range(warmup):
                one(frames[i % depth])
            lat = []
            clock = time.perf_counter_ns
            start = clock()
            for i in range(iterations):
                f = frames[i % depth]
                t0 = clock()
                one(f)
                lat.append(clock() - t0)
            qd1_s = (clock() - start) / 1e9
            for _ in range(min(warmup, batches)):
                for f in frames:
                    s.send(f)
                for f in frames:
                    if s.recv() != f:
                        raise RuntimeError("zmq: wrong echo")
            blat = []
            start = clock()
            for _ in range(batches):
                t0 = clock()
                for f in frames:
                    s.send(f)
                for f in frames:
                    if s.recv() != f:
                        raise RuntimeError("zmq: wrong echo")
                blat.append(clock() - t0)
            deep_s = (clock() - start) / 1e9
            s.send(b"stop")
        finally:
            os.sched_setaffinity(0, saved)
            s.close(linger=0)
            ctx.term()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    lat.sort()
    blat.sort()
    return {
        "p50_ns": float(lat[len(lat) // 2]),
        "p99_ns": float(lat[min(len(lat) - 1, len(lat) * 99 // 100)]),
        "msgs_per_s_qd1": iterations / qd1_s,
        "batch_p50_ns": float(blat[len(blat) // 2]),
        "msgs_per_s_deep": batches * depth / deep_s,
    }


def bench_rpc(
    iterations: int = 20000,
    warmup: int = 2000,
    depth: int = 128,
    batches: int = 1000,
    backend: str = "coherent",
    pin: bool = True,
    directory: str = "/dev/shm",
) -> dict:
    """Every transport in one run; flat keys ``<transport>_<metric>`` plus the socket/rpc ratio."""
    from cxlkv import _core

    out: dict = {
        "depth": depth,
        "iterations": iterations,
        "batches": batches,
        "rpc_backend": backend,
        "message_bytes": 64,
        "payload_bytes": 48,
        "cpus_available": len(os.sched_getaffinity(0)),
    }
    cpus = (-1, -1)
    for t in TRANSPORTS_CPP:
        r = dict(
            _core.bench_rpc(
                t,
                iterations=iterations,
                warmup=warmup,
                depth=depth,
                batches=batches,
                backend=backend,
                dir=directory,
                pin=pin,
            )
        )
        cpus = (int(r["server_cpu"]), int(r["client_cpu"]))
        for k in ("p50_ns", "p99_ns", "msgs_per_s_qd1", "batch_p50_ns", "msgs_per_s_deep"):
            out[f"{t}_{k}"] = r[k]
    out["server_cpu"], out["client_cpu"] = cpus
    try:
        z = bench_zmq(iterations, warmup, depth, batches, cpus)
        for k, v in z.items():
            out[f"zmq_{k}"] = v
        out["zmq_note"] = ZMQ_NOTE
    except ImportError as e:
        for k in ("p50_ns", "p99_ns", "msgs_per_s_qd1", "batch_p50_ns", "msgs_per_s_deep"):
            out[f"zmq_{k}"] = None
        out["zmq_note"] = f"pyzmq not importable ({e}); install the test extras"
    socket_p50 = {s: out[f"{s}_p50_ns"] for s in SOCKETS if out.get(f"{s}_p50_ns")}
    best = min(socket_p50, key=socket_p50.get)
    out["best_socket"] = best
    # line: the hardware floor of any shared-memory round trip (one word bounced between two lines)
    out["rpc_p50_over_line_p50"] = out["rpc_p50_ns"] / out["line_p50_ns"] if out["line_p50_ns"] else None
    out["best_socket_p50_over_rpc_p50"] = socket_p50[best] / out["rpc_p50_ns"] if out["rpc_p50_ns"] else None
    out["method"] = (
        "two processes (forked echo server), pinned to server_cpu/client_cpu when two CPUs are "
        "allowed; rpc/tcp/uds timed in C++, zmq in Python; depth-1 round trips timed one by one; "
        "deep: `depth` requests posted at once, then all answers awaited"
    )
    return out
