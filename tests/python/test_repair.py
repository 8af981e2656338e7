"""`pool check --repair` (issue 14 item 6): what nobody else ever releases, released on evidence.

Real processes and a real pool file throughout:

* a co-tenant writes FREE over the state word of a live node that is inside a put (stopped there
  by the test fault trap, CXLKV_TEST_FAULT=insert.copied:stop): the node is fenced and its
  WRITING entry has no owner. It is released by `pool check --repair` once the fenced process has
  closed the pool (never while it may still finish the put), by the next reclaim pass, and when
  the node slot was attached again by a new process (the entry's block names the old epoch);
* a block condemned by a checksum failure while another process pinned it keeps its space after
  every process exited: `pool check` says so truthfully, `--repair` (or the reclaim of a killed
  pinning process) frees it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import MiB

CXLKV = shutil.which("cxlkv", path=os.path.dirname(sys.executable))
BB = 4096
LAYOUT = dict(model_id="repair", dtype="uint8", block_bytes=BB)
KEY = tu.make_key("repair", 1)

# Attaches, says its node id, and on "go" puts KEY; with CXLKV_TEST_FAULT it stops inside the put.
WRITER = f"""
import sys, cxlkv
pool = cxlkv.Pool.open(sys.argv[1]); ns = pool.namespace(cxlkv.KVLayout(**{LAYOUT!r}))
print(pool.node_id, flush=True)
sys.stdin.readline()
print(int(ns.put({KEY!r}, bytes([5]) * {BB})), flush=True)
sys.stdin.readline()
pool.close()
"""

# Attaches, pins KEY with a lease, says so, then on a line closes cleanly (or waits to be killed).
PINNER = f"""
import sys, cxlkv
pool = cxlkv.Pool.open(sys.argv[1]); ns = pool.namespace(cxlkv.KVLayout(**{LAYOUT!r}))
lease = ns.acquire([{KEY!r}])
print(len(lease), flush=True)
sys.stdin.readline()
pool.close()
"""


def _spawn(code: str, path: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _cli_check(path: str, *extra: str) -> tuple[int, dict]:
    r = subprocess.run(
        [CXLKV, "pool", "check", path, "--json", *extra], capture_output=True, text=True, timeout=60
    )
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _stopped_writer(path: str) -> tuple[subprocess.Popen, int]:
    """A writer process stopped inside put(KEY): its entry WRITING, its block claimed and filled."""
    w = _spawn(WRITER, path, CXLKV_TEST_FAULT="insert.copied:stop")
    node = int(w.stdout.readline())
    w.stdin.write("go\n")
    w.stdin.flush()
    _, status = os.waitpid(w.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return w, node


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()  # SIGKILL ends a stopped process too


def _write_free_over(path: str, node: int) -> None:
    """The co-tenant: FREE (epoch kept) over node `node`'s state word."""
    off = tu.read_header(path)["node_table_off"] + (node - 1) * 128
    with open(path, "r+b") as f:
        f.seek(off)
        (word,) = struct.unpack("<Q", f.read(8))
        f.seek(off)
        f.write(struct.pack("<Q", word & 0xFFFFFF))


def _stuck(report: dict) -> list[str]:
    return [e for e in report["errors"] if "stuck in WRITING" in e]


@pytest.fixture
def pool_with_ns(make_pool):
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    return pool, pool.namespace(cxlkv.KVLayout(**LAYOUT))


def test_entry_of_a_fenced_writer_released_once_its_process_closed(pool_with_ns, pool_path):
    _pool, ns = pool_with_ns
    w, node = _stopped_writer(pool_path)
    try:
        # Alive (its process holds its lock): a WRITING entry of a live writer is never touched.
        code, rep = _cli_check(pool_path, "--repair")
        assert code == 0 and rep["repaired"] == [] and rep["blocks"]["in_flight"] == 1, rep

        _write_free_over(pool_path, node)
        # Fenced, but its process still has the pool open: it might finish the put; not released.
        code, rep = _cli_check(pool_path, "--repair")
        assert code == 1 and rep["repaired"] == [], rep
        assert len(_stuck(rep)) == 1 and "still has the pool open" in _stuck(rep)[0], rep
    finally:
        _kill(w)
    code, rep = _cli_check(pool_path)  # without --repair: reported, with the way out
    assert code == 1 and rep["repaired"] == [], rep
    assert rep["stuck_entries"] == 1 and "--repair" in _stuck(rep)[0], rep
    code, rep = _cli_check(pool_path, "--repair")
    assert code == 0, rep
    assert len(rep["repaired"]) == 1 and f"node {node} is not attached" in rep["repaired"][0], rep
    code, rep = _cli_check(pool_path)
    assert code == 0 and tu.pool_check_problems(rep) == [], rep
    assert rep["blocks"]["free"] == rep["blocks"]["capacity"], rep  # its block is free again
    assert ns.put(KEY, bytes([6]) * BB) and ns.get_bytes(KEY) == bytes([6]) * BB


def test_entry_of_a_fenced_writer_released_by_the_next_reclaim(pool_with_ns, pool_path):
    """No `check --repair`: the reclaim of some other dead node releases it too (same scan)."""
    pool, _ns = pool_with_ns
    w, node = _stopped_writer(pool_path)
    victim = _spawn(PINNER, pool_path)  # another node, which then dies: a reclaim pass will run
    assert victim.stdout.readline().strip() == "0"  # KEY is not stored: nothing pinned
    _write_free_over(pool_path, node)
    _kill(w)
    _kill(victim)
    assert pool.reap_dead_nodes() == 1
    rep = pool.check()
    assert tu.pool_check_problems(rep) == [] and rep["repaired"] == [], rep


def test_entry_of_a_gone_incarnation_released_after_its_slot_is_reused(pool_with_ns, pool_path):
    """The node slot is attached again: the entry names only the node id, but its block records
    the epoch of the incarnation that claimed it, which is not the one attached now."""
    pool, ns = pool_with_ns
    w, node = _stopped_writer(pool_path)
    _write_free_over(pool_path, node)
    _kill(w)
    again = _spawn(WRITER, pool_path)  # takes the lowest FREE slot: the fenced writer's
    try:
        assert int(again.stdout.readline()) == node
        code, rep = _cli_check(pool_path, "--repair")
        assert code == 0 and len(rep["repaired"]) == 1, rep
        assert "incarnation that claimed it is gone" in rep["repaired"][0], rep
        # The new incarnation works normally (it stores the key the old one never finished).
        again.stdin.write("go\n")
        again.stdin.flush()
        assert again.stdout.readline().strip() == "1"
        again.stdin.write("close\n")
        again.stdin.flush()
        assert again.wait(timeout=30) == 0
    finally:
        if again.poll() is None:
            _kill(again)
    assert ns.get_bytes(KEY) == bytes([5]) * BB
    assert tu.pool_check_problems(pool.check()) == []


def _condemn_while_pinned(pool_path: str, pool, ns) -> subprocess.Popen:
    """KEY stored, pinned by another process, corrupted at rest, then read here: condemned."""
    assert ns.put(KEY, bytes([5]) * BB)
    pinner = _spawn(PINNER, pool_path)
    assert pinner.stdout.readline().strip() == "1"
    info = tu.read_header(pool_path)
    stride = (info["chunk_bytes"] // 1024 * 8 + 4095) // 4096 * 4096 + info["chunk_bytes"]
    with open(pool_path, "rb") as f:
        for s in range(info["index_slots"]):
            f.seek(info["index_off"] + 64 * s)
            e = f.read(64)
            if e[7] == 2 and e[8:40] == KEY:  # READY
                chunk, block = struct.unpack_from("<IH", e, 44)
                break
        else:
            raise AssertionError("KEY not found READY")
    off = info["arena_off"] + chunk * stride + (stride - info["chunk_bytes"]) + block * BB
    tu.patch_file(pool_path, off + 7, b"\xff")
    assert ns.get_bytes(KEY) is None  # checksum failure: condemned, still pinned by the pinner
    assert pool.stats()["condemned"] == 1
    return pinner


def test_condemned_block_with_no_pin_left_is_freed_by_repair(make_pool, pool_path):
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    ns = pool.namespace(cxlkv.KVLayout(**LAYOUT))
    pinner = _condemn_while_pinned(pool_path, pool, ns)
    code, rep = _cli_check(pool_path)
    assert rep["blocks"]["condemned"] == 1 and any(
        "wait for their readers' pins" in x for x in rep["warnings"]
    )
    pinner.stdin.write("close\n")
    pinner.stdin.flush()
    assert pinner.wait(timeout=30) == 0
    pool.close()  # every process has exited now

    code, rep = _cli_check(pool_path)
    assert code == 0 and rep["blocks"]["condemned"] == 1, rep
    assert not any("wait for their readers' pins" in x for x in rep["warnings"]), rep  # no pin is left
    assert any("no pin holds them" in x for x in rep["warnings"]), rep
    code, rep = _cli_check(pool_path, "--repair")
    assert code == 0 and len(rep["repaired"]) == 1 and "condemned" in rep["repaired"][0], rep
    assert rep["blocks"]["condemned"] == 0 and rep["blocks"]["free"] == rep["blocks"]["capacity"], rep
    assert rep["warnings"] == [], rep


def test_condemned_block_freed_by_the_reclaim_of_its_killed_pinner(make_pool, pool_path):
    pool = make_pool(size=16 * MiB, chunk_size=1 * MiB)
    ns = pool.namespace(cxlkv.KVLayout(**LAYOUT))
    pinner = _condemn_while_pinned(pool_path, pool, ns)
    _kill(pinner)  # its pins stay in its dead slot until a reclaim clears them
    pool.close()
    code, rep = _cli_check(pool_path)  # no --repair: the reclaim at the check's open frees it
    assert code == 0 and rep["reclaimed_nodes"] == 1, rep
    assert rep["blocks"]["condemned"] == 0 and rep["warnings"] == [], rep


def test_cli_check_repair_prints_each_repair(pool_with_ns, pool_path):
    _pool_and_ns = pool_with_ns  # the pool, attached: the writer is not node 1
    w, node = _stopped_writer(pool_path)
    _write_free_over(pool_path, node)
    _kill(w)
    r = subprocess.run(
        [CXLKV, "pool", "check", pool_path, "--repair"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "repaired:" in r.stdout and "stuck in WRITING" in r.stdout, r.stdout
