"""`cxlkv pool ping` against live, stopped, killed and absent nodes, and a smoke run of
`cxlkv bench rpc --json` (keys only: no timing assertions). Pools follow CXLKV_TEST_BACKEND."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cxlkv.cli import main

MiB = 1 << 20

# A process attached to the pool that prints its node id and waits to be killed.
ATTACHED = textwrap.dedent("""
    import sys, time, cxlkv
    pool = cxlkv.Pool.open(sys.argv[1])
    print(pool.node_id, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def attached(make_pool, pool_path):
    make_pool(size=16 * MiB).close()
    proc = subprocess.Popen([sys.executable, "-c", ATTACHED, pool_path], stdout=subprocess.PIPE, text=True)
    node = int(proc.stdout.readline())
    yield proc, node
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def _wait_stopped(pid: int) -> None:
    # SIGSTOP is delivered asynchronously: a hot responder could still answer right after kill().
    for _ in range(1000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def test_ping_live_process_reports_its_identity(attached, pool_path, capsys):
    proc, node = attached
    assert main(["pool", "ping", str(node), pool_path, "--count", "3", "--json", "--timeout-ms", "5000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["node"] == node and out["pid"] == proc.pid and out["count"] == 3
    assert len(out["rtt_ns"]) == 3 and all(r > 0 for r in out["rtt_ns"])
    assert main(["pool", "ping", str(node), pool_path, "--count", "1"]) == 0
    assert f"reply from node {node} (pid {proc.pid}" in capsys.readouterr().out


def test_ping_stopped_process_times_out_then_answers_again(attached, pool_path, capsys):
    proc, node = attached
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)
    try:
        assert main(["pool", "ping", str(node), pool_path, "--count", "1", "--timeout-ms", "200"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"node {node} did not answer within 200 ms" in err
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert main(["pool", "ping", str(node), pool_path, "--count", "1", "--timeout-ms", "5000"]) == 0


def test_ping_killed_and_absent_nodes_fail_with_one_line(attached, pool_path, capsys):
    proc, node = attached
    proc.kill()
    proc.wait()
    # The pinger's open reaps the dead node (same kernel): its slot is free, nobody is there.
    assert main(["pool", "ping", str(node), pool_path, "--count", "1", "--timeout-ms", "200"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"node {node} is not attached" in err
    assert main(["pool", "ping", "60", pool_path, "--count", "1", "--timeout-ms", "200"]) == 1
    assert "node 60 is not attached" in capsys.readouterr().err
    assert main(["pool", "ping", "9999", pool_path]) == 2  # out of range: bad input
    assert main(["pool", "check", pool_path, "--json"]) == 0  # the mailbox format passes check


def test_bench_rpc_json_smoke(capsys, tmp_path):
    argv = [
        "bench",
        "rpc",
        "--json",
        "--iterations",
        "50",
        "--warmup",
        "5",
        "--depth",
        "4",
        "--batches",
        "10",
        "--dir",
        str(tmp_path),
    ]
    if os.environ.get("CXLKV_TEST_BACKEND") == "flush":
        argv += ["--backend", "flush"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for t in ("rpc", "tcp", "uds", "tcp_spin", "uds_spin", "zmq"):
        for k in ("p50_ns", "p99_ns", "msgs_per_s_qd1", "msgs_per_s_deep"):
            assert f"{t}_{k}" in out
    for t in ("rpc", "line", "tcp", "uds", "tcp_spin", "uds_spin"):
        assert out[f"{t}_p50_ns"] > 0
    assert out["best_socket"] in ("tcp", "uds", "tcp_spin", "uds_spin", "zmq")
    assert out["best_socket_p50_over_rpc_p50"] > 0 and out["rpc_p50_over_line_p50"] > 0
    assert "zmq_note" in out
