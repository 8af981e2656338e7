"""Quotas (docs/ARCHITECTURE.md "Quotas"): a tenant's or a namespace's cap on pool bytes, kept in the
pool. Real processes on every backend: a flooding tenant keeps every other tenant's blocks; a put
over its quota with nothing of its own to evict fails cleanly and is counted; quotas survive a
reopen; forged rows and counters are treated safely and reported by `pool check`."""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import KiB, MiB, small_layout

WORKER = os.path.join(tu.here(), "quota_worker.py")
BACKENDS = ["coherent", "flush", "multihost"]
QUOTA_TABLE_OFF = 4096 + 1024  # format/quota.h: kQuotaTableOff
CHARGED_OFF = 64 + 24 * 8  # NodeAreaFixed.quota_charged (format.h)


def run_worker(pool_path, tenant, salt, chains, *, verify=False, depth=4):
    cmd = [sys.executable, WORKER, "--pool", pool_path, "--tenant", tenant, "--salt", salt]
    cmd += ["--chains", str(chains), "--depth", str(depth)] + (["--verify"] if verify else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tu.here(), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def row_of(pool, **subject):
    for q in pool.quotas():
        if all(q.get(k) == v for k, v in subject.items()):
            return q
    raise AssertionError(f"no quota row for {subject}: {pool.quotas()}")


def assert_usage_recounts(pool):
    r = pool.check()
    assert r["ok"], r["errors"]
    assert not [w for w in r["warnings"] if "quota" in w], r["warnings"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_flooding_tenant_keeps_other_tenants_blocks(make_pool, pool_path, backend):
    pool = make_pool(size=32 * MiB, backend=backend)
    pool.namespace(small_layout(), tenant="flood")  # rows exist before the quota names them
    pool.set_quota(tenant="flood", max_fraction=0.25)
    limit = row_of(pool, tenant="flood")["limit_bytes"]
    assert 0 < limit <= 8 * MiB
    for tenant in ("team-a", "team-b"):
        assert run_worker(pool_path, tenant, tenant, 100)["stored"] == 400
    # The flood: ~40 MiB of new prefixes into a 32 MiB pool, from its own process.
    flood = run_worker(pool_path, "flood", "flood", 2500)
    assert flood["stored"] == 10000 and flood["refused"] == 0, flood
    assert flood["quota_evictions"] > 0
    for tenant in ("team-a", "team-b"):  # every block of the others is still there: their hit rate is 100%
        assert run_worker(pool_path, tenant, tenant, 100, verify=True)["found"] == 400
    q = row_of(pool, tenant="flood")
    assert q["usage_bytes"] <= limit
    assert row_of(pool, tenant="team-a")["usage_bytes"] == 400 * 4 * KiB
    assert_usage_recounts(pool)


def test_without_a_quota_the_flood_takes_the_others_blocks(make_pool, pool_path):
    """The baseline that makes the test above able to fail: no quota, the same flood."""
    make_pool(size=32 * MiB)
    run_worker(pool_path, "team-a", "team-a", 100)
    run_worker(pool_path, "flood", "flood", 2500)
    assert run_worker(pool_path, "team-a", "team-a", 100, verify=True)["found"] < 400


@pytest.mark.parametrize("backend", BACKENDS)
def test_over_quota_with_nothing_to_evict_fails_cleanly(make_pool, pool_path, backend):
    pool = make_pool(size=16 * MiB, backend=backend)
    pool.namespace(small_layout(), tenant="tiny")
    pool.set_quota(tenant="tiny", max_bytes=1)  # smaller than one block: nothing can ever fit
    r = run_worker(pool_path, "tiny", "tiny", 5)
    assert r == {**r, "stored": 0, "refused": 20}
    assert r["puts_over_quota"] == 20
    assert row_of(pool, tenant="tiny")["usage_bytes"] == 0
    assert_usage_recounts(pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_blocks_are_never_evicted_for_a_quota(make_pool, backend):
    pool = make_pool(size=16 * MiB, backend=backend)
    ns = pool.namespace(small_layout(), tenant="t")
    keys = [tu.make_key("pinned", i) for i in range(4)]
    for k in keys:
        assert ns.put(k, k * 128)
    with ns.acquire(keys) as lease:
        assert len(lease) == 4
        pool.set_quota(tenant="t", max_bytes=4 * 4 * KiB)  # full: a fifth block needs an eviction
        before = pool.stats()["puts_over_quota"]
        assert not ns.put(tu.make_key("fifth"), b"x" * 4096)
        assert pool.stats()["puts_over_quota"] == before + 1
        assert all(ns.contains(k) for k in keys)
    assert ns.put(tu.make_key("fifth"), b"x" * 4096)  # unpinned now: the oldest one makes room
    assert sum(ns.contains(k) for k in keys) == 3
    assert_usage_recounts(pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_namespace_quota_evicts_only_its_own_namespace(make_pool, backend):
    pool = make_pool(size=32 * MiB, backend=backend)
    a = pool.namespace(small_layout(model_id="m/a"))
    b = pool.namespace(small_layout(model_id="m/b"))
    pool.set_quota(namespace=a.name, max_bytes=64 * 4 * KiB)
    b_keys = [tu.make_key("b", i) for i in range(200)]
    for k in b_keys:
        assert b.put(k, k)
    for i in range(1000):
        assert a.put(tu.make_key("a", i), b"a" * 4096, i % 4)
    assert row_of(pool, kind="namespace")["usage_bytes"] <= 64 * 4 * KiB
    assert all(b.contains(k) for k in b_keys)
    assert pool.stats()["quota_evictions"] >= 1000 - 64
    assert_usage_recounts(pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quota_survives_reopen(make_pool, pool_path, backend):
    pool = make_pool(size=16 * MiB, backend=backend)
    ns = pool.namespace(small_layout(), tenant="keep")
    pool.set_quota(tenant="keep", max_bytes=10 * 4 * KiB)
    for i in range(30):
        assert ns.put(tu.make_key("keep", i), b"k" * 4096)
    pool.close()
    with cxlkv.Pool.open(pool_path) as again:
        q = row_of(again, tenant="keep")
        assert q["limit_bytes"] == 10 * 4 * KiB and q["usage_bytes"] == 10 * 4 * KiB
        ns = again.namespace(small_layout(), tenant="keep")
        for i in range(30, 40):
            assert ns.put(tu.make_key("keep", i), b"k" * 4096)
        assert row_of(again, tenant="keep")["usage_bytes"] == 10 * 4 * KiB
        cleared = again.clear_quota(tenant="keep")
        assert cleared["limit_bytes"] == 0 and cleared["usage_bytes"] == 10 * 4 * KiB
        assert_usage_recounts(again)


def test_tenant_is_a_label_not_part_of_the_key(small_ns):
    """Identity follows the bytes: the same key written by another tenant is the same block, charged
    to its first writer only."""
    pool, _ = small_ns
    a = pool.namespace(small_layout(), tenant="a")
    b = pool.namespace(small_layout(), tenant="b")
    k = tu.make_key("shared")
    assert a.put(k, b"s" * 4096)
    assert b.contains(k) and bytes(b.get_bytes(k)) == b"s" * 4096
    assert b.put(k, b"s" * 4096)  # present: not stored again, not charged to b
    assert row_of(pool, tenant="a")["usage_bytes"] == 4 * KiB
    assert row_of(pool, tenant="b")["usage_bytes"] == 0
    assert a.tenant == "a" and pool.namespace(small_layout()).tenant is None


def test_bad_arguments(small_ns):
    pool, ns = small_ns
    with pytest.raises(ValueError):
        pool.set_quota(tenant="x", namespace=ns.name, max_bytes=1)
    with pytest.raises(ValueError):
        pool.set_quota(namespace="no-such-namespace", max_bytes=1)
    with pytest.raises(ValueError):
        pool.namespace(small_layout(), tenant="x" * 40)
    with pytest.raises(ValueError):
        pool.namespace(small_layout(), tenant="bad\nname")
    with pytest.raises(ValueError):  # the core's uint64 (was nanobind's TypeError listing signatures)
        pool.set_quota(tenant="x", max_bytes=2**64)
    with pytest.raises(TypeError, match="max_bytes must be an integer"):
        pool.set_quota(tenant="x", max_bytes=1.5)
    with pytest.raises(ValueError):
        pool.set_quota(tenant="x", max_fraction=float("nan"))


def test_tenant_name_not_utf8_is_unreadable_not_a_crash(small_ns, pool_path):
    """A row whose checksum matches but whose name is not UTF-8 (a forger's, or a C++ caller's):
    unreadable and reported, never a UnicodeDecodeError out of quotas(), `pool info` or `pool quota`."""
    import xxhash

    pool, _ = small_ns
    pool.namespace(small_layout(), tenant="a")
    row = row_of(pool, tenant="a")["row"]
    body = struct.pack("<IIQII", 1, 0, 0, 0, 0) + b"\xff\xfe".ljust(32, b"\0")  # QuotaRow, a tenant
    _poke(
        pool_path, QUOTA_TABLE_OFF + (row - 1) * 64, body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    )
    pool._core.quotas()  # the cache refreshes within 100 ms; this read is uncached
    q = next(q for q in pool.quotas() if q["row"] == row)
    assert not q["readable"]
    assert any(f"quota row {row}" in e for e in pool.check()["errors"])
    for cmd in ("quota", "info"):
        p = subprocess.run(
            [sys.executable, "-m", "cxlkv", "pool", cmd, pool_path], capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr


def test_clearing_a_subject_without_a_row_takes_none(small_ns):
    """Rows are never freed: clearing a tenant that never had one (a typo) must not use one up."""
    pool, _ = small_ns
    before = len(pool.quotas())
    cleared = pool.clear_quota(tenant="never-seen")
    assert cleared["row"] == 0 and cleared["limit_bytes"] == 0
    assert len(pool.quotas()) == before


def test_quota_table_full_is_its_own_error(small_ns):
    pool, _ = small_ns
    for i in range(48):
        pool.set_quota(tenant=f"t{i}", max_bytes=MiB)
    with pytest.raises(cxlkv.QuotaTableFullError):
        pool.namespace(small_layout(), tenant="one-too-many")


def _poke(path, offset, data):
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[offset : offset + len(data)] = data


def test_forged_quota_row_is_unreadable_never_followed(small_ns, pool_path):
    pool, _ = small_ns
    pool.namespace(small_layout(), tenant="victim")
    pool.set_quota(tenant="victim", max_bytes=1)
    row = row_of(pool, tenant="victim")["row"]
    # A stray write into the row: its checksum no longer matches, so no limit comes from it.
    _poke(pool_path, QUOTA_TABLE_OFF + (row - 1) * 64 + 8, struct.pack("<Q", 2**63))
    pool._core.quotas()  # the cache refreshes within 100 ms; this read is uncached
    q = next(q for q in pool.quotas() if q["row"] == row)
    assert not q["readable"]
    r = pool.check()
    assert not r["ok"] and any("quota row" in e for e in r["errors"])


def test_row_with_zeroed_kind_is_not_reused_for_a_new_tenant(small_ns, pool_path):
    """A stray write zeroing a used row's kind: the row stays its tenant's (unreadable, reported),
    never handed to a new tenant, who would inherit its usage and evict its blocks for its quota."""
    pool, _ = small_ns
    a = pool.namespace(small_layout(), tenant="a")
    for i in range(4):
        assert a.put(tu.make_key("a", i), b"a" * 4096)
    row = row_of(pool, tenant="a")["row"]
    _poke(pool_path, QUOTA_TABLE_OFF + (row - 1) * 64, b"\0" * 8)  # kind and ns_id: zero
    pool._core.quotas()  # the cache refreshes within 100 ms; this read is uncached
    q = next(q for q in pool.quotas() if q["row"] == row)
    assert not q["readable"]
    r = pool.check()
    assert not r["ok"] and any(f"quota row {row}" in e for e in r["errors"])
    b = pool.namespace(small_layout(), tenant="b")
    assert row_of(pool, tenant="b")["row"] != row
    assert row_of(pool, tenant="b")["usage_bytes"] == 0
    pool.set_quota(tenant="b", max_bytes=4096)
    assert b.put(tu.make_key("b", 0), b"b" * 4096)
    assert all(a.contains(tu.make_key("a", i)) for i in range(4))


def test_forged_usage_counter_is_clamped_and_repaired(small_ns, pool_path):
    pool, _ = small_ns
    ns = pool.namespace(small_layout(), tenant="t")
    pool.set_quota(tenant="t", max_bytes=8 * 4 * KiB)
    for i in range(4):
        assert ns.put(tu.make_key("t", i), b"t" * 4096)
    row = row_of(pool, tenant="t")["row"]
    info = pool.info()
    node = pool.node_id
    off = info["node_area_off"] + (node - 1) * info["node_area_bytes"] + CHARGED_OFF + (row - 1) * 8
    _poke(pool_path, off, struct.pack("<Q", 2**64 - 1))  # usage "huge" (or negative: wraps)
    usage = row_of(pool, tenant="t")["usage_bytes"]
    assert usage <= info["pool_bytes"]
    ns.put(tu.make_key("t", 99), b"t" * 4096)  # bounded: evicts its own or fails, never loops
    r = pool.check()
    assert any("quota usage of tenant 't'" in w for w in r["warnings"])
    r = pool.check(repair=True)
    assert any("quota usage" in f for f in r["repaired"])
    assert_usage_recounts(pool)


def test_cli_quota(make_pool, pool_path):
    pool = make_pool()
    pool.namespace(small_layout(), tenant="team-a")
    cli = [sys.executable, "-m", "cxlkv", "pool", "quota", pool_path]
    out = subprocess.run(cli + ["--tenant", "team-a", "--max-bytes", "1MiB"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shown = subprocess.run(cli + ["--json"], capture_output=True, text=True, check=True)
    (q,) = json.loads(shown.stdout)["quotas"]
    assert q["tenant"] == "team-a" and q["limit_bytes"] == MiB
    out = subprocess.run(cli + ["--tenant", "team-a", "--clear"], capture_output=True, text=True, check=True)
    assert row_of(pool, tenant="team-a")["limit_bytes"] == 0
    bad = subprocess.run(cli + ["--max-bytes", "1MiB"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--namespace" in bad.stderr
