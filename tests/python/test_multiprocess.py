"""Multi-process stress: several processes do random put/get/match_prefix/store/load/delete/acquire
on one pool that is smaller than their working set. Every payload is derived from its key and every
read is verified; at the end the pool must check clean and hold only correct bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import KiB, MiB

WORKER = os.path.join(tu.here(), "chaos_worker.py")


def start_worker(pool_path, report_dir, wid, *, seed, duration, model="a", chains=300, singles=2000):
    summary = os.path.join(report_dir, f"summary-{wid}.json")
    cmd = [
        sys.executable,
        WORKER,
        "run",
        "--pool",
        pool_path,
        "--report-dir",
        str(report_dir),
        "--wid",
        str(wid),
        "--seed",
        str(seed + wid),
        "--duration",
        str(duration),
        "--chains",
        str(chains),
        "--singles",
        str(singles),
        "--model",
        model,
        "--summary",
        summary,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), summary


def collect(procs):
    results = []
    for p, summary in procs:
        _out, err = p.communicate(timeout=120)
        assert os.path.exists(summary), f"worker wrote no summary (rc {p.returncode}): {err}"
        with open(summary) as f:
            s = json.load(f)
        s["rc"], s["stderr"] = p.returncode, err
        results.append(s)
    return results


def verify_pool_contents(pool_path, chains, singles):
    """Every resident key of both namespaces holds exactly its payload."""
    with cxlkv.Pool.open(pool_path) as pool:
        resident = 0
        for model in ("a", "b"):
            lay = dict(tu.SHARED_LAYOUT)
            salt = b""
            if model != "a":
                lay["model_id"] = f"test/shared-model-{model}"
                salt = model.encode()
            ns = pool.namespace(cxlkv.KVLayout(**lay))
            keys = [k for c in range(chains) for k in tu.chain_keys(c, 8)]
            keys += [tu.make_key("single", i) for i in range(singles)]
            for k in keys:
                d = ns.get_bytes(k)
                if d is not None:
                    resident += 1
                    assert tu.verify_bytes(k, d, ns.block_bytes, salt), f"{model}: {k.hex()} wrong bytes"
        report = pool.check()
    return resident, report


@pytest.mark.timeout(180)
def test_multiprocess_stress(pool_path, tmp_path):
    chains, singles = 300, 2000
    working_set = (chains * 8 + singles) * 4 * KiB  # per namespace
    size = 8 * MiB
    assert size < working_set / 2
    with cxlkv.Pool.create(pool_path, size, chunk_size=256 * KiB) as pool:
        pool.namespace(tu.shared_layout())
    duration = 10.0
    seed = tu.random_test_seed("multiprocess stress")
    procs = [
        start_worker(pool_path, tmp_path, wid, seed=seed, duration=duration, chains=chains, singles=singles)
        for wid in range(4)
    ]
    # a fifth process on a second model in the same pool, same key space: aliasing would show up
    # as wrong bytes (its payloads are salted with the model)
    procs.append(
        start_worker(
            pool_path, tmp_path, 4, seed=seed, duration=duration, model="b", chains=chains, singles=singles
        )
    )
    results = collect(procs)
    print(
        "stress summary:",
        json.dumps(
            [
                {k: r.get(k) for k in ("wid", "ops", "put_false", "pinned", "pinned_miss", "mismatches")}
                | {"evictions": r.get("stats", {}).get("evictions")}
                for r in results
            ]
        ),
    )

    for r in results:
        assert r["rc"] == 0 and r["ok"], f"worker {r['wid']} failed:\n{r.get('traceback')}\n{r['stderr']}"
    total_mismatches = sum(r["mismatches"] for r in results)
    details = [m for r in results for m in r["first_mismatches"]]
    assert total_mismatches == 0, f"{total_mismatches} mismatches, e.g. {details[:5]}"
    for r in results:
        assert r["ops"] > 1000, f"worker {r['wid']} did only {r['ops']} operations"
        for op in ("put", "get", "match", "store", "load", "delete", "acquire"):
            assert r["counts"].get(op, 0) > 0, (r["wid"], op)
    # the working set does not fit: blocks were evicted, and puts still succeeded
    puts = sum(r["counts"]["put"] for r in results)
    put_false = sum(r["put_false"] for r in results)
    assert put_false <= 0.01 * puts, f"{put_false} of {puts} puts failed on an evictable pool"
    evictions = max(r["stats"].get("evictions", 0) for r in results)
    assert evictions > 0, "the pool never evicted: the test did not exercise eviction"
    pinned = sum(r["pinned"] for r in results)
    pinned_miss = sum(r["pinned_miss"] for r in results)
    assert pinned > 0
    # a pinned block can read as 'being evicted' only in the instant an evictor backs off
    assert pinned_miss <= 0.05 * pinned, f"{pinned_miss} of {pinned} pinned reads missed"

    resident, report = verify_pool_contents(pool_path, chains, singles)
    assert resident > 0
    assert tu.pool_check_problems(report) == [], report
    for name in os.listdir(tmp_path):
        assert not name.startswith(("mismatch-", "errors-")), open(tmp_path / name).read()


@pytest.mark.timeout(120)
def test_concurrent_same_key_writers(pool_path, tmp_path):
    """Many processes hammer the same few keys (put/delete/get races on one slot)."""
    with cxlkv.Pool.create(pool_path, 8 * MiB, chunk_size=256 * KiB) as pool:
        pool.namespace(tu.shared_layout())
    seed = tu.random_test_seed("same-key writers")
    procs = [
        start_worker(pool_path, tmp_path, wid, seed=seed, duration=4.0, chains=3, singles=10)
        for wid in range(4)
    ]
    results = collect(procs)
    for r in results:
        assert r["rc"] == 0 and r["ok"], r.get("traceback")
    assert sum(r["mismatches"] for r in results) == 0, [m for r in results for m in r["first_mismatches"]]
    _resident, report = verify_pool_contents(pool_path, 3, 10)
    assert tu.pool_check_problems(report) == [], report
