"""Pools striped over several files (device interleaving, docs/ARCHITECTURE.md "Device
interleaving"): create/open/put/get across 2-3 files in /dev/shm, the device list in every place a
pool path is taken (API list or comma string, $CXLKV_POOL, CLI), per-namespace placement checked
against the bytes in the device files, `pool info`, refusals of wrong device lists, a multi-process
read, and the connector's pool guard watching every device."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

import cxlkv
from conftest import SHM_DIR, KiB, MiB, _remove
from cxlkv.integrations.pool_guard import PoolGuard
from test_cli_smoke import cxlkv_cli, ok

LAYOUT = cxlkv.KVLayout(
    "stripe-test", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=64, tokens_per_block=16
)
# block bytes: 2 layers * 2 (K, V) * 16 tokens * 2 heads * 64 * 2 bytes = 16 KiB


@pytest.fixture
def devices():
    """Factory of N unique device paths under /dev/shm (removed afterwards)."""
    made: list[str] = []

    def _make(n: int) -> list[str]:
        base = os.path.join(SHM_DIR, f"cxlkv-test-{uuid.uuid4().hex}")
        paths = [f"{base}-d{k}" for k in range(n)]
        made.extend(paths)
        return paths

    yield _make
    for p in made:
        _remove(p)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def payload(i: int, n: int) -> bytes:
    return (i.to_bytes(8, "little") + b"stripes!") * (n // 16)


def read_device(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_create_open_put_get_over_three_files(devices):
    devs = devices(3)
    with cxlkv.Pool.create(devs, "24MiB", chunk_size="1MiB", stripe_size="256KiB") as pool:
        info = pool.info()
        assert info["format_version"] == "3.3" and info["stripe_bytes"] == 256 * KiB
        assert [d["path"] for d in info["devices"]] == devs
        assert sum(d["pool_bytes"] for d in info["devices"]) == info["pool_bytes"] == 24 * MiB
        for d in info["devices"]:  # each file holds its share (+ a label on devices 1..)
            assert os.path.getsize(d["path"]) == d["device_bytes"]
        ns = pool.namespace(LAYOUT)
        for i in range(300):
            assert ns.put(key(i), payload(i, ns.block_bytes))
    # The comma string names the same pool, here and through $CXLKV_POOL.
    with cxlkv.Pool.open(",".join(devs)) as pool:
        ns = pool.namespace(LAYOUT)
        assert all(ns.get_bytes(key(i)) == payload(i, ns.block_bytes) for i in range(300))
        assert pool.check()["ok"]
    os.environ["CXLKV_POOL"] = ",".join(devs)
    try:
        with cxlkv.Pool.open() as pool:
            assert pool.info()["devices"][2]["path"] == devs[2]
    finally:
        del os.environ["CXLKV_POOL"]
    cxlkv.Pool.destroy(devs)
    assert not any(os.path.exists(d) for d in devs)


def test_a_device_bound_namespace_stores_on_its_device(devices):
    devs = devices(3)
    with cxlkv.Pool.create(devs, "24MiB", chunk_size="1MiB", stripe_size="128KiB") as pool:
        bound = pool.namespace(LAYOUT, device=2)
        assert bound.device == 2
        for i in range(100):
            assert bound.put(key(i), payload(i, bound.block_bytes))
            where = bound.locate(key(i))
            assert where["device"] == 2, where
            # The payload's bytes are in device 2's file, where the stripe arithmetic says.
            assert read_device(devs[2], where["device_offset"], where["length"]) == payload(
                i, bound.block_bytes
            )
        use = pool.device_usage()
        assert use[2]["used_bytes"] >= 100 * bound.block_bytes
        assert use[0]["used_bytes"] == use[1]["used_bytes"] == 0
        # Reads find the keys from any handle; an unbound handle spreads over every device.
        anywhere = pool.namespace(LAYOUT)
        assert anywhere.device == -1 and anywhere.get_bytes(key(7)) == payload(7, anywhere.block_bytes)
        spread = set()
        for i in range(1000, 1200):
            assert anywhere.put(key(i), payload(i, anywhere.block_bytes))
            spread.add(anywhere.locate(key(i))["device"])
        assert {0, 1, 2} <= spread, spread
        with pytest.raises(ValueError, match="out of range"):
            pool.namespace(LAYOUT, device=3)
        with pytest.raises(ValueError):
            pool.namespace(LAYOUT, device=-2)
        assert pool.check()["ok"]


def test_wrong_device_lists_are_refused(devices):
    a, b, c = devices(3)
    cxlkv.Pool.create([a, b, c], "24MiB", chunk_size="1MiB", stripe_size="256KiB").close()
    with pytest.raises(cxlkv.PoolFormatError, match="is device 2 of this pool, given as device 1"):
        cxlkv.Pool.open([a, c, b])
    with pytest.raises(cxlkv.PoolFormatError, match="not its first device"):
        cxlkv.Pool.open([b, a, c])
    with pytest.raises(cxlkv.PoolFormatError, match="striped over 3 devices, 2 given"):
        cxlkv.Pool.open([a, b])
    with pytest.raises(cxlkv.PoolFormatError, match="name every device"):
        cxlkv.Pool.open(a)
    with pytest.raises(ValueError, match="listed twice"):
        cxlkv.Pool.open([a, b, b])
    os.unlink(c)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cxlkv.Pool.open([a, b, c])


def test_pool_info_and_destroy_cli(devices):
    devs = devices(2)
    spec = ",".join(devs)
    r = ok(
        cxlkv_cli(
            "pool",
            "create",
            spec,
            "--size",
            "16MiB",
            "--chunk-size",
            "1MiB",
            "--stripe-size",
            "1MiB",
            "--json",
        )
    )
    created = json.loads(r.stdout)
    assert created["stripe_bytes"] == MiB and len(created["devices"]) == 2
    with cxlkv.Pool.open(spec) as pool:
        ns = pool.namespace(LAYOUT, device=1)
        for i in range(20):
            assert ns.put(key(i), payload(i, ns.block_bytes))
    info = json.loads(ok(cxlkv_cli("pool", "info", spec, "--json")).stdout)
    assert [d["path"] for d in info["devices"]] == devs
    assert info["devices"][1]["used_bytes"] >= 20 * 16 * KiB and info["devices"][0]["used_bytes"] == 0
    text = ok(cxlkv_cli("pool", "info", pool_env=spec)).stdout  # $CXLKV_POOL names it too
    # The operator's view (pool info leads with capacity, striping and devices; internals are for
    # --verbose and --json).
    assert "devices" in text and "2 devices, 1.0 MiB stripes" in text and os.path.basename(devs[1]) in text
    r = cxlkv_cli("pool", "info", ",".join(reversed(devs)))
    assert r.returncode == 2 and r.stderr.startswith("cxlkv: error:") and len(r.stderr.splitlines()) == 1
    ok(cxlkv_cli("pool", "destroy", spec))
    assert not any(os.path.exists(d) for d in devs)


_READER = """
import sys, cxlkv
spec, first, count, write_from = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layout = cxlkv.KVLayout("stripe-test", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=64,
                        tokens_per_block=16)
key = lambda i: i.to_bytes(8, "little") * 4
payload = lambda i, n: (i.to_bytes(8, "little") + b"stripes!") * (n // 16)
with cxlkv.Pool.open(spec) as pool:
    ns = pool.namespace(layout)
    bad = [i for i in range(first, first + count) if ns.get_bytes(key(i)) != payload(i, ns.block_bytes)]
    for i in range(write_from, write_from + 50):
        assert ns.put(key(i), payload(i, ns.block_bytes))
print(len(bad))
"""


def test_processes_share_a_striped_pool(devices):
    devs = devices(2)
    spec = ",".join(devs)
    with cxlkv.Pool.create(spec, "32MiB", chunk_size="1MiB") as pool:
        ns = pool.namespace(LAYOUT)
        for i in range(200):
            assert ns.put(key(i), payload(i, ns.block_bytes))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _READER, spec, "0", "200", str(10_000 * (w + 1))],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for w in range(2)
        ]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert out.strip() == "0", "a reader process saw wrong bytes"
        # What the other processes wrote reads back here.
        for w in range(2):
            for i in range(10_000 * (w + 1), 10_000 * (w + 1) + 50):
                assert ns.get_bytes(key(i)) == payload(i, ns.block_bytes)
        assert pool.check()["ok"]


def test_the_pool_guard_watches_every_device(devices):
    devs = devices(2)
    pool = cxlkv.Pool.create(devs, "16MiB", chunk_size="1MiB")
    try:
        guard = PoolGuard(pool, ",".join(devs), logging.getLogger("test"))
        assert guard.usable()
        os.unlink(devs[1])
        guard._next_check = 0.0
        assert not guard.usable()
        assert devs[1] in (guard.cause or "")
    finally:
        pool.close()


def test_a_device_truncated_under_a_live_pool_raises(devices):
    devs = devices(2)
    pool = cxlkv.Pool.create(devs, "16MiB", chunk_size="1MiB", stripe_size="256KiB")
    try:
        ns = pool.namespace(LAYOUT)
        for i in range(50):
            assert ns.put(key(i), payload(i, ns.block_bytes))
        on_device_1 = [i for i in range(50) if ns.locate(key(i))["device"] == 1]
        assert on_device_1
        os.truncate(devs[1], 256 * KiB)  # the label only: every stripe of device 1 is gone
        # The read that hits the lost pages gets zeros (a miss, never wrong bytes: the SIGBUS
        # guard covers the whole range); the next call says what happened.
        assert ns.get_bytes(key(on_device_1[0])) is None
        with pytest.raises(cxlkv.PoolTruncatedError, match="a device shrank"):
            ns.get_bytes(key(0))
    finally:
        pool.close()


@pytest.mark.parametrize(
    "choice, rank, count, want",
    [(None, 3, 4, None), ("tp_rank", 5, 4, 1), (2, 0, 4, 2), ("3", 0, 4, 3), ("tp_rank", 5, 1, None)],
)
def test_the_connectors_device_choice(choice, rank, count, want):
    from cxlkv.integrations.placement import placement_device

    assert placement_device(choice, rank, count) == want


@pytest.mark.parametrize("choice", [4, -1, "rank", 1.5, True])
def test_the_connectors_device_choice_refuses(choice):
    from cxlkv.integrations.placement import placement_device

    with pytest.raises(ValueError):
        placement_device(choice, 0, 4)


def test_forged_tables_and_labels_never_open_wrong(devices):
    """The stripe table (device 0, byte 1024) and the labels (devices 1.., byte 0) are untrusted:
    random bytes written into them, re-sealed with a valid checksum half of the time, either are
    refused with a cxlkv error or open a pool that still reads back every block."""
    import random

    devs = devices(3)
    with cxlkv.Pool.create(devs, "24MiB", chunk_size="1MiB", stripe_size="256KiB") as pool:
        ns = pool.namespace(LAYOUT)
        for i in range(30):
            assert ns.put(key(i), payload(i, ns.block_bytes))
    regions = [(devs[0], 1024, 168), (devs[1], 0, 64), (devs[2], 0, 64)]  # (file, offset, bytes)
    originals = [read_device(p, off, n) for p, off, n in regions]
    rng = random.Random(9)
    refused = 0
    for trial in range(150):
        which = rng.randrange(len(regions))
        path, off, n = regions[which]
        forged = bytearray(originals[which])
        for _ in range(rng.randint(1, 4)):
            forged[rng.randrange(n - 8)] = rng.randrange(256)  # any field but the checksum
        if trial % 2:  # re-seal: the fields themselves must be refused
            forged[n - 8 :] = cxlkv._core.xxh3_64(bytes(forged[: n - 8])).to_bytes(8, "little")
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(forged)
        try:
            with cxlkv.Pool.open(devs) as pool:
                ns = pool.namespace(LAYOUT)
                assert all(ns.get_bytes(key(i)) == payload(i, ns.block_bytes) for i in range(30))
        except (cxlkv.CxlkvError, ValueError, OSError):
            refused += 1
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(originals[which])
    assert refused > 100, refused
