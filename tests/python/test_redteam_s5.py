"""Red-team regressions for what landed in session 5 (token store, hot buffer, row kernels, the
LMCache/SGLang identity). Each test reproduces one finding (see its docstring); each failed before
its fix. The pool is attacked through its file, as a co-tenant with write access would."""

from __future__ import annotations

import os

import numpy as np
import pytest

import cxlkv
from conftest import MiB

LAYOUT = dict(
    model_id="rt5/test", num_layers=3, tokens_per_block=16, kind="mla", dtype="uint8", head_size=656
)


def _layout() -> cxlkv.KVLayout:
    return cxlkv.KVLayout(**LAYOUT)


def _rows(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (3, n, 656), dtype=np.uint8)


def _flip(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))


def test_corrupt_header_of_a_full_chunk_is_a_miss_and_leaks_no_pins(make_pool, pool_path):
    """F1: one flipped bit in the header of a full chunk in the middle of a sequence made every
    gather past it an IndexError ("the sequence has 16 tokens": a caller bug, not a miss) and
    each such gather pinned the chunks after it again without releasing them (unbounded pins)."""
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=200)
    ts.append(b"c", _rows(40))
    geo = cxlkv._core.token_block_layout(3, 16, 656)
    where = ts._ns.locate(ts.block_key(b"c", 1, 16))
    _flip(pool_path, where["offset"] + geo["header_off"] + 60)
    reader = cxlkv.Pool.open(pool_path).token_store(_layout(), max_tokens_per_seq=200)
    try:
        for _ in range(4):
            with pytest.raises(cxlkv.SequenceMissError):
                reader.gather(b"c", 0, [35], np.zeros((1, 656), np.uint8))
            assert b"c" not in reader._views  # a miss drops the view and its pins
        out = np.zeros((1, 656), np.uint8)
        reader.gather(b"c", 2, [3], out)  # chunk 0 still verifies
        np.testing.assert_array_equal(out[0], _rows(40)[2, 3])
    finally:
        reader.close()


def test_resume_never_reseals_an_unverified_partial_chunk(make_pool, pool_path):
    """F2: an append that continues a sequence another process left with a partial chunk copied
    that chunk's bytes from the pool without checking them and sealed them with fresh row hashes:
    a co-tenant's block of garbage under the partial-chunk key became verified rows."""
    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=200)
    forged = np.full(ts.block_bytes, 0x66, np.uint8)  # no header, no row hashes
    assert ts._ns.put(ts.block_key(b"v", 0, 3), forged)
    writer = cxlkv.Pool.open(pool_path).token_store(_layout(), max_tokens_per_seq=200)
    try:
        with pytest.raises(cxlkv.SequenceMissError):
            writer.append(b"v", np.full((3, 1, 656), 9, np.uint8))
        assert not ts._ns.contains(ts.block_key(b"v", 0, 4))  # nothing sealed over the forgery
        # a genuine partial chunk still resumes
        ts.append(b"ok", _rows(5))
        assert writer.append(b"ok", _rows(2, seed=2)) == 7
    finally:
        writer.close()


def test_two_appenders_of_one_sequence_conflict_instead_of_diverging(make_pool, pool_path):
    """F3: two handles (processes) appending to one sequence: the second one's put of an existing
    key was a silent no-op (its rows lost, its reads returned the other writer's rows), and a
    writer whose idea of the length was stale published versions that disagreed with the pool."""
    pool = make_pool(64 * MiB)
    a = pool.token_store(_layout(), max_tokens_per_seq=200)
    b = cxlkv.Pool.open(pool_path).token_store(_layout(), max_tokens_per_seq=200)
    try:
        a.append(b"s", np.full((3, 3, 656), 1, np.uint8))
        b.append(b"s", np.full((3, 1, 656), 2, np.uint8))  # b continues a's partial chunk: 4
        with pytest.raises(cxlkv.SequenceConflictError):
            a.append(b"s", np.full((3, 2, 656), 3, np.uint8))  # a still believes 3 tokens
        b2 = cxlkv.Pool.open(pool_path).token_store(_layout(), max_tokens_per_seq=200)
        assert b2.append(b"s", np.full((3, 12, 656), 5, np.uint8)) == 16  # 4 -> 16 ...
        with pytest.raises(cxlkv.SequenceConflictError):  # same key (s, 0, 16), other bytes
            b.append(b"s", np.full((3, 12, 656), 6, np.uint8))  # ... and again from 4
        assert a.length(b"s") == 16
        out = np.zeros((1, 656), np.uint8)
        a.gather(b"s", 0, [10], out)
        assert (out == 5).all()
        assert a.append(b"s", np.full((3, 1, 656), 7, np.uint8)) == 17  # resynced from the pool
    finally:
        b.close()


def test_hot_buffer_refuses_an_out_it_cannot_write(make_pool):
    """F4: HotBuffer.step with a non-contiguous numpy ``out`` of the right shape returned without
    writing it (np.take wrote into a reshaped copy): the caller read stale rows as the step's."""
    from cxlkv.integrations.hot_buffer import HotBuffer

    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=64)
    ts.append(b"h", _rows(40))
    hb = HotBuffer(ts, b"h", 8)
    out = np.zeros((3, 656, 3), np.uint8).transpose(0, 2, 1)
    with pytest.raises(ValueError, match="contiguous"):
        hb.step(np.array([[1, 2, 3]] * 3), out)
    with pytest.raises(ValueError, match="integers"):
        hb.step(np.array([[1.9, 2, 3]] * 3), np.zeros((3, 3, 656), np.uint8))
    good = np.zeros((3, 3, 656), np.uint8)
    hb.step(np.array([[1, 2, 3]] * 3), good)
    np.testing.assert_array_equal(good, _rows(40)[:, [1, 2, 3]])


def test_row_kernels_refuse_operands_on_different_devices():
    """F5: gather_rows/scatter_rows checked dtypes, shapes and index range but not devices: a CUDA
    buffer with host indices (or a host out) hands a host pointer to a Triton kernel (a wild
    device read). Shown with the meta device, which every torch build has."""
    torch = pytest.importorskip("torch")
    from cxlkv.kernels.rows import gather_rows, scatter_rows

    src = torch.zeros((4, 8), dtype=torch.uint8, device="meta")
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="device"):
        gather_rows(src, idx, torch.zeros((2, 8), dtype=torch.uint8))
    with pytest.raises(ValueError, match="device"):
        scatter_rows(torch.zeros((2, 8), dtype=torch.uint8), idx, src)


def test_external_identity_follows_an_edited_config(tmp_path):
    """F6: weights_of (LMCache/SGLang identity) cached the digest under a stamp of the weight
    files only: a long-running LMCache server kept the identity of a model directory whose
    config.json had been edited (other computation, same weights): two configs, one namespace."""
    from cxlkv.integrations.external_identity import weights_of

    (tmp_path / "model.bin").write_bytes(os.urandom(4096))
    (tmp_path / "config.json").write_text('{"rope_theta": 10000}')
    before = weights_of(str(tmp_path))[0]
    (tmp_path / "config.json").write_text('{"rope_theta": 500000}')
    assert weights_of(str(tmp_path))[0] != before


def test_lmcache_batch_resolves_the_model_once(tmp_path, pool_path, monkeypatch):
    """F7: the LMCache adapter resolved and stat-ed the model's weights (weights_of) once per KEY:
    with a 50-file checkpoint about 1 ms each, so a 256-key batch spent ~0.25 s of its worker
    thread on stat() alone. Now once per (model, rank, group) of a batch. (Since s6-harden the
    server no longer resolves names: the key carries the engine's identity, lmcache_identity.py;
    it is still parsed once per batch.)"""
    import select

    from cxlkv.integrations import lmcache as lm
    from cxlkv.integrations.external_identity import weights_of
    from cxlkv.integrations.lmcache_identity import model_token

    (tmp_path / "model.bin").write_bytes(os.urandom(4096))
    (tmp_path / "config.json").write_text("{}")
    token = model_token({"weights": weights_of(str(tmp_path))[0]})
    calls = []
    real = lm.weights_of_model_field
    monkeypatch.setattr(lm, "weights_of_model_field", lambda ref: calls.append(ref) or real(ref))
    cxlkv.Pool.create(pool_path, 64 * MiB, chunk_size=MiB).close()
    conn = lm.CxlKVL2Connector(pool_path=pool_path)
    try:
        keys = [f"{token}@0@0@{i:064x}" for i in range(64)]
        bufs = [bytearray(os.urandom(1024)) for _ in keys]
        fid = conn.submit_batch_set(keys, [memoryview(b) for b in bufs])
        done: list = []
        while not done:
            select.select([conn.event_fd()], [], [], 10)
            done = [d for d in conn.drain_completions() if d[0] == fid]
        assert done[0][1], done
        assert len(calls) == 1
        got = [bytearray(1024) for _ in keys]
        fid = conn.submit_batch_get(keys, [memoryview(b) for b in got])
        done = []
        while not done:
            select.select([conn.event_fd()], [], [], 10)
            done = [d for d in conn.drain_completions() if d[0] == fid]
        assert done[0][3] == [True] * 64 and got == bufs
    finally:
        conn.close()


def test_fractional_layers_positions_and_duplicate_scatter_rows_are_refused(make_pool):
    """F8: gather_raw took layer 1.7 as layer 1; HotBuffer.put_newest took position 2.5 and left
    its two maps disagreeing (slot 0 said token 2, the token map said nothing) before numpy
    raised; scatter_rows documented "one of the duplicates wins" while Triton programs writing one
    row interleave their 256-B pieces (a row mixing two sources)."""
    from cxlkv.integrations.hot_buffer import HotBuffer

    pool = make_pool(64 * MiB)
    ts = pool.token_store(_layout(), max_tokens_per_seq=64)
    ts.append(b"f", _rows(20))
    with pytest.raises(TypeError, match="layer"):
        ts.gather_raw(b"f", 1.7, [0], np.zeros((1, 656), np.uint8))
    hb = HotBuffer(ts, b"f", 4)
    with pytest.raises(TypeError, match="position"):
        hb.put_newest(2.5, np.zeros((3, 656), np.uint8))
    assert (hb.slot_token == -1).all() and (hb.token_slot == -1).all()
    torch = pytest.importorskip("torch")
    from cxlkv.kernels.rows import scatter_rows

    with pytest.raises(ValueError, match="duplicate"):
        scatter_rows(
            torch.zeros((2, 8), dtype=torch.uint8),
            torch.tensor([1, 1]),
            torch.zeros((4, 8), dtype=torch.uint8),
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs with huge=always (needs root)")
def test_huge_page_rounding_names_the_size_asked_for(tmp_path):
    """F9: on a tmpfs that gives huge pages, a 3 MiB + 5 B pool is rounded down to 2 MiB and then
    refused as "pool size 2097152 is too small": the error named a size the operator never typed."""
    import subprocess

    d = tmp_path / "huge"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,huge=always", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(ValueError, match=r"3145733 bytes asked for, rounded down"):
            cxlkv.Pool.create(str(d / "pool"), (3 << 20) + 5, chunk_size=MiB)
        assert os.listdir(d) == []
    finally:
        subprocess.run(["umount", str(d)])
