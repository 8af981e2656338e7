"""CudaTransfer (integrations/transfer_cuda.py) on CPU tensors under Triton's interpreter: the
connector's device path against the core's CPU path on the same blocks, both ways, direct and
staged; and the CUDA registration's failure handling with a fake of the CUDA runtime calls."""

from __future__ import annotations

import logging
import os
import random
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # for the import of kernels/paged.py only (test_paged_kernels)

from conftest import small_layout  # noqa: E402
from cxlkv.integrations import cuda_registration as reg  # noqa: E402
from cxlkv.integrations.pool_session import PoolSession  # noqa: E402
from cxlkv.integrations.transfer_cuda import CudaTransfer  # noqa: E402

if _before is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _before


def BlockOp(req_id, keys, block_ids, start_depth=0):
    # (importing vllm for its dataclass costs seconds of CI)
    return types.SimpleNamespace(req_id=req_id, keys=keys, block_ids=block_ids, start_depth=start_depth)


LAYERS, NB, BS, H, D = 2, 9, 4, 2, 8
SHAPES = {"cuda": ((2, NB, BS, H, D), 1), "cpu": ((NB, 2, H, BS, D), 0)}
BB = LAYERS * 2 * BS * H * D * 2  # bf16


def kv(shape, seed=None, poison=False):
    g = torch.Generator().manual_seed(seed or 0)
    n = torch.Size(shape).numel() * 2
    out = []
    for _ in range(LAYERS):
        raw = (
            torch.full((n,), 0xA5, dtype=torch.uint8)
            if poison
            else torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        )
        out.append(raw.view(torch.bfloat16).reshape(shape))
    return out


def session_on(pool, ns):
    return PoolSession(pool.path, logging.getLogger("test"), lambda create: pool, lambda p: ns)


def blocks_equal(a, b, block_dim, ids):
    idx = lambda i: (slice(None),) * block_dim + (i,)  # noqa: E731
    return all(
        torch.equal(x[idx(i)].view(torch.uint8), y[idx(i)].view(torch.uint8))
        for x, y in zip(a, b, strict=False)
        for i in ids
    )


@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
def test_device_path_and_cpu_path_share_blocks_both_ways(make_pool, layout, staging):
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    shape, block_dim = SHAPES[layout]
    pool = make_pool()
    ns = pool.namespace(small_layout(block_bytes=BB))
    src = kv(shape, seed)
    ids = [0, 4, NB - 1]
    keys = [os.urandom(32) for _ in ids]

    # CPU path stores -> device path loads into poisoned blocks
    assert ns.store(keys, src, ids, block_dim=block_dim) == 3
    dst = kv(shape, poison=True)
    t = CudaTransfer(session_on(pool, ns), dst, block_dim, BB, staging=staging)
    load_ids = [2, 8, 5]
    assert t.load(BlockOp("r1", keys, load_ids)) == 3
    for i, j in zip(ids, load_ids, strict=False):
        assert blocks_equal(
            [a.narrow(block_dim, i, 1) for a in src], [b.narrow(block_dim, j, 1) for b in dst], block_dim, [0]
        )

    # device path saves -> CPU path loads
    keys2 = [os.urandom(32) for _ in ids]
    h = t.submit_save(BlockOp("r2", keys2, load_ids, start_depth=3))
    assert h.result() == 3 and h.done()
    back = kv(shape, poison=True)
    assert ns.load(keys2, back, ids, block_dim=block_dim) == 3
    for i, j in zip(ids, load_ids, strict=False):
        assert blocks_equal(
            [a.narrow(block_dim, j, 1) for a in dst],
            [b.narrow(block_dim, i, 1) for b in back],
            block_dim,
            [0],
        )
    assert t.submit_save(BlockOp("r2", keys2, load_ids)).result() == 3  # present: nothing rewritten
    t.close()
    assert pool.check()["ok"]


def test_a_corrupt_block_is_a_miss_on_the_device_path(make_pool):
    shape, block_dim = SHAPES["cuda"]
    pool = make_pool()
    ns = pool.namespace(small_layout(block_bytes=BB))
    src = kv(shape, 7)
    keys = [os.urandom(32) for _ in range(3)]
    assert ns.store(keys, src, [0, 1, 2], block_dim=block_dim) == 3
    view = pool.transfer_view()
    view[ns.locate(keys[1])["offset"] + 3] ^= 0x10
    t = CudaTransfer(session_on(pool, ns), kv(shape, poison=True), block_dim, BB)
    assert t.load(BlockOp("r", keys, [3, 4, 5])) == 1
    assert not ns.contains(keys[1])
    t.close()


class FakeCuda:
    """The CUDA runtime calls of registration, with their return codes: fail_at names the range
    whose cudaHostRegister fails (with cudaErrorHostMemoryAlreadyRegistered, 712), and the sticky
    error stays set until cudaGetLastError reads it, as CUDA does."""

    def __init__(self, fail_at=None, uva=True, same_pointer=True):
        self.fail_at, self.uva, self.same_pointer = fail_at, uva, same_pointer
        self.registered: list[int] = []
        self.calls = 0
        self.sticky = 0

    def can_use_host_pointer(self):
        return self.uva

    def host_register(self, addr, size, flags):
        assert flags == reg.HOST_REGISTER_MAPPED | reg.HOST_REGISTER_PORTABLE
        assert size <= self.max_size
        self.calls += 1
        if self.calls == self.fail_at or addr in self.registered:  # 712: already registered
            self.sticky = 712
            return 712
        self.registered.append(addr)
        return 0

    def host_unregister(self, addr):
        self.registered.remove(addr)
        return 0

    def get_last_error(self):
        e, self.sticky = self.sticky, 0
        return e

    def device_pointer(self, addr):
        return 0, addr if self.same_pointer else addr + 4096

    def error_name(self, code):
        return f"cudaError{code}"


def _max(pool):
    return (pool.info()["arena_off"] + (3 << 20)) // 4096 * 4096


def test_registration_in_ranges_and_its_failures(make_pool, caplog):
    pool = make_pool()
    most = _max(pool)
    ok = FakeCuda()
    ok.max_size = most
    r = reg.register_pool(pool, ok, background=True, max_range_bytes=most)
    assert r.wait(30) and r.registered and len(ok.registered) == ok.calls > 3
    r.close()
    assert ok.registered == [] and not r.registered

    for fake, why in (
        (FakeCuda(fail_at=3), "cudaError712"),
        (FakeCuda(uva=False), "no UVA"),
        (FakeCuda(same_pointer=False), "device pointer"),
    ):
        fake.max_size = most
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.cxlkv"):
            r = reg.register_pool(pool, fake, background=False, max_range_bytes=most)
        assert r.state == "failed" and not r.registered and why in r.reason
        assert fake.registered == [] and fake.sticky == 0  # all undone, sticky error cleared
        assert sum("CPU staging path" in m for m in caplog.messages) == 1


def test_one_mapping_is_registered_once_for_all_its_transfers(make_pool):
    """A worker builds one CudaTransfer per KV cache group (hybrid models) and per local head or
    state unit (TP > 1), each registering the pool: the second cudaHostRegister of a range fails
    (already registered), so they share one registration, and the last one to close unregisters."""
    pool = make_pool()
    cuda = FakeCuda()
    cuda.max_size = _max(pool)
    a = reg.register_pool(pool, cuda, background=False, max_range_bytes=cuda.max_size)
    b = reg.register_pool(pool, cuda, background=False, max_range_bytes=cuda.max_size)
    ranges = len(pool.transfer_ranges(cuda.max_size))
    assert a.registered and b.registered and cuda.calls == ranges == len(cuda.registered)
    a.close()
    a.close()  # a second close of one hold changes nothing
    assert b.registered and len(cuda.registered) == ranges
    b.close()
    assert cuda.registered == [] and not b.registered
    c = reg.register_pool(pool, cuda, background=False, max_range_bytes=cuda.max_size)  # afresh
    assert c.registered and cuda.calls == 2 * ranges
    c.close()
    assert cuda.registered == []


def test_without_cuda_the_registration_fails_with_a_reason(make_pool, monkeypatch):
    pool = make_pool()
    monkeypatch.setattr(reg, "_find_cudart", lambda: (_ for _ in ()).throw(OSError("libcudart not found")))
    r = reg.register_pool(pool, background=False)
    assert r.state == "failed" and "libcudart" in r.reason


def test_the_gpu_bench_logic_runs_on_cpu():
    """scripts/gpu-check.sh's bandwidth bench, on CPU tensors: it runs and checks the layout."""
    from cxlkv.tools import bench_cuda

    r = bench_cuda.run("cpu", blocks=3, small=True, iters=1)
    assert r["layout_matches_cpu_path"] is True
    for k in ("gpu_to_pool", "pool_to_gpu"):
        assert {
            "kernel_gbps",
            "memcpy_gbps",
            "per_fragment_gbps",
            "kernel_vs_memcpy",
            "kernel_vs_per_fragment",
        } <= set(r[k])


def test_per_head_device_path_reads_what_the_cpu_path_wrote_at_another_tp(make_pool):
    """The CUDA path of per-head entries (heads.PerHeadTransfer: a CudaTransfer per local head over
    that head's views, flash attention's strided layout): a TP=2 rank loads its head of blocks the
    CPU path wrote at TP=1, and what it saves is what the CPU path of TP=1 reads back."""
    import cxlkv
    from cxlkv.integrations.heads import HeadNamespace, HeadPlan, PerHeadTransfer

    shape, block_dim = SHAPES["cuda"]  # [2, blocks, block_size, heads, head_size]
    pool = make_pool()
    layout = cxlkv.KVLayout(
        model_id="test/per-head",
        dtype="bf16",
        num_layers=LAYERS,
        num_kv_heads=H,
        head_size=D,
        tokens_per_block=BS,
        heads_per_entry=1,
    )
    entry = BB // H
    whole = HeadNamespace(pool.namespace(layout), HeadPlan(H), 3)
    src = kv(shape, 7)
    ids, keys = [1, 6], [os.urandom(32) for _ in range(2)]
    assert whole.store(keys, src, ids, block_dim=block_dim) == 2
    plan = HeadPlan(H, 2, 1)  # rank 1 of TP=2: head 1, its own one-head arrays
    mine = [a[:, :, :, 1:2].contiguous() for a in kv(shape, poison=True)]
    ns1 = HeadNamespace(pool.namespace(layout), plan, 3)
    t = PerHeadTransfer(session_on(pool, ns1), mine, block_dim, entry, 3, plan, CudaTransfer)
    assert t.load(BlockOp("r", keys, [3, 0])) == 2
    for i, j in zip(ids, [3, 0], strict=True):
        for a, b in zip(src, mine, strict=True):
            assert torch.equal(a[:, i, :, 1].view(torch.uint8), b[:, j, :, 0].view(torch.uint8))
    keys2 = [os.urandom(32) for _ in range(2)]
    assert t.submit_save(BlockOp("s", keys2, [3, 0])).result() == 2
    # head 0 of keys2 was never written (rank 0 did not save): no hit for a TP-agnostic lookup
    assert whole.match_prefix(keys2) == 0
    back = kv(shape, poison=True)
    got = [a[:, :, :, 1:2].contiguous() for a in back]
    assert ns1.load(keys2, got, [5, 7], block_dim=block_dim) == 2  # the CPU path reads rank 1's head
    for a, b in zip(mine, got, strict=True):
        assert torch.equal(a[:, 3].view(torch.uint8), b[:, 5].view(torch.uint8))
    t.close()
    assert pool.check()["ok"]


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_state_units_device_path_matches_the_cpu_path_across_tp(make_pool, conv_layout):
    """The CUDA path of a state group's unit entries (what vllm_worker builds for an SSM /
    linear-attention group on a GPU: a PerHeadTransfer of CudaTransfers over state_shards.unit_views,
    bf16 conv and fp32 SSM states in one entry): a TP=2 rank loads its units of states the CPU path
    stored at TP=1, byte-equal to what the CPU path of that rank loads, and the states both TP=2
    ranks save through it are what the CPU path of TP=1 reads back."""
    import cxlkv
    from cxlkv.integrations import state_shards as ss
    from cxlkv.integrations.heads import PerHeadTransfer
    from cxlkv.testing.layouts import state_units_layout

    nk, nv, hk, hv, kernel, nb = 4, 8, 4, 3, 4, 6  # two units on each TP=2 rank
    sh = ss.gdn_shards(nk, nv, hk, hv, kernel, conv_layout)
    layout = cxlkv.KVLayout(
        **state_units_layout("test/state-units-device", sh.units, ss.unit_bytes(sh, (2, 4), LAYERS), LAYERS)
    )
    entry = layout.block_bytes
    pool = make_pool()

    def arrays(tp, fill=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(LAYERS):
            for shape, dt in zip(sh.local_shapes(tp), (torch.bfloat16, torch.float32), strict=True):
                a = torch.randn((nb, *shape), generator=g).to(dt)
                out.append(a.fill_(fill) if fill is not None else a)
        return out

    def ns(tp, rank):
        return ss.StateNamespace(pool.namespace(layout), sh.plan(tp, rank), sh)

    def device(tp, rank, arrs):
        plan = sh.plan(tp, rank)
        n = ns(tp, rank)
        views = lambda a, j: (ss.unit_views(a, sh, len(plan.local), j), 1)  # noqa: E731
        return PerHeadTransfer(session_on(pool, n), arrs, 0, entry, 0, plan, CudaTransfer, views=views)

    full = arrays(1, seed=3)
    keys = [os.urandom(32) for _ in range(2)]
    assert ns(1, 0).store(keys, full, [1, 4]) == 2
    for rank in range(2):
        by_cpu, by_device = arrays(2, fill=0.0), arrays(2, fill=7.0)
        assert ns(2, rank).load(keys, by_cpu, [0, 5]) == 2
        t = device(2, rank, by_device)
        assert t.load(BlockOp("r", keys, [0, 5])) == 2
        t.close()
        for a, b in zip(by_cpu, by_device, strict=True):
            assert torch.equal(a[[0, 5]].view(torch.uint8), b[[0, 5]].view(torch.uint8)), rank
            assert a[0].abs().sum() > 0  # real state bytes, not the fill
    # The other way: both TP=2 ranks save their units of new blocks through the device path.
    keys2 = [os.urandom(32) for _ in range(2)]
    ranks = [arrays(2, seed=10 + r) for r in range(2)]
    for rank in range(2):
        t = device(2, rank, ranks[rank])
        assert t.submit_save(BlockOp("s", keys2, [2, 3])).result() == 2
        t.close()
    back = arrays(1, fill=0.0)
    assert ns(1, 0).load(keys2, back, [0, 1]) == 2  # TP=1 finds every unit of both blocks
    # What TP=1 assembled, stored again and cut by the CPU path of each rank, is that rank's save.
    keys3 = [os.urandom(32) for _ in range(2)]
    assert ns(1, 0).store(keys3, back, [0, 1]) == 2
    for rank in range(2):
        mine = arrays(2, fill=0.0)
        assert ns(2, rank).load(keys3, mine, [2, 3]) == 2
        for a, b in zip(mine, ranks[rank], strict=True):
            assert torch.equal(a[[2, 3]].view(torch.uint8), b[[2, 3]].view(torch.uint8)), rank
    assert pool.check()["ok"]
