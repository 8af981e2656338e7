"""The CUDA data path's checks on a real GPU (scripts/gpu-check.sh): the fused kernels on CUDA
tensors through the registered pool, and CudaTransfer against the core's CPU path on the same
blocks. Plain functions, so that they run with or without pytest: test_cuda_path.py runs them under
pytest, ``python tests/gpu/cuda_checks.py`` by themselves (a bare GPU image may have no pytest),
one line per check. Each takes a fresh pool and raises AssertionError on a wrong result. The same
logic runs on CPU tensors under TRITON_INTERPRET=1 in tests/python/test_paged_kernels.py and
test_transfer_cuda.py. Pools are created in $CXLKV_GPU_POOL_DIR (default /dev/shm)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
import traceback
import types
import uuid
from collections.abc import Callable, Iterator

import torch

import cxlkv
from cxlkv.integrations.cuda_registration import register_pool
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.transfer_cuda import CudaTransfer
from cxlkv.kernels import paged

LAYERS, NB, BS, H, D = 4, 64, 16, 8, 128
POOL_BYTES = 512 << 20
# "cuda"; "cpu" is a dry run of the same checks on CPU tensors under TRITON_INTERPRET=1 (CI:
# tests/python/test_gpu_check.py), without the two that need a CUDA runtime (registration).
DEV = os.environ.get("CXLKV_GPU_CHECK_DEVICE", "cuda")


def pool_dir() -> str:
    return os.environ.get("CXLKV_GPU_POOL_DIR", "/dev/shm")


@contextlib.contextmanager
def fresh_pool(size: int = POOL_BYTES) -> Iterator[cxlkv.Pool]:
    path = os.path.join(pool_dir(), f"cxlkv-gpu-{uuid.uuid4().hex}")
    p = cxlkv.Pool.create(path, size)
    try:
        yield p
    finally:
        p.close()
        cxlkv.Pool.destroy(path, ignore_attached=True)


def op(req, keys, ids, depth=0):
    return types.SimpleNamespace(req_id=req, keys=keys, block_ids=ids, start_depth=depth)


def _random_kv(dtype: torch.dtype, seed: int, layers: int = LAYERS) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NB, BS, H, D)
    item = torch.tensor([], dtype=dtype).element_size()
    n = torch.Size(shape).numel() * item
    return [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
        for _ in range(layers)
    ]


def _poisoned(dtype: torch.dtype, dev: str, layers: int = LAYERS) -> list:
    shape = (2, NB, BS, H, D)
    item = torch.tensor([], dtype=dtype).element_size()
    raw = [
        torch.full((torch.Size(shape).numel() * item,), 0xA5, dtype=torch.uint8, device=dev)
        for _ in range(layers)
    ]
    return [r.view(dtype).reshape(shape) for r in raw]


def _namespace(pool: cxlkv.Pool, name: str, dtype: torch.dtype, layers: int = LAYERS):
    return pool.namespace(
        cxlkv.KVLayout(
            model_id=name,
            dtype=str(dtype),
            num_layers=layers,
            num_kv_heads=H,
            head_size=D,
            tokens_per_block=BS,
        )
    )


def _session(pool: cxlkv.Pool, ns) -> PoolSession:
    return PoolSession(pool.path, logging.getLogger("gpu"), lambda c: pool, lambda p: ns)


def _same_block(a: torch.Tensor, i: int, b: torch.Tensor, j: int) -> bool:
    return torch.equal(a[:, i].cpu().view(torch.uint8), b[:, j].cpu().view(torch.uint8))


def check_cuda_path_equals_cpu_path(pool: cxlkv.Pool, dtype: torch.dtype) -> None:
    """The CPU path stores, the CUDA path (registered pool) loads into other block ids; the CUDA
    path saves, the CPU path loads: the bytes are equal both ways."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    src_cpu = _random_kv(dtype, seed)
    ns = _namespace(pool, "gpu/test", dtype)
    bb = ns.block_bytes
    ids = [0, 17, NB - 1, 5]
    keys = [os.urandom(32) for _ in ids]
    assert ns.store(keys, src_cpu, ids, block_dim=1) == len(ids)  # the CPU path writes
    dst = _poisoned(dtype, DEV)
    t = CudaTransfer(_session(pool, ns), dst, 1, bb, background_register=False)
    try:
        load_ids = [3, 9, 40, 63]
        assert t.load(op("a", keys, load_ids)) == len(ids)
        if DEV == "cuda":
            assert t.registration.registered, t.registration.reason
        for a, b in zip(src_cpu, dst, strict=True):
            for i, j in zip(ids, load_ids, strict=True):
                assert _same_block(a, i, b, j)
        keys2 = [os.urandom(32) for _ in ids]
        h = t.submit_save(op("b", keys2, load_ids, 2))
        assert h.result() == len(ids) and h.done()
        back = _poisoned(dtype, "cpu")
        assert ns.load(keys2, back, ids, block_dim=1) == len(ids)  # the CPU path reads
        for a, b in zip(back, src_cpu, strict=True):
            for i in ids:
                assert _same_block(a, i, b, i)
    finally:
        t.close()


def check_staged_path(pool: cxlkv.Pool) -> None:
    """Staging through pinned host memory (the path until the pool is registered) saves the bytes
    the CPU reference packs."""
    shape = (2, NB, BS, H, D)
    src = [torch.randn(shape, device=DEV).to(torch.bfloat16) for _ in range(2)]
    ns = _namespace(pool, "gpu/staged", torch.bfloat16, layers=2)
    t = CudaTransfer(_session(pool, ns), src, 1, ns.block_bytes, staging=True, background_register=False)
    try:
        keys = [os.urandom(32) for _ in range(3)]
        assert t.submit_save(op("s", keys, [1, 2, 3])).result() == 3
        for k, b in zip(keys, [1, 2, 3], strict=True):
            assert ns.get_bytes(k) == paged.reference_pack(src, 1, b)
        dst = _poisoned(torch.bfloat16, DEV, layers=2)
        t2 = CudaTransfer(_session(pool, ns), dst, 1, ns.block_bytes, staging=True, background_register=False)
        try:
            assert t2.load(op("s2", keys, [7, 8, 9])) == 3
            for a, b in zip(src, dst, strict=True):
                for i, j in zip([1, 2, 3], [7, 8, 9], strict=True):
                    assert _same_block(a, i, b, j)
        finally:
            t2.close()
    finally:
        t.close()


def check_corrupt_block_is_a_miss(pool: cxlkv.Pool) -> None:
    """A block corrupted in the pool after its save stops the CUDA load there: the leading intact
    blocks are loaded and counted, the corrupt one and those after it are not reported."""
    dtype = torch.float16
    src = _random_kv(dtype, 7)
    ns = _namespace(pool, "gpu/corrupt", dtype)
    ids = [2, 4, 6, 8]
    keys = [os.urandom(32) for _ in ids]
    assert ns.store(keys, src, ids, block_dim=1) == len(ids)
    view = pool.transfer_view()
    lease = ns.pin_verified(keys)
    offs = list(lease.offsets)
    lease.release()
    view[offs[2] + 1000] ^= 0x01  # one bit of the third block
    dst = _poisoned(dtype, DEV)
    t = CudaTransfer(_session(pool, ns), dst, 1, ns.block_bytes, background_register=False)
    try:
        assert t.load(op("c", keys, [10, 11, 12, 13])) == 2
        for a, b in zip(src, dst, strict=True):
            for i, j in zip(ids[:2], [10, 11], strict=True):
                assert _same_block(a, i, b, j)
    finally:
        t.close()


def check_registration_in_ranges(pool: cxlkv.Pool) -> None:
    """The pool registered in several ranges (cut between chunks, cuda_registration.py): every
    range's device pointer is its host address, and the kernel reads blocks lying in different
    ranges exactly."""
    dtype = torch.bfloat16
    src = _random_kv(dtype, 11)
    ns = _namespace(pool, "gpu/ranges", dtype)
    key_sets = [[os.urandom(32) for _ in range(NB)] for _ in range(4)]  # 4 x 16 MiB of blocks
    for keys in key_sets:
        assert ns.store(keys, src, list(range(NB)), block_dim=1) == NB
    max_range = 32 << 20  # the pool's head (index, tables) needs one range of ~29 MiB
    starts = [o for o, _ in pool.transfer_ranges(max_range)]
    assert len(starts) > 4, starts
    reg = register_pool(pool, background=False, max_range_bytes=max_range)
    used_ranges: set = set()
    try:
        assert reg.registered, reg.reason
        view = pool.transfer_view()
        for keys in key_sets:
            dst = _poisoned(dtype, DEV)
            plan = paged.plan_fragments(dst, 1, ns.block_bytes)
            words = _UvaWords(int(view.ctypes.data), plan.kv_base.dtype)
            lease = ns.pin_verified(keys)
            try:
                offs = list(lease.offsets)
                assert len(offs) == NB
                used_ranges |= {sum(1 for s in starts if s <= o) for o in offs}
                paged.scatter(plan, words, int(view.shape[0]), list(range(NB)), offs)
                torch.cuda.synchronize()
                assert lease.recheck() == NB
            finally:
                lease.release()
            for a, b in zip(src, dst, strict=True):
                for i in range(NB):
                    assert _same_block(a, i, b, i), i
    finally:
        reg.close()
    assert not reg.registered
    assert len(used_ranges) >= 2, f"the blocks read lie in {len(used_ranges)} range(s) only"


def check_background_registration(pool: cxlkv.Pool) -> None:
    """Loads issued while the registration runs in the background (staging path) and after it
    finished (direct path) deliver the same bytes."""
    dtype = torch.bfloat16
    src = _random_kv(dtype, 5)
    ns = _namespace(pool, "gpu/background", dtype)
    keys = [os.urandom(32) for _ in range(8)]
    assert ns.store(keys, src, list(range(8)), block_dim=1) == 8
    dst = _poisoned(dtype, DEV)
    t = CudaTransfer(_session(pool, ns), dst, 1, ns.block_bytes, background_register=True)
    try:
        assert t.load(op("early", keys, list(range(20, 28)))) == 8
        reg = t.registration
        assert reg is not None and reg.wait(60), getattr(reg, "reason", "no registration")
        assert t.load(op("late", keys, list(range(40, 48)))) == 8
        for a, b in zip(src, dst, strict=True):
            for i in range(8):
                assert _same_block(a, i, b, 20 + i) and _same_block(a, i, b, 40 + i), i
    finally:
        t.close()


def check_state_units_tp2(pool: cxlkv.Pool) -> None:
    """A hybrid model's SSM / linear-attention state group at TP=2 on the device (what vllm_worker
    builds: a PerHeadTransfer of CudaTransfers over state_shards.unit_views, two units per rank,
    bf16 conv and fp32 SSM state in one entry): each rank loads its units of states the CPU path
    stored at TP=1, byte-equal to the CPU path's own load of that rank; what both ranks save is
    read back at TP=1. On a GPU every part shares the one registration of the pool (direct path)."""
    from cxlkv.integrations import state_shards as ss
    from cxlkv.integrations.heads import PerHeadTransfer
    from cxlkv.testing.layouts import state_units_layout

    sh = ss.gdn_shards(4, 8, 128, 128, 4, "SD")  # Qwen3-Next-like: head dim 128, 4 key heads
    layers, nb = 2, 8
    layout = cxlkv.KVLayout(
        **state_units_layout("gpu/state-units", sh.units, ss.unit_bytes(sh, (2, 4), layers), layers)
    )
    entry = layout.block_bytes

    def arrays(tp: int, dev: str, seed: int = 0, fill: float | None = None) -> list:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(layers):
            for shape, dt in zip(sh.local_shapes(tp), (torch.bfloat16, torch.float32), strict=True):
                a = torch.randn((nb, *shape), generator=g).to(dt)
                out.append((a.fill_(fill) if fill is not None else a).to(dev))
        return out

    def ns(tp: int, rank: int):
        return ss.StateNamespace(pool.namespace(layout), sh.plan(tp, rank), sh)

    def device(tp: int, rank: int, arrs: list) -> PerHeadTransfer:
        plan = sh.plan(tp, rank)
        views = lambda a, j: (ss.unit_views(a, sh, len(plan.local), j), 1)  # noqa: E731

        def make(session, v, bd, nbytes):
            return CudaTransfer(session, v, bd, nbytes, background_register=False)

        return PerHeadTransfer(_session(pool, ns(tp, rank)), arrs, 0, entry, 0, plan, make, views=views)

    keys = [os.urandom(32) for _ in range(2)]
    assert ns(1, 0).store(keys, arrays(1, "cpu", seed=3), [1, 4]) == 2
    for rank in range(2):
        by_cpu, by_dev = arrays(2, "cpu", fill=0.0), arrays(2, DEV, fill=7.0)
        assert ns(2, rank).load(keys, by_cpu, [0, 5]) == 2
        t = device(2, rank, by_dev)
        try:
            assert t.load(op("r", keys, [0, 5])) == 2
            if DEV == "cuda":
                for part in t._parts:  # one registration for every unit's transfer
                    assert part.registration is not None and part.registration.registered
        finally:
            t.close()
        for a, b in zip(by_cpu, by_dev, strict=True):
            assert torch.equal(a[[0, 5]].view(torch.uint8), b[[0, 5]].cpu().view(torch.uint8)), rank
    keys2 = [os.urandom(32) for _ in range(2)]
    ranks = [arrays(2, DEV, seed=10 + r) for r in range(2)]
    for rank in range(2):
        t = device(2, rank, ranks[rank])
        try:  # the second unit's transfer attaches while the first one's save commits
            assert t.submit_save(op("s", keys2, [2, 3])).result() == 2
        finally:
            t.close()
    back = arrays(1, "cpu", fill=0.0)
    assert ns(1, 0).load(keys2, back, [0, 1]) == 2
    keys3 = [os.urandom(32) for _ in range(2)]
    assert ns(1, 0).store(keys3, back, [0, 1]) == 2
    for rank in range(2):
        mine = arrays(2, "cpu", fill=0.0)
        assert ns(2, rank).load(keys3, mine, [2, 3]) == 2
        for a, b in zip(mine, ranks[rank], strict=True):
            assert torch.equal(a[[2, 3]].view(torch.uint8), b[[2, 3]].cpu().view(torch.uint8)), rank


class _UvaWords:
    """A registered pool address the Triton launcher accepts (as transfer_cuda._PoolWords)."""

    def __init__(self, addr: int, dtype: torch.dtype) -> None:
        self._addr, self.dtype, self.device = addr, dtype, torch.device("cuda")

    def data_ptr(self) -> int:
        return self._addr


# (name, check, keyword arguments): what test_cuda_path.py parametrizes and main() runs.
CHECKS: list[tuple[str, Callable[..., None], dict]] = [
    *(
        (f"cuda_path_equals_cpu_path[{dt}]", check_cuda_path_equals_cpu_path, {"dtype": dt})
        for dt in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    ),
    ("staged_path", check_staged_path, {}),
    ("corrupt_block_is_a_miss", check_corrupt_block_is_a_miss, {}),
    ("state_units_tp2", check_state_units_tp2, {}),
]
if DEV == "cuda":
    CHECKS += [
        ("registration_in_ranges", check_registration_in_ranges, {}),
        ("background_registration", check_background_registration, {}),
    ]


def run_check(name: str) -> None:
    _, fn, kw = next(c for c in CHECKS if c[0] == name)
    with fresh_pool() as p:
        fn(p, **kw)


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        print("cuda_checks: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    failed = 0
    for name, _, _ in CHECKS:
        t0 = time.perf_counter()
        try:
            run_check(name)
            print(f"PASS {name} ({time.perf_counter() - t0:.1f} s)")
        except Exception:  # noqa: BLE001 - every check runs; each failure is printed in full
            failed += 1
            print(f"FAIL {name} ({time.perf_counter() - t0:.1f} s)")
            traceback.print_exc()
    print(f"cuda_checks: {len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
