"""The HiSparse-style hot buffer (python/cxlkv/integrations/hot_buffer.py) and the Triton row
kernels (python/cxlkv/kernels/rows.py): steps give exactly the pool's rows (outputs pre-filled
with poison, fresh seeds printed), only missing rows are fetched, LRU keeps what was used last, the
newest token's reserved slot never costs a fetch, and the counters add up. The kernels are checked
bit-exact under TRITON_INTERPRET=1 on CPU tensors (in a subprocess: the flag is read at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cxlkv
from conftest import MiB
from cxlkv.integrations.hot_buffer import HotBuffer

POISON = 0x5A


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


def _store(pool, layers=2, row=656, tokens=300):
    lay = cxlkv.KVLayout(
        "hot/test", dtype="uint8", kind="mla", num_layers=layers, head_size=row, tokens_per_block=16
    )
    return pool.token_store(lay, max_tokens_per_seq=tokens)


def _expect(rows, idx):
    return rows[np.arange(idx.shape[0])[:, None], idx]


def test_steps_exact_and_accounting(make_pool):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = _store(pool)
    n = 200
    rows = rng.integers(0, 256, (2, n, 656), dtype=np.uint8)
    ts.append(b"r", rows)
    hb = HotBuffer(ts, b"r", capacity=9)
    idx = np.array([[0, 5, 5, 199], [7, 3, 2, 1]])  # duplicates, unsorted, first and last
    out = np.full((2, 4, 656), POISON, np.uint8)
    hb.step(idx, out)
    np.testing.assert_array_equal(out, _expect(rows, idx))
    c = dict(hb.counters)
    assert c["hits"] == 0 and c["misses"] == 8 and c["rows_fetched"] == 7  # token 5 fetched once
    assert c["bytes_from_pool"] == 7 * 656 and c["bytes_out"] == 8 * 656
    out[:] = POISON
    hb.step(idx, out)  # the same top-k again: all hits, nothing moved from the pool
    np.testing.assert_array_equal(out, _expect(rows, idx))
    assert hb.counters["hits"] == 8 and hb.counters["rows_fetched"] == 7
    # random steps: always exact; fetched rows == misses minus duplicates
    for _ in range(30):
        idx = np.stack([rng.choice(n, 6, replace=True) for _ in range(2)])
        out = np.full((2, 6, 656), POISON, np.uint8)
        before = dict(hb.counters)
        hb.step(idx, out)
        np.testing.assert_array_equal(out, _expect(rows, idx))
        assert hb.counters["hits"] + hb.counters["misses"] - before["hits"] - before["misses"] == 12
        assert (
            hb.counters["rows_fetched"] - before["rows_fetched"] <= hb.counters["misses"] - before["misses"]
        )
    assert 0 < hb.hit_rate() < 1


def test_lru_keeps_recent_rows_and_newest_slot(make_pool):
    rng = np.random.default_rng(_seed())
    pool = make_pool(64 * MiB)
    ts = _store(pool, layers=1)
    rows = rng.integers(0, 256, (1, 50, 656), dtype=np.uint8)
    ts.append(b"s", rows[:, :49])
    hb = HotBuffer(ts, b"s", capacity=4)  # 3 LRU slots + the newest token's
    out = np.zeros((1, 3, 656), np.uint8)
    hb.step(np.array([[1, 2, 3]]), out)
    hb.step(np.array([[1, 2, 4]]), out)  # 3 is least recently used: replaced by 4
    assert set(hb.slot_token[0, 1:]) == {1, 2, 4}
    fetched = hb.counters["rows_fetched"]
    # token 49 is produced by this step: it goes to the reserved slot and is never fetched
    ts.append(b"s", rows[:, 49:])
    hb.put_newest(49, rows[:, 49])
    hb.step(np.array([[49, 1, 2]]), out)
    np.testing.assert_array_equal(out[0], rows[0, [49, 1, 2]])
    assert hb.counters["rows_fetched"] == fetched and hb.slot_token[0, 0] == 49
    with pytest.raises(ValueError, match="capacity"):
        hb.step(np.array([[1, 2, 3, 4]]), np.zeros((1, 4, 656), np.uint8))
    with pytest.raises(IndexError):
        hb.step(np.array([[1, 2, 300]]), out)


def test_pool_errors_leave_the_buffer_consistent(make_pool):
    pool = make_pool(64 * MiB)
    ts = _store(pool, layers=1)
    ts.append(b"e", np.ones((1, 20, 656), np.uint8))
    hb = HotBuffer(ts, b"e", capacity=8)
    out = np.zeros((1, 2, 656), np.uint8)
    with pytest.raises(IndexError):  # token 25 is not written yet
        hb.step(np.array([[1, 25]]), out)
    assert (hb.token_slot[0, [1, 25]] == -1).all()
    hb.step(np.array([[1, 19]]), out)
    assert (out == 1).all()


KERNEL_CHECK = r"""
import os, sys, torch
assert os.environ["TRITON_INTERPRET"] == "1"
from cxlkv.kernels.rows import gather_rows, scatter_rows
g = torch.Generator().manual_seed(int(sys.argv[2]))
for dtype, width in ((torch.uint8, 656), (torch.bfloat16, 576), (torch.float32, 33)):
    src = torch.randint(0, 256, (37, width * torch.tensor([], dtype=dtype).element_size()), generator=g,
                        dtype=torch.uint8).view(dtype)
    for idx in (torch.tensor([0]), torch.tensor([36, 0, 0, 5]),
                torch.randint(0, 37, (9,), generator=g, dtype=torch.int32)):
        out = torch.full((len(idx), src.shape[1]), 0x5A, dtype=torch.uint8).view(dtype) if dtype == torch.uint8 \
            else torch.full((len(idx), src.shape[1]), float("nan"), dtype=dtype)
        gather_rows(src, idx, out)
        assert torch.equal(out.view(torch.uint8), src[idx.long()].view(torch.uint8)), (dtype, idx)
    perm = torch.randperm(37, generator=g)[:8]
    dst = torch.zeros_like(src)
    rows = src[:8].clone()
    scatter_rows(rows, perm, dst)
    assert torch.equal(dst[perm].view(torch.uint8), rows.view(torch.uint8))
    untouched = torch.ones(37, dtype=torch.bool); untouched[perm] = False
    assert (dst[untouched].view(torch.uint8) == 0).all()
for bad in (torch.tensor([37]), torch.tensor([-1])):
    try:
        gather_rows(src, bad, torch.empty((1, src.shape[1]), dtype=src.dtype))
    except IndexError:
        pass
    else:
        raise AssertionError("out-of-range index accepted")
print("kernels exact")
"""


HOT_TORCH = r"""
import os, sys, uuid, numpy as np, torch, cxlkv
from cxlkv.integrations.hot_buffer import HotBuffer
path = sys.argv[1]
pool = cxlkv.Pool.create(path, 32 << 20, chunk_size=1 << 20)
lay = cxlkv.KVLayout("hot/torch", dtype="bf16", kind="mla", num_layers=2, head_size=576, tokens_per_block=16)
ts = pool.token_store(lay, max_tokens_per_seq=100)
rng = np.random.default_rng(int(sys.argv[2]))
rows = rng.integers(0, 256, (2, 80, 1152), dtype=np.uint8)
ts.append(b"t", torch.from_numpy(rows).view(torch.bfloat16))
hb = HotBuffer(ts, b"t", capacity=6, device="cpu")
for _ in range(4):
    idx = np.stack([rng.choice(80, 4) for _ in range(2)])
    out = torch.full((2, 4, 1152), 0x5A, dtype=torch.uint8)
    hb.step(idx, out)
    assert np.array_equal(out.numpy(), rows[np.arange(2)[:, None], idx])
print("hot torch exact", hb.counters["hits"], hb.counters["misses"])
pool.close()
"""


def test_triton_kernels_exact_and_hot_buffer_on_torch_under_interpreter(pool_path):
    """One subprocess (TRITON_INTERPRET is read at import; torch and triton load once): the row
    kernels bit-exact on random rows and indices, then a torch-backed hot buffer moved by them."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    seed = _seed()
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = KERNEL_CHECK + HOT_TORCH
    r = subprocess.run(
        [sys.executable, "-c", code, pool_path, str(seed)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernels exact" in r.stdout and "hot torch exact" in r.stdout
