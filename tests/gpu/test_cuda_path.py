"""The CUDA data path on a real GPU (scripts/gpu-check.sh): the fused kernels on CUDA tensors
through the registered pool, and CudaTransfer against the core's CPU path on the same blocks.
Skipped, with the reason, where there is no CUDA device; the same logic runs on CPU tensors under
TRITON_INTERPRET=1 in tests/python/test_paged_kernels.py and test_transfer_cuda.py."""

from __future__ import annotations

import logging
import os
import random
import types
import uuid

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device (torch.cuda.is_available() is False): run scripts/gpu-check.sh on a GPU machine",
        allow_module_level=True,
    )

import cxlkv  # noqa: E402
from cxlkv.integrations.pool_session import PoolSession  # noqa: E402
from cxlkv.integrations.transfer_cuda import CudaTransfer  # noqa: E402
from cxlkv.kernels import paged  # noqa: E402

LAYERS, NB, BS, H, D = 4, 64, 16, 8, 128


def op(req, keys, ids, depth=0):
    return types.SimpleNamespace(req_id=req, keys=keys, block_ids=ids, start_depth=depth)


@pytest.fixture
def pool():
    path = f"/dev/shm/cxlkv-gpu-{uuid.uuid4().hex}"
    p = cxlkv.Pool.create(path, 512 << 20)
    yield p
    p.close()
    cxlkv.Pool.destroy(path, ignore_attached=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_cuda_path_equals_cpu_path_on_the_same_blocks(pool, dtype):
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    shape = (2, NB, BS, H, D)
    item = torch.tensor([], dtype=dtype).element_size()
    src_cpu = [
        torch.randint(0, 256, (torch.Size(shape).numel() * item,), dtype=torch.uint8, generator=g)
        .view(dtype)
        .reshape(shape)
        for _ in range(LAYERS)
    ]
    bb = LAYERS * 2 * BS * H * D * item
    ns = pool.namespace(
        cxlkv.KVLayout(
            model_id="gpu/test",
            dtype=str(dtype),
            num_layers=LAYERS,
            num_kv_heads=H,
            head_size=D,
            tokens_per_block=BS,
        )
    )
    assert ns.block_bytes == bb
    session = PoolSession(pool.path, logging.getLogger("gpu"), lambda c: pool, lambda p: ns)
    ids = [0, 17, NB - 1, 5]
    keys = [os.urandom(32) for _ in ids]
    assert ns.store(keys, src_cpu, ids, block_dim=1) == len(ids)  # the CPU path writes

    def poisoned(dev):
        raw = torch.full((torch.Size(shape).numel() * item,), 0xA5, dtype=torch.uint8, device=dev)
        return raw.view(dtype).reshape(shape)

    dst = [poisoned("cuda") for _ in range(LAYERS)]
    t = CudaTransfer(session, dst, 1, bb, background_register=False)
    load_ids = [3, 9, 40, 63]
    assert t.load(op("a", keys, load_ids)) == len(ids)
    assert t.registration.registered, t.registration.reason
    for a, b in zip(src_cpu, dst, strict=False):
        for i, j in zip(ids, load_ids, strict=False):
            assert torch.equal(a[:, i].view(torch.uint8), b[:, j].cpu().view(torch.uint8))

    keys2 = [os.urandom(32) for _ in ids]
    h = t.submit_save(op("b", keys2, load_ids, 2))
    assert h.result() == len(ids) and h.done()
    back = [poisoned("cpu") for _ in range(LAYERS)]
    assert ns.load(keys2, back, ids, block_dim=1) == len(ids)  # the CPU path reads
    for a, b in zip(back, src_cpu, strict=False):
        for i in ids:
            assert torch.equal(a[:, i].view(torch.uint8), b[:, i].view(torch.uint8))
    t.close()


def test_staged_path_on_the_gpu(pool):
    shape = (2, NB, BS, H, D)
    src = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(2)]
    bb = 2 * 2 * BS * H * D * 2
    ns = pool.namespace(
        cxlkv.KVLayout(
            model_id="gpu/staged",
            dtype="bf16",
            num_layers=2,
            num_kv_heads=H,
            head_size=D,
            tokens_per_block=BS,
        )
    )
    session = PoolSession(pool.path, logging.getLogger("gpu"), lambda c: pool, lambda p: ns)
    t = CudaTransfer(session, src, 1, bb, staging=True, background_register=False)
    keys = [os.urandom(32) for _ in range(3)]
    assert t.submit_save(op("s", keys, [1, 2, 3])).result() == 3
    for k, b in zip(keys, [1, 2, 3], strict=False):
        assert ns.get_bytes(k) == paged.reference_pack(src, 1, b)
    t.close()
