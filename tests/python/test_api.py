"""The Python API of docs/API.md: round trips, argument checking, gather/scatter layouts,
namespaces, statistics and leases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import TEST_BACKEND, KiB, MiB, small_layout

BB = 4 * KiB  # block bytes of small_layout()


# ------------------------------------------------------------------------------------------------
# pools
def test_create_open_identity(make_pool, pool_path):
    pool = make_pool(size="64MiB")
    assert pool.path == pool_path
    assert pool.size == 64 * MiB
    assert pool.backend == TEST_BACKEND
    assert isinstance(pool.uuid, str) and len(pool.uuid) >= 32
    assert pool.node_id >= 1
    assert os.stat(pool_path).st_mode & 0o777 == 0o600
    info = pool.info()
    assert isinstance(info, dict)
    with cxlkv.Pool.open(pool_path) as other:
        assert other.uuid == pool.uuid
        assert other.node_id != pool.node_id
        assert other.size == pool.size
    # create refuses an existing pool unless exist_ok
    with pytest.raises(FileExistsError, match="cxlkv-test"):
        cxlkv.Pool.create(pool_path, 64 * MiB)
    again = cxlkv.Pool.create(pool_path, 64 * MiB, exist_ok=True)
    assert again.uuid == pool.uuid
    again.close()
    again2 = cxlkv.Pool.open_or_create(pool_path, 64 * MiB)
    assert again2.uuid == pool.uuid
    again2.close()


def test_open_or_create_and_destroy(pool_path):
    with cxlkv.Pool.open_or_create(pool_path, "32MiB", chunk_size=1 * MiB) as pool:
        assert pool.size == 32 * MiB
    assert os.path.exists(pool_path)
    cxlkv.Pool.destroy(pool_path)
    assert not os.path.exists(pool_path)
    with pytest.raises(FileNotFoundError):
        cxlkv.Pool.open(pool_path)


def test_close_releases_node_slot(make_pool, pool_path):
    pool = make_pool(max_nodes=2)
    for _ in range(10):  # more opens than slots: each close must give its slot back
        p = cxlkv.Pool.open(pool_path)
        p.close()
    a = cxlkv.Pool.open(pool_path)
    with pytest.raises(cxlkv.NodeTableFullError):
        cxlkv.Pool.open(pool_path)
    a.close()
    cxlkv.Pool.open(pool_path).close()
    assert pool.check()["ok"]


def test_exception_hierarchy():
    for name in (
        "PoolFormatError",
        "PoolVersionError",
        "PoolTruncatedError",
        "PoolNotReadyError",
        "PoolCorruptError",
        "LayoutMismatchError",
        "NodeTableFullError",
        "NamespaceTableFullError",
    ):
        exc = getattr(cxlkv, name)
        assert issubclass(exc, cxlkv.CxlkvError), name
    assert issubclass(cxlkv.CxlkvError, Exception)


# ------------------------------------------------------------------------------------------------
# put / get / contains / delete / match_prefix / get_bytes
def test_put_get_round_trip(small_ns):
    _pool, ns = small_ns
    assert ns.block_bytes == BB
    keys = [tu.make_key("rt", i) for i in range(200)]
    for k in keys:
        assert not ns.contains(k)
        assert ns.get_bytes(k) is None
        assert ns.put(k, tu.key_payload(k, BB)) is True
    for k in keys:
        assert ns.contains(k)
        expect = tu.key_payload(k, BB)
        assert ns.get_bytes(k) == expect  # length preserved exactly
        out = bytearray(BB)
        assert ns.get(k, out) is True
        assert bytes(out[: len(expect)]) == expect
        assert not any(out[len(expect) :])
        # numpy output buffer, exactly the payload size
        arr = np.zeros(len(expect), dtype=np.uint8)
        assert ns.get(k, arr)
        assert arr.tobytes() == expect


def test_put_accepts_buffers(small_ns):
    _, ns = small_ns
    k1, k2, k3, k4 = (tu.make_key("buf", i) for i in range(4))
    data = tu.payload(k1, BB)
    assert ns.put(k1, data)
    assert ns.put(k2, bytearray(data))
    assert ns.put(k3, memoryview(data))
    assert ns.put(k4, np.frombuffer(data, dtype=np.uint16))
    for k in (k1, k2, k3, k4):
        assert ns.get_bytes(k) == data
    # empty payload is a valid (zero-length) block
    k5 = tu.make_key("buf", "empty")
    assert ns.put(k5, b"")
    assert ns.contains(k5)
    assert ns.get_bytes(k5) == b""


def test_put_existing_key_is_true_and_keeps_first_payload(small_ns):
    _, ns = small_ns
    k = tu.make_key("dup")
    assert ns.put(k, b"first" * 10)
    assert ns.put(k, b"second" * 10) is True  # already present: True, content unchanged
    assert ns.get_bytes(k) == b"first" * 10


def test_delete(small_ns):
    _, ns = small_ns
    k = tu.make_key("del")
    assert ns.delete(k) is False
    assert ns.put(k, b"x" * 100)
    assert ns.delete(k) is True
    assert not ns.contains(k)
    assert ns.get_bytes(k) is None
    assert ns.get(k, bytearray(BB)) is False
    assert ns.delete(k) is False
    # the key can be stored again, with new content
    assert ns.put(k, b"y" * 50)
    assert ns.get_bytes(k) == b"y" * 50


def test_match_prefix(small_ns):
    _, ns = small_ns
    keys = tu.chain_keys("mp", 10)
    assert ns.match_prefix(keys) == 0
    assert ns.match_prefix([]) == 0
    for k in keys[:6]:
        ns.put(k, tu.key_payload(k, BB))
    assert ns.match_prefix(keys) == 6
    assert ns.match_prefix(keys[:3]) == 3
    ns.delete(keys[2])
    assert ns.match_prefix(keys) == 2
    assert ns.match_prefix(keys[3:]) == 3
    # a gap at the start means no prefix at all
    assert ns.match_prefix([tu.make_key("absent")] + keys[3:6]) == 0


def test_get_into_too_small_buffer_raises(small_ns):
    _, ns = small_ns
    k = tu.make_key("small-out")
    ns.put(k, b"z" * 1000)
    with pytest.raises(ValueError):
        ns.get(k, bytearray(999))
    with pytest.raises((ValueError, TypeError, BufferError)):
        ns.get(k, b"\0" * 2000)  # read-only buffer


@pytest.mark.parametrize("bad_len", [0, 1, 16, 31, 33, 64])
def test_wrong_key_length_raises_value_error(small_ns, bad_len):
    _, ns = small_ns
    k = b"k" * bad_len
    with pytest.raises(ValueError, match="32"):
        ns.put(k, b"data")
    with pytest.raises(ValueError):
        ns.get(k, bytearray(BB))
    with pytest.raises(ValueError):
        ns.get_bytes(k)
    with pytest.raises(ValueError):
        ns.contains(k)
    with pytest.raises(ValueError):
        ns.delete(k)
    with pytest.raises(ValueError):
        ns.match_prefix([tu.make_key("ok"), k])
    with pytest.raises(ValueError):
        ns.acquire([k])


def test_data_larger_than_block_raises_value_error(small_ns):
    _, ns = small_ns
    k = tu.make_key("big")
    with pytest.raises(ValueError):
        ns.put(k, b"\1" * (BB + 1))
    assert not ns.contains(k)
    assert ns.put(k, b"\1" * BB)  # exactly block_bytes is fine


# ------------------------------------------------------------------------------------------------
# store / load: gather-scatter in vLLM layouts
def _layout_for(kv, model_id):
    return cxlkv.KVLayout(
        model_id=model_id,
        dtype="bf16",
        num_layers=kv.num_layers,
        num_kv_heads=kv.heads,
        head_size=kv.head,
        tokens_per_block=kv.block_size,
    )


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_store_load_vllm_layouts(make_pool, kind):
    pool = make_pool()
    Kv = tu.CudaKV if kind == "cuda" else tu.CpuKV
    nb = 24
    rng = np.random.default_rng(1234)
    src = Kv(num_layers=3, block_size=16, heads=2, head=32, num_blocks=nb)
    for a in src.arrays:
        a[...] = rng.integers(0, 1 << 16, size=a.shape, dtype=np.uint16)
    layout = _layout_for(src, f"test/{kind}")
    ns = pool.namespace(layout)
    assert ns.block_bytes == layout.block_bytes == src.block_bytes
    # dense block_bytes formula of API.md
    assert layout.block_bytes == 3 * 2 * 2 * 32 * 16 * 2

    keys = tu.chain_keys(kind, 8)
    block_ids = [5, 0, 23, 7, 11, 2, 19, 14]
    n = ns.store(keys, src.arrays, block_ids, block_dim=src.block_dim)
    assert n == len(keys)
    # exact gather order: per source (layer), every index of the dims before block_dim, C order
    for k, b in zip(keys, block_ids, strict=True):
        assert ns.get_bytes(k) == src.read_block(b), f"gathered bytes of block {b} differ"

    # scatter into a sentinel-filled copy at other block ids; everything else must be untouched
    sentinel = 0xA5A5
    dst = Kv(num_layers=3, block_size=16, heads=2, head=32, num_blocks=nb, fill=sentinel)
    dst_ids = [1, 3, 4, 6, 8, 9, 10, 12]
    assert ns.load(keys, dst.arrays, dst_ids, block_dim=dst.block_dim) == len(keys)
    for sb, db in zip(block_ids, dst_ids, strict=True):
        assert dst.read_block(db) == src.read_block(sb)
    untouched = set(range(nb)) - set(dst_ids)
    for b in untouched:
        for frag in dst.fragments(b):
            assert (frag == sentinel).all(), f"block {b} was written but not listed"

    # zeroed arrays, same ids: exact round trip
    dst2 = Kv(num_layers=3, block_size=16, heads=2, head=32, num_blocks=nb)
    assert ns.load(keys, dst2.arrays, block_ids, block_dim=dst2.block_dim) == len(keys)
    for b in block_ids:
        assert dst2.read_block(b) == src.read_block(b)
    for b in set(range(nb)) - set(block_ids):
        assert dst2.read_block(b) == bytes(src.block_bytes)


def test_store_load_returns_leading_count(make_pool):
    pool = make_pool()
    src = tu.CudaKV(num_layers=2, block_size=4, heads=2, head=16, num_blocks=8)
    for i, a in enumerate(src.arrays):
        a[...] = np.arange(a.size, dtype=np.uint16).reshape(a.shape) + i
    ns = pool.namespace(_layout_for(src, "test/leading"))
    keys = tu.chain_keys("lead", 6)
    assert ns.store(keys[:3], src.arrays, [0, 1, 2], block_dim=1) == 3
    ns.delete(keys[1])
    dst = tu.CudaKV(num_layers=2, block_size=4, heads=2, head=16, num_blocks=8)
    # load counts the leading keys loaded; a block after the gap may or may not be filled
    assert ns.load(keys[:3], dst.arrays, [0, 1, 2], block_dim=1) == 1
    assert dst.read_block(0) == src.read_block(0)
    assert dst.read_block(1) == bytes(src.block_bytes)
    assert dst.read_block(2) in (bytes(src.block_bytes), src.read_block(2))
    # store of present keys counts them as present
    assert ns.store(keys[:6], src.arrays, list(range(6)), block_dim=1) == 6
    assert ns.match_prefix(keys) == 6


def test_store_strided_sources(make_pool):
    """Sources are taken by address and strides: views that are strided in the dims up to the
    block dim (a slice of blocks, one layer of a stacked cache) gather the view's elements."""
    pool = make_pool()
    layers, nb, bs, heads, head = 2, 12, 4, 2, 16
    stacked = np.random.default_rng(7).integers(
        0, 1 << 16, size=(layers, 2, 2 * nb, bs, heads, head), dtype=np.uint16
    )
    views = [stacked[l, :, ::2] for l in range(layers)]  # every other block: strided block dim
    assert not views[0].flags.c_contiguous
    ref = tu.CudaKV(num_layers=layers, block_size=bs, heads=heads, head=head, num_blocks=nb)
    for l in range(layers):
        ref.arrays[l][...] = views[l]
    ns = pool.namespace(_layout_for(ref, "test/strided"))
    keys = tu.chain_keys("strided", 3)
    ids = [0, 2, 11]
    assert ns.store(keys, views, ids, block_dim=1) == 3
    for k, b in zip(keys, ids, strict=True):
        assert ns.get_bytes(k) == ref.read_block(b)
    out = np.zeros_like(stacked)
    out_views = [out[l, :, ::2] for l in range(layers)]
    assert ns.load(keys, out_views, ids, block_dim=1) == 3
    for l in range(layers):
        for b in ids:
            assert (out_views[l][:, b] == views[l][:, b]).all()
    mask = np.zeros(out.shape, dtype=bool)
    for b in ids:
        mask[:, :, 2 * b] = True
    assert not out[~mask].any(), "scatter wrote outside the listed blocks of the strided view"


def test_store_inner_non_contiguous_is_exact_or_rejected(make_pool):
    """A view that is non-contiguous inside a block is either gathered exactly or refused with
    ValueError: never gathered from the wrong addresses."""
    pool = make_pool()
    nb, bs, heads, head = 6, 4, 2, 16
    big = np.random.default_rng(8).integers(0, 1 << 16, size=(2, nb, bs, heads, 2 * head), dtype=np.uint16)
    view = big[..., :head]
    ref = tu.CudaKV(num_layers=1, block_size=bs, heads=heads, head=head, num_blocks=nb)
    ref.arrays[0][...] = view
    ns = pool.namespace(_layout_for(ref, "test/inner-strided"))
    keys = tu.chain_keys("inner", 2)
    try:
        n = ns.store(keys, [view], [1, 4], block_dim=1)
    except ValueError:
        assert not ns.contains(keys[0])
        return
    assert n == 2
    assert ns.get_bytes(keys[0]) == ref.read_block(1)
    assert ns.get_bytes(keys[1]) == ref.read_block(4)


def test_load_into_read_only_array_raises(make_pool):
    pool = make_pool()
    kv = tu.CpuKV(num_layers=1, block_size=4, heads=2, head=16, num_blocks=4)
    ns = pool.namespace(_layout_for(kv, "test/readonly"))
    k = tu.make_key("ro")
    assert ns.store([k], kv.arrays, [0], block_dim=0) == 1
    kv.arrays[0].flags.writeable = False
    with pytest.raises((ValueError, TypeError, BufferError)):
        ns.load([k], kv.arrays, [1], block_dim=0)


def test_store_mismatched_total_bytes_raises(make_pool):
    pool = make_pool()
    src = tu.CudaKV(num_layers=2, block_size=4, heads=2, head=16, num_blocks=4)
    ns = pool.namespace(_layout_for(src, "test/mismatch-bytes"))
    keys = tu.chain_keys("mm", 2)
    with pytest.raises(ValueError):
        ns.store(keys, src.arrays[:1], [0, 1], block_dim=1)  # half the bytes
    with pytest.raises(ValueError):
        ns.store(keys, src.arrays + src.arrays[:1], [0, 1], block_dim=1)  # too many bytes
    with pytest.raises(ValueError):
        ns.load(keys, src.arrays[:1], [0, 1], block_dim=1)
    with pytest.raises((ValueError, IndexError)):
        ns.store(keys, src.arrays, [0], block_dim=1)  # len(block_ids) != len(keys)
    with pytest.raises((ValueError, IndexError)):
        ns.store(keys, src.arrays, [0, 4], block_dim=1)  # block id out of range
    with pytest.raises((ValueError, IndexError)):
        ns.store(keys, src.arrays, [0, -1], block_dim=1)
    with pytest.raises((ValueError, IndexError)):
        ns.store(keys, src.arrays, [0, 1], block_dim=5)  # no such dim
    assert not ns.contains(keys[0]) and not ns.contains(keys[1])


# ------------------------------------------------------------------------------------------------
# namespaces
def test_two_models_never_alias(make_pool):
    pool = make_pool()
    a = pool.namespace(small_layout(model_id="test/model-a"))
    b = pool.namespace(small_layout(model_id="test/model-b"))
    assert a.id != b.id
    keys = [tu.make_key("alias", i) for i in range(50)]
    for k in keys:
        assert a.put(k, tu.payload(k, 1000, b"A"))
    for k in keys[:25]:
        assert not b.contains(k)
        assert b.get_bytes(k) is None
        assert b.put(k, tu.payload(k, 900, b"B"))
    for k in keys:
        assert a.get_bytes(k) == tu.payload(k, 1000, b"A")
    for k in keys[:25]:
        assert b.get_bytes(k) == tu.payload(k, 900, b"B")
    assert b.match_prefix(keys) == 25
    assert a.delete(keys[0])
    assert b.get_bytes(keys[0]) == tu.payload(keys[0], 900, b"B")
    names = {d.get("name") for d in pool.namespaces()}
    assert len(pool.namespaces()) >= 2
    assert a.name in names and b.name in names


def test_head_entries_are_another_namespace(make_pool):
    pool = make_pool()
    whole = pool.namespace(small_layout(None, model_id="test/tp", num_kv_heads=2))
    per_head = pool.namespace(small_layout(None, model_id="test/tp", num_kv_heads=2, heads_per_entry=1))
    assert whole.id != per_head.id
    assert per_head.block_bytes * 2 == whole.block_bytes  # one of the two heads per entry
    k = tu.make_key("tp")
    whole.put(k, b"whole")
    assert not per_head.contains(k)


def test_mla_block_bytes():
    lay = cxlkv.KVLayout(
        model_id="test/mla",
        dtype="bf16",
        num_layers=4,
        num_kv_heads=1,
        head_size=576,
        tokens_per_block=16,
        kind="mla",
    )
    assert lay.block_bytes == 4 * 576 * 16 * 2
    dense = cxlkv.KVLayout(
        model_id="meta-llama/Llama-3-8B",
        dtype="bf16",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        tokens_per_block=16,
    )
    assert dense.block_bytes == 32 * 2 * 8 * 128 * 16 * 2


def test_namespace_reopen_same_layout_from_another_process(make_pool, pool_path):
    pool = make_pool()
    ns = pool.namespace(small_layout(model_id="test/shared"))
    keys = [tu.make_key("xproc", i) for i in range(20)]
    for k in keys:
        ns.put(k, tu.key_payload(k, BB))
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {tu.here()!r})
        import cxlkv, cxlkv_testutil as tu
        from conftest import small_layout
        with cxlkv.Pool.open({pool_path!r}) as pool:
            ns = pool.namespace(small_layout(model_id="test/shared"))
            assert ns.id == {ns.id}, ns.id
            keys = [tu.make_key("xproc", i) for i in range(20)]
            for k in keys:
                assert ns.get_bytes(k) == tu.key_payload(k, {BB}), k.hex()
            k = tu.make_key("xproc", "from-child")
            assert ns.put(k, b"child" * 7)
            try:
                pool.namespace(small_layout(model_id="test/shared", num_layers=3))
            except cxlkv.LayoutMismatchError:
                pass
            else:
                raise SystemExit("no LayoutMismatchError in the other process")
        print("OK")
    """)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tu.here()
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"
    assert ns.get_bytes(tu.make_key("xproc", "from-child")) == b"child" * 7


def test_namespace_layout_mismatch(make_pool):
    pool = make_pool()
    pool.namespace(small_layout(model_id="test/m", block_bytes=None), name="m")
    for change in (
        dict(num_layers=3),
        dict(num_kv_heads=4),
        dict(head_size=32),
        dict(tokens_per_block=8),
        dict(dtype="fp32"),
        dict(kind="mla"),
    ):
        with pytest.raises(cxlkv.LayoutMismatchError) as ei:
            pool.namespace(small_layout(model_id="test/m", block_bytes=None, **change), name="m")
        assert "m" in str(ei.value)
    # the same layout still opens
    again = pool.namespace(small_layout(model_id="test/m", block_bytes=None), name="m")
    assert again.name == "m"


def test_namespace_default_name_mismatch(make_pool):
    """Without an explicit name, the same model re-opened with another geometry is a mismatch."""
    pool = make_pool()
    ns = pool.namespace(small_layout(model_id="test/default-name"))
    with pytest.raises(cxlkv.LayoutMismatchError):
        pool.namespace(small_layout(model_id="test/default-name", block_bytes=8 * KiB))
    assert pool.namespace(small_layout(model_id="test/default-name")).id == ns.id


# ------------------------------------------------------------------------------------------------
# stats
def test_stats_counts_hits_and_misses(small_ns):
    pool, ns = small_ns
    keys = [tu.make_key("stats", i) for i in range(10)]
    for k in keys[:5]:
        ns.put(k, b"s" * 64)
    s0 = pool.stats()
    assert isinstance(s0, dict)
    out = bytearray(BB)
    for k in keys:
        ns.get(k, out)  # 5 hits, 5 misses
    for k in keys[:3]:
        ns.get_bytes(k)  # 3 hits
    ns.get_bytes(keys[9])  # 1 miss
    s1 = pool.stats()
    assert s1["hits"] - s0["hits"] == 8
    assert s1["misses"] - s0["misses"] == 6


# ------------------------------------------------------------------------------------------------
# leases
def test_acquire_pins(small_ns):
    pool, ns = small_ns
    keys = tu.chain_keys("lease", 5)
    for k in keys[:3]:
        ns.put(k, tu.key_payload(k, BB))
    lease = ns.acquire(keys)
    assert len(lease) == 3  # leading present keys only
    assert list(lease.keys) == keys[:3]
    assert ns.delete(keys[0]) is False
    assert ns.delete(keys[2]) is False
    assert ns.contains(keys[0])
    lease.release()
    assert ns.delete(keys[0]) is True
    lease.release()  # idempotent

    with ns.acquire(keys[1:3]) as l2:
        assert len(l2) == 2
        assert ns.delete(keys[1]) is False
    assert ns.delete(keys[1]) is True

    empty = ns.acquire([tu.make_key("nope")] + keys[2:3])
    assert len(empty) == 0
    empty.release()
    assert pool.check()["ok"]


def test_namespace_table_full(make_pool):
    pool = make_pool(max_namespaces=2)
    pool.namespace(small_layout(model_id="test/ns-1"))
    pool.namespace(small_layout(model_id="test/ns-2"))
    with pytest.raises(cxlkv.NamespaceTableFullError):
        pool.namespace(small_layout(model_id="test/ns-3"))
    # existing ones still open
    assert pool.namespace(small_layout(model_id="test/ns-1")).block_bytes == BB
    listed = pool.namespaces()
    assert len(listed) == 2
    assert {d["model_id"] for d in listed} == {"test/ns-1", "test/ns-2"}


def test_get_on_closed_pool_raises(make_pool):
    pool = make_pool()
    ns = pool.namespace(small_layout())
    k = tu.make_key("closed")
    ns.put(k, b"x")
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(cxlkv.ClosedError) as ei:  # the condition's own type, not a crash
        ns.get_bytes(k)
    assert isinstance(ei.value, RuntimeError)


def test_flush_backend_round_trip(make_pool, pool_path):
    """The non-coherent discipline (flush/invalidate around metadata, streaming payload copies)
    keeps the same semantics on one host."""
    pool = make_pool(backend="flush")
    assert pool.backend == "flush"
    ns = pool.namespace(small_layout())
    keys = [tu.make_key("flush", i) for i in range(100)]
    for k in keys:
        assert ns.put(k, tu.key_payload(k, BB))
    src = tu.CudaKV(num_layers=2, block_size=4, heads=2, head=32, num_blocks=4)
    for i, a in enumerate(src.arrays):
        a[...] = np.arange(a.size, dtype=np.uint16).reshape(a.shape) * (i + 3)
    ns2 = pool.namespace(_layout_for(src, "test/flush-kv"))
    ck = tu.chain_keys("flush-chain", 4)
    assert ns2.store(ck, src.arrays, [3, 2, 1, 0], block_dim=1) == 4
    with cxlkv.Pool.open(pool_path) as other:
        assert other.backend == "flush"
        ons = other.namespace(small_layout())
        for k in keys:
            assert ons.get_bytes(k) == tu.key_payload(k, BB)
        dst = tu.CudaKV(num_layers=2, block_size=4, heads=2, head=32, num_blocks=4)
        assert (
            other.namespace(_layout_for(src, "test/flush-kv")).load(ck, dst.arrays, [0, 1, 2, 3], block_dim=1)
            == 4
        )
        for i, b in enumerate([3, 2, 1, 0]):
            assert dst.read_block(i) == src.read_block(b)
    assert tu.pool_check_problems(pool.check()) == []


def test_unknown_backend_raises(pool_path):
    with pytest.raises(ValueError):
        cxlkv.Pool.create(pool_path, 32 * MiB, backend="telepathy")
    assert not os.path.exists(pool_path)
