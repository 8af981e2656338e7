"""`pool check --repair` (issue 14 item 6): what nobody else ever releases, released on evidence.

Real processes and a real pool file throughout: a block condemned by a checksum failure while
another process pinned it keeps its space after every process exited: `pool check` says so
truthfully, `--repair` (or the reclaim of a killed pinning process) frees it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import cxlkv
import cxlkv_testutil as tu
from conftest import MiB

CXLKV = shutil.which("cxlkv", path=os.path.dirname(sys.executable))
BB = 4096
LAYOUT = dict(model_id="repair", dtype="uint8", block_bytes=BB)
KEY = tu.make_key("repair", 1)

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


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()  # SIGKILL ends a stopped process too


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
