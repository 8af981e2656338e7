"""The seed pools the format fuzzer mutates, what they hold, and where everything is in them.

A seed is a 16 MiB pool (3 chunks of 4 MiB: a random write lands in metadata often) holding
  namespace A (8192-byte blocks): keys 0..299 by put (mixed lengths, depths 0..6), keys 300..339 by
      store() from a [2, 64, 4096] array; keys i < 300 with i % 17 == 0 deleted (tombstones);
  namespace B (2048-byte blocks): keys 0..59 by put.
The "deadnode" variant also has a second process that attached, leased A's first 8 present keys and
was SIGKILLed: its node slot stays ALIVE with a dead pid and live pins (the reclaim path).
Seeds have a 1 s lease (SEED_LEASE_MS): every case runs on a fresh copy of the file, where the dead
node's kernel lock cannot be seen, so a tool judges it by a lease of silence; at the default 10 s
lease that wait was most of the fuzzer's time (half the cases), and the code path is the same.
Every expected byte derives from the key alone, so any process can verify any read.
"""

from __future__ import annotations

import os
import signal
import struct

import numpy as np

import fuzz_layout as L

SEED_SIZE = "16MiB"
SEED_LEASE_MS = 1000
VARIANTS = ("clean", "deadnode")
A_PUT = range(300)
A_STORE = range(300, 340)
B_PUT = range(60)
A_BLOCK = 8192
B_BLOCK = 2048


def layout_a():
    import cxlkv

    return cxlkv.KVLayout(
        model_id="fuzz-a", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=32, tokens_per_block=16
    )  # 8192-byte blocks


def layout_b():
    import cxlkv

    return cxlkv.KVLayout(
        model_id="fuzz-b", dtype="fp32", num_layers=1, num_kv_heads=1, head_size=16, tokens_per_block=16
    )  # 2048-byte blocks


def key(ns: str, i: int) -> bytes:
    return L.tu.make_key("fuzz", ns, i)


def payload(k: bytes, n: int) -> bytes:
    return L.tu.payload(k, n)


def a_len(i: int) -> int:
    """Stored length of A's key i: mostly full blocks, every fifth a short one."""
    if i in A_STORE:
        return A_BLOCK
    return A_BLOCK if i % 5 else (i * 37) % A_BLOCK + 1


def a_deleted(i: int) -> bool:
    return i in A_PUT and i % 17 == 0


def expected_a(i: int) -> bytes:
    return payload(key("a", i), a_len(i))


def expected_b(i: int) -> bytes:
    return payload(key("b", i), B_BLOCK)


def present_a() -> list[int]:
    return [i for i in list(A_PUT) + list(A_STORE) if not a_deleted(i)]


def build(path: str, variant: str = "clean") -> None:
    import cxlkv

    if os.path.exists(path):
        os.unlink(path)
    pool = cxlkv.Pool.create(path, SEED_SIZE, lease_ms=SEED_LEASE_MS)
    a = pool.namespace(layout_a(), tenant="seed-a")  # quota rows and charged entries (format/quota.h)
    b = pool.namespace(layout_b())
    pool.set_quota(tenant="seed-a", max_fraction=0.5)
    pool.set_quota(namespace=b.name, max_bytes=1 << 30)  # larger than the pool: never binds
    for i in A_PUT:
        assert a.put(key("a", i), expected_a(i), depth=i % 7)
    src = np.zeros((2, 64, A_BLOCK // 2), dtype=np.uint8)
    for j, i in enumerate(A_STORE):
        p = np.frombuffer(expected_a(i), dtype=np.uint8)
        src[0, j], src[1, j] = p[: A_BLOCK // 2], p[A_BLOCK // 2 :]
    keys = [key("a", i) for i in A_STORE]
    assert a.store(keys, [src], list(range(len(keys))), block_dim=1) == len(keys)
    for i in B_PUT:
        assert b.put(key("b", i), expected_b(i))
    for i in A_PUT:
        if a_deleted(i):
            assert a.delete(key("a", i))
    if variant == "deadnode":
        _leave_dead_node(path)
    L.assert_matches(pool.info(), open(path, "rb").read(4096))
    pool.close()


def _leave_dead_node(path: str) -> None:
    """A child attaches, pins 8 keys and dies by SIGKILL without detaching."""
    import cxlkv

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            a2 = cxlkv.Pool.open(path).namespace(layout_a())
            lease = a2.acquire([key("a", i) for i in present_a()[:8]])
            os.write(w, bytes([len(lease)]))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.close(w)
    n = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert n and n[0] == 8, f"dead-node child leased {n!r} keys, wanted 8"


def describe(buf: bytes) -> dict:
    """File offsets of every mutation target in a seed, read back from the seed itself."""
    h = L.read_header(buf)
    desc_bytes = L.chunk_desc_bytes(h["chunk_bytes"])
    stride = desc_bytes + h["chunk_bytes"]
    ns_off, block_bytes = {}, {}
    for nid in range(1, h["max_namespaces"] + 1):
        off = h["ns_table_off"] + (nid - 1) * L.NS_BYTES
        if struct.unpack_from("<Q", buf, off)[0] >> 56 == L.NS_READY:
            ns_off[nid] = off
            block_bytes[nid] = struct.unpack_from("<Q", buf, off + L.NS_FIELDS["block_bytes"][0])[0]
    entries, payloads = [], []
    for slot in range(h["index_slots"]):
        off = h["index_off"] + slot * L.ENTRY_BYTES
        st = struct.unpack_from("<Q", buf, off)[0]
        if st == 0:
            continue
        entries.append(off)
        if st >> 56 == L.ENTRY_READY:
            ns_id = struct.unpack_from("<I", buf, off + L.ENTRY_FIELDS["ns_id"][0])[0]
            chunk = struct.unpack_from("<I", buf, off + L.ENTRY_FIELDS["chunk"][0])[0]
            block = struct.unpack_from("<H", buf, off + L.ENTRY_FIELDS["block"][0])[0]
            length = struct.unpack_from("<I", buf, off + L.ENTRY_FIELDS["length"][0])[0]
            bstride = L.round_up(block_bytes.get(ns_id, 64), 64)
            payloads.append((h["arena_off"] + chunk * stride + desc_bytes + block * bstride, length))
    descs = [
        h["arena_off"] + c * stride + 8 * b
        for c in range(h["chunk_count"])
        for b in range(desc_bytes // 8)
        if struct.unpack_from("<Q", buf, h["arena_off"] + c * stride + 8 * b)[0]
    ]
    node_slots = [h["node_table_off"] + L.NODE_SLOT_BYTES * i for i in range(h["max_nodes"])]
    return {
        "size": len(buf),
        "header": h,
        "desc_bytes": desc_bytes,
        "chunk_stride": stride,
        "namespaces": ns_off,
        "entries": entries,
        "payloads": payloads,
        "descs": descs,
        "chunk_words": [h["chunk_map_off"] + 8 * c for c in range(h["chunk_count"])],
        "node_slots": node_slots,
        "live_node_slots": [o for o in node_slots if struct.unpack_from("<Q", buf, o)[0]],
        "node_areas": [h["node_area_off"] + h["node_area_bytes"] * i for i in range(h["max_nodes"])],
        "access": [h["access_off"] + 8 * ((e - h["index_off"]) // L.ENTRY_BYTES) for e in entries],
        "meta_end": h["arena_off"] + 2 * stride,  # header .. the desc areas of the first two chunks
    }
