"""The token store (python/cxlkv/token_store.py, src/core/transfer/token_rows.*): gather / gather_layers
exact against a reference on random rows and random indices (duplicates, unsorted, first and last
token, k = 1, k = context), outputs pre-filled with poison, fresh seeds printed; appends in uneven
pieces; the length a reader of another process learns; the row formats (bf16 MLA, fp8_ds_mla raw
records, dense K/V, the indexer stream); eviction and corruption under a reader (a miss, never
wrong rows); bad indices, dtypes and shapes; placement of requests on devices of a striped pool."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import cxlkv
from conftest import SHM_DIR, MiB, _remove
from cxlkv.token_store import indexer_blocks, indexer_rows

POISON = 0xA5
FP8_DS_MLA = dict(kind="mla", dtype="uint8", head_size=656)  # 512 B fp8 + 16 B scales + 128 B rope


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


def _layout(**kw) -> cxlkv.KVLayout:
    base = dict(model_id="tok/test", num_layers=3, tokens_per_block=16)
    base.update(FP8_DS_MLA)
    base.update(kw)
    return cxlkv.KVLayout(**base)


def _rows(rng, layers: int, n: int, elems: int, dtype=np.uint8) -> np.ndarray:
    return rng.integers(0, 256, (layers, n, elems * np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)


def _append_uneven(ts, seq, rows, rng) -> None:
    """Appends rows in random pieces (1 token, a partial chunk, several chunks at once)."""
    n, done = rows.shape[1], 0
    while done < n:
        take = int(min(n - done, rng.choice([1, 3, 7, 16, 29, 50])))
        ts.append(seq, rows[:, done : done + take])
        done += take


def test_gather_exact_on_random_indices(make_pool):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=400)
    n = int(rng.integers(40, 300))
    rows = _rows(rng, 3, n, 656)
    _append_uneven(ts, b"req-1", rows, rng)
    assert ts.length(b"req-1") == n
    cases = [
        np.array([0]),
        np.array([n - 1]),
        np.arange(n),  # k = context
        np.array([n - 1, 0, 0, 5, n - 1]),  # duplicates, unsorted, first and last
        rng.integers(0, n, 64),
        rng.permutation(n)[: min(n, 33)],
    ]
    for idx in cases:
        for layer in range(3):
            out = np.full((len(idx), 656), POISON, np.uint8)
            ts.gather(b"req-1", layer, idx, out)
            np.testing.assert_array_equal(out, rows[layer, idx])
        per_layer = np.stack([rng.permutation(idx) for _ in range(3)])
        out = np.full((3, len(idx), 656), POISON, np.uint8)
        ts.gather_layers(b"req-1", per_layer, out)
        np.testing.assert_array_equal(out, rows[np.arange(3)[:, None], per_layer])


def test_bf16_mla_rows_with_torch(make_pool):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(
        _layout(kind="mla", dtype="bf16", head_size=576, num_layers=2), max_tokens_per_seq=100
    )
    assert ts.row_bytes == 1152
    rows = torch.from_numpy(_rows(rng, 2, 70, 576, np.uint16).copy()).view(torch.bfloat16)
    ts.append("r", rows[:, :33])
    ts.append("r", rows[:, 33:])
    idx = torch.tensor([69, 0, 3, 3, 40])
    out = torch.full((5, 576), float("nan"), dtype=torch.bfloat16)
    ts.gather("r", 1, idx, out)
    assert torch.equal(out.view(torch.int16), rows[1, idx].view(torch.int16))
    with pytest.raises(ValueError, match="dtype"):
        ts.gather("r", 1, idx, torch.zeros((5, 576), dtype=torch.float16))


def test_dense_kv_rows(make_pool):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    lay = cxlkv.KVLayout(
        "tok/dense", dtype="fp16", num_layers=2, num_kv_heads=2, head_size=8, tokens_per_block=4
    )
    ts = pool.token_store(lay, max_tokens_per_seq=64)
    assert ts.row_elems == 2 * 2 * 8
    rows = _rows(rng, 2, 21, 32, np.float16)
    _append_uneven(ts, b"d", rows, rng)
    idx = np.array([[20, 0, 7], [1, 1, 19]])
    out = np.full((2, 3, 32), np.nan, np.float16)
    ts.gather_layers(b"d", idx, out)
    np.testing.assert_array_equal(out.view(np.uint16), rows[np.arange(2)[:, None], idx].view(np.uint16))


def test_indexer_stream_and_vllm_block_format(make_pool):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(tokens_per_block=64), max_tokens_per_seq=256, indexer=True)
    assert ts.indexer is not None and ts.indexer.row_bytes == 132
    # vLLM's layout: per 64-token block 8,192 B of fp8 values, then 256 B of fp32 scales
    n = 100
    blocks = rng.integers(0, 256, (2, 64 * 132), dtype=np.uint8)
    rows = indexer_rows(blocks, n)
    assert rows.shape == (n, 132)
    np.testing.assert_array_equal(rows[70, :128], blocks[1, 6 * 128 : 7 * 128])
    np.testing.assert_array_equal(rows[70, 128:], blocks[1, 8192 + 6 * 4 : 8192 + 7 * 4])
    back = indexer_blocks(rows)
    np.testing.assert_array_equal(back[0], blocks[0])
    per_layer = np.stack([rows] * 3)
    main = _rows(rng, 3, n, 656)
    ts.append(b"s", main)
    ts.indexer.append(b"s", per_layer)
    out = np.full((3, n, 132), POISON, np.uint8)
    ts.indexer.gather_layers(b"s", np.tile(np.arange(n), (3, 1)), out)
    np.testing.assert_array_equal(out, per_layer)
    # the two streams are distinct blocks of the same sequence
    o2 = np.full((1, 656), POISON, np.uint8)
    ts.gather(b"s", 0, [99], o2)
    np.testing.assert_array_equal(o2[0], main[0, 99])


def test_length_and_rows_seen_by_another_process(make_pool, pool_path):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=200)
    rows = _rows(rng, 3, 37, 656)  # two full chunks and a partial one
    ts.append(b"x", rows[:, :20])
    ts.append(b"x", rows[:, 20:])
    idx = [36, 0, 17, 16]
    code = f"""
import sys, numpy as np, cxlkv
pool = cxlkv.Pool.open({pool_path!r})
lay = cxlkv.KVLayout(model_id="tok/test", num_layers=3, tokens_per_block=16, kind="mla", dtype="uint8", head_size=656)
ts = pool.token_store(lay, max_tokens_per_seq=200)
out = np.zeros((4, 656), np.uint8)
ts.gather(b"x", 2, {idx}, out)
ts.append(b"x", np.full((3, 5, 656), 7, np.uint8))  # continues the partial chunk it found
sys.stdout.write(f"{{ts.length(b'x')}} " + out.tobytes().hex())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    length, hexrows = r.stdout.split()
    assert int(length) == 42
    np.testing.assert_array_equal(
        np.frombuffer(bytes.fromhex(hexrows), np.uint8).reshape(4, 656), rows[2, idx]
    )
    ts.release(b"x")
    assert ts.length(b"x") == 42
    out = np.full((2, 656), POISON, np.uint8)
    ts.gather(b"x", 1, [36, 41], out)
    np.testing.assert_array_equal(out[0], rows[1, 36])
    assert (out[1] == 7).all()


def test_bad_indices_dtypes_and_shapes(make_pool):
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=64)
    ts.append(b"q", np.zeros((3, 10, 656), np.uint8))
    out = np.zeros((1, 656), np.uint8)
    for bad in ([10], [-1], [2**40]):
        with pytest.raises(IndexError):
            ts.gather(b"q", 0, bad, out)
    with pytest.raises(IndexError):
        ts.gather(b"q", 3, [0], out)
    with pytest.raises(ValueError, match="integers"):
        ts.gather(b"q", 0, np.array([0.0]), out)
    with pytest.raises(ValueError, match="shape"):
        ts.gather(b"q", 0, [0, 1], out)
    with pytest.raises(ValueError, match="dtype"):
        ts.gather(b"q", 0, [0], np.zeros((1, 328), np.uint16))
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros((1, 656), np.uint8)
        ro.flags.writeable = False
        ts.gather(b"q", 0, [0], ro)
    with pytest.raises(ValueError, match="num_layers"):
        ts.gather_layers(b"q", np.zeros((2, 1), np.int64), np.zeros((2, 1, 656), np.uint8))
    with pytest.raises(ValueError, match="rows must be"):
        ts.append(b"q", np.zeros((3, 1, 655), np.uint8))
    with pytest.raises(ValueError, match="dtype"):
        ts.append(b"q", np.zeros((3, 1, 656), np.int8))
    with pytest.raises(ValueError, match="max_tokens_per_seq"):
        ts.append(b"q", np.zeros((3, 55, 656), np.uint8))
    with pytest.raises(IndexError):  # an unknown sequence has no rows
        ts.gather(b"nobody", 0, [0], out)
    assert ts.length(b"q") == 10  # nothing of the refused appends landed


def test_pins_hold_across_eviction_pressure(make_pool):
    """A reader's pins keep the sequence's blocks: filling the pool evicts others, never them."""
    rng = np.random.default_rng(_seed())
    pool = make_pool(16 * MiB, chunk_size=1 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=10_000)
    rows = _rows(rng, 3, 64, 656)
    ts.append(b"held", rows)
    out = np.full((64, 656), POISON, np.uint8)
    ts.gather(b"held", 0, np.arange(64), out)  # pins it
    filler = np.zeros((3, 64, 656), np.uint8)
    for i in range(200):  # ~26 MiB of other sequences through a 16 MiB pool
        filler[0, 0, :8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
        ts.append(f"other-{i}".encode(), filler)
    assert pool.stats()["evictions"] > 0
    out[:] = POISON
    ts.gather(b"held", 2, np.arange(64), out)
    np.testing.assert_array_equal(out, rows[2])


def test_overwritten_or_corrupt_rows_are_a_miss(make_pool, pool_path):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=100)
    rows = _rows(rng, 3, 40, 656)
    ts.append(b"c", rows)
    out = np.full((1, 656), POISON, np.uint8)
    ts.gather(b"c", 1, [20], out)
    # corrupt one byte of row (layer 1, token 20) in the pool file, under the reader's pins
    where = ts._ns.locate(ts.block_key(b"c", 1, 16))
    stride = cxlkv._core.token_block_layout(3, 16, 656)["row_stride"]  # a row's slot: row, check
    off = where["offset"] + (1 * 16 + 4) * stride + 100
    with open(pool_path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(cxlkv.SequenceMissError):
        ts.gather(b"c", 1, [3, 20], np.full((2, 656), POISON, np.uint8))
    ts.gather(b"c", 0, [20], out)  # the other rows of the block still verify
    np.testing.assert_array_equal(out[0], rows[0, 20])
    # a view whose blocks were dropped and reused under it: a miss, never the new bytes
    view = ts._view(b"c", 40)
    for lease in view.leases:
        lease.release()
    view.tail_lease.release()
    for c in range(3):
        for valid in (16, 8):
            ts._ns.delete(ts.block_key(b"c", c, valid))
    other = pool.token_store(_layout(), max_tokens_per_seq=100)
    other.append(b"d", _rows(rng, 3, 40, 656))
    with pytest.raises(cxlkv.SequenceMissError):
        ts.gather_layers(b"c", np.tile(np.arange(40), (3, 1)), np.full((3, 40, 656), POISON, np.uint8))


@pytest.fixture
def two_copy_threads():
    """Gathers of >= 1 MiB are split over the copy threads: make there be two, whatever the host."""
    before = cxlkv._core.copy_threads()
    cxlkv._core.set_copy_threads(2)
    yield
    cxlkv._core.set_copy_threads(before)


def test_a_gather_split_over_threads_is_exact_and_reports_the_first_bad_row(
    make_pool, pool_path, two_copy_threads
):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=1200)
    n = 1200
    rows = _rows(rng, 3, n, 656)
    _append_uneven(ts, b"big", rows, rng)
    # 3 layers x 1,200 rows x 656 B = 2.4 MB: past the 1 MiB from which the core splits a gather
    idx = np.stack([rng.integers(0, n, n) for _ in range(3)])
    idx[0, 0], idx[2, -1] = 0, n - 1
    out = np.full((3, n, 656), POISON, np.uint8)
    ts.gather_layers(b"big", idx, out)
    np.testing.assert_array_equal(out, rows[np.arange(3)[:, None], idx])
    shared = rng.permutation(n)  # one index list for every layer
    out = np.full((3, n, 656), POISON, np.uint8)
    ts.gather_layers(b"big", np.tile(shared, (3, 1)), out)
    np.testing.assert_array_equal(out, rows[:, shared])

    def corrupt(layer: int, token: int) -> None:
        c, t = divmod(token, 16)
        where = ts._ns.locate(ts.block_key(b"big", c, 16))
        stride = cxlkv._core.token_block_layout(3, 16, 656)["row_stride"]
        off = where["offset"] + (layer * 16 + t) * stride + 7
        with open(pool_path, "r+b") as f:
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0xFF]))

    # a bad row in the last part, then one in the first: each call names the first in row order
    order = np.tile(np.arange(n), (3, 1))
    corrupt(2, n - 5)
    with pytest.raises(cxlkv.SequenceMissError, match=f"layer 2, token {n - 5}"):
        ts.gather_layers(b"big", order, np.full((3, n, 656), POISON, np.uint8))
    corrupt(0, 9)
    with pytest.raises(cxlkv.SequenceMissError, match="layer 0, token 9"):
        ts.gather_layers(b"big", order, np.full((3, n, 656), POISON, np.uint8))


def test_placement_spreads_requests_over_devices():
    base = os.path.join(SHM_DIR, f"cxlkv-test-{uuid.uuid4().hex}")
    paths = [f"{base}-d{k}" for k in range(3)]
    try:
        pool = cxlkv.Pool.create(paths, 48 * MiB, chunk_size=1 * MiB, stripe_size=4 * MiB)
        ts = pool.token_store(_layout(tokens_per_block=8), max_tokens_per_seq=64)
        seen = {}
        for r in range(6):
            seq = f"request-{r}".encode()
            ts.append(seq, np.full((3, 30, 656), r, np.uint8))
            devices = {ts._ns.locate(ts.block_key(seq, c, 8))["device"] for c in range(3)}
            devices.add(ts._ns.locate(ts.block_key(seq, 3, 6))["device"])
            assert len(devices) == 1, f"request {r} spans devices {devices}"
            seen[r] = devices.pop()
            assert seen[r] == ts.device_of(seq)
        assert sorted(seen.values()) == [0, 0, 1, 1, 2, 2]
        out = np.zeros((2, 656), np.uint8)
        ts.gather(b"request-4", 2, [29, 0], out)
        assert (out == 4).all()
        pool.close()
    finally:
        for p in paths:
            _remove(p)


def test_private_gather_reference_is_exact_and_bounded():
    """`bench sparse`'s private baseline (a C loop of row copies): rows[indices], any order and
    duplicates; an index out of range is an IndexError before any copy."""
    rng = np.random.default_rng(_seed())
    rows = rng.integers(0, 256, (50, 656), dtype=np.uint8)
    idx = np.array([49, 0, 7, 7, 23], np.int64)
    out = np.full((5, 656), POISON, np.uint8)
    cxlkv._core.rows_gather_private(rows, 656, idx, out)
    np.testing.assert_array_equal(out, rows[idx])
    out[:] = POISON
    with pytest.raises(IndexError):
        cxlkv._core.rows_gather_private(rows, 656, np.array([3, 50], np.int64), out[:2])
    assert (out == POISON).all()


def test_an_append_of_no_tokens_is_refused(make_pool):
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=64)
    ts.append(b"z", np.zeros((3, 2, 656), np.uint8))
    with pytest.raises(ValueError):
        ts.append(b"z", np.zeros((3, 0, 656), np.uint8))
    with pytest.raises(ValueError):
        ts.append(b"new", np.zeros((3, 0, 656), np.uint8))
    assert ts.length(b"z") == 2 and ts.length(b"new") == 0


RACE_LAYOUT = dict(
    model_id="tok/race", num_layers=2, tokens_per_block=16, kind="mla", dtype="uint8", head_size=64
)
RACE_TOKENS = 2500
RACE_SEQS = 8


def _race_row(seq: int, pos, layer):
    return (pos * 7 + layer + seq) % 251


def test_gather_sees_every_token_length_reported_under_concurrent_appends(make_pool, pool_path):
    """A writer process appends one token at a time (every append supersedes a partial version,
    every 16th completes a chunk) while this process asks length() and gathers the last token it
    reported: never an IndexError, always the written row. Before the fix a refresh could pass
    the next version before it was put and reach the old one after it was deleted (3 of 1,047
    gathers failed)."""
    pool = make_pool(64 * MiB)
    ts = pool.token_store(cxlkv.KVLayout(**RACE_LAYOUT), max_tokens_per_seq=RACE_TOKENS)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import numpy as np, cxlkv
pool = cxlkv.Pool.open({pool_path!r})
ts = pool.token_store(cxlkv.KVLayout(**{RACE_LAYOUT!r}), max_tokens_per_seq={RACE_TOKENS})
for s in range({RACE_SEQS}):
    for n in range({RACE_TOKENS}):
        rows = np.empty((2, 1, 64), np.uint8)
        rows[:, 0, :] = ((n * 7 + np.arange(2) + s) % 251)[:, None]
        ts.append(b"seq%d" % s, rows)
""",
        ]
    )
    out = np.zeros((1, 64), np.uint8)
    gathers = lengths = 0
    try:
        s = 0  # the sequence being written: the writer fills them in order
        while writer.poll() is None and s < RACE_SEQS:
            seq = b"seq%d" % s
            n = ts.length(seq)
            lengths += 1
            if n == RACE_TOKENS:
                s += 1
            elif n:
                ts.gather(seq, 1, [n - 1], out)  # IndexError here was the bug
                assert (out == _race_row(s, n - 1, 1)).all()
                gathers += 1
                if gathers % 16 == 0:
                    assert ts.length(seq) >= n  # never shrinks under appends
        assert writer.wait(timeout=120) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    print(f"{gathers} gathers, {lengths} lengths during the appends")
    assert gathers > 100
    for s in range(RACE_SEQS):
        seq = b"seq%d" % s
        assert ts.length(seq) == RACE_TOKENS
        idx = np.arange(RACE_TOKENS)
        full = np.zeros((RACE_TOKENS, 64), np.uint8)
        ts.gather(seq, 0, idx, full)
        assert (full == _race_row(s, idx, 0)[:, None]).all()


def test_numpy_bfloat16_of_ml_dtypes_in_every_call(make_pool):
    """numpy has no bfloat16; ml_dtypes' is an extension dtype the extension's array type does not
    know: append, gather and gather_layers take it as they take torch.bfloat16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(kind="mla", dtype="bf16", head_size=8, num_layers=2), max_tokens_per_seq=64)
    bits = _rows(rng, 2, 21, 8, np.uint16)
    rows = bits.view(ml_dtypes.bfloat16)
    assert ts.append(b"b", rows) == 21
    out = np.zeros((3, 8), ml_dtypes.bfloat16)
    ts.gather(b"b", 1, [20, 0, 5], out)
    np.testing.assert_array_equal(out.view(np.uint16), bits[1, [20, 0, 5]])
    both = np.zeros((2, 2, 8), ml_dtypes.bfloat16)
    ts.gather_layers(b"b", np.array([[3, 4], [19, 1]]), both)
    np.testing.assert_array_equal(both[1].view(np.uint16), bits[1, [19, 1]])
    with pytest.raises(ValueError):  # another 2-byte dtype is still refused
        ts.gather(b"b", 1, [0], np.zeros((1, 8), np.float16))


@pytest.mark.parametrize(
    "dtype, ml_name",
    [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("fp8_e4m3fnuz", "float8_e4m3fnuz")],
)
def test_numpy_fp8_of_ml_dtypes_in_every_call(make_pool, dtype, ml_name):
    """The same for ml_dtypes' fp8 types (numpy has none either): each is its layout dtype's alias
    in the core's table, so append, gather and gather_layers take it; another fp8 is refused."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    mt = getattr(ml_dtypes, ml_name)
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(kind="mla", dtype=dtype, head_size=8, num_layers=2), max_tokens_per_seq=64)
    bits = _rows(np.random.default_rng(_seed()), 2, 19, 8)
    assert ts.append(b"f", bits.view(mt)) == 19
    out = np.zeros((2, 8), mt)
    ts.gather(b"f", 0, [18, 2], out)
    np.testing.assert_array_equal(out.view(np.uint8), bits[0, [18, 2]])
    both = np.zeros((2, 1, 8), mt)
    ts.gather_layers(b"f", np.array([[7], [11]]), both)
    np.testing.assert_array_equal(both[1].view(np.uint8), bits[1, [11]])
    other = ml_dtypes.float8_e5m2 if ml_name != "float8_e5m2" else ml_dtypes.float8_e4m3fn
    with pytest.raises(ValueError):  # same shape and size: only the dtype is wrong
        ts.append(b"f", bits.view(other))
    assert ts.length(b"f") == 19  # nothing stored
