"""The fused gather/scatter kernels (kernels/paged.py), exactly, under Triton's interpreter on CPU
tensors: random data and block ids (first and last included), outputs pre-filled with poison,
both vLLM KV layouts, several dtypes. The same kernels run on a GPU in tests/gpu/."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

# triton.jit reads TRITON_INTERPRET when kernels/paged.py is imported: interpreted kernels run on
# CPU tensors. Set for that import only, so that processes later tests start do not inherit it.
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
from cxlkv.kernels import paged  # noqa: E402

if _before is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _before

POISON = 0xA5

# (name, shape per layer given num_blocks, block_dim): vLLM's CUDA layout leads with K/V, its CPU
# layout with the blocks.
LAYOUTS = {
    "cuda": (lambda nb, bs, h, d: (2, nb, bs, h, d), 1),
    "cpu": (lambda nb, bs, h, d: (nb, 2, h, bs, d), 0),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]


def random_kv(rng: torch.Generator, layout: str, dtype, layers=3, nb=7, bs=4, h=2, d=6) -> list:
    shape, _ = LAYOUTS[layout]
    out = []
    for _ in range(layers):
        s = shape(nb, bs, h, d)
        n = torch.Size(s).numel() * torch.tensor([], dtype=dtype).element_size()
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).view(dtype).reshape(s))
    return out


def poisoned_like(arrays: list) -> list:
    return [torch.full_like(a.view(torch.uint8), POISON).view(a.dtype) for a in arrays]


def fresh_seed() -> int:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return seed


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_then_scatter_is_exact(layout, dtype):
    seed = fresh_seed()
    rng = torch.Generator().manual_seed(seed)
    py = random.Random(seed)
    d = py.choice([3, 6, 8]) if dtype.itemsize == 1 else 6  # odd rows: narrow words
    kv = random_kv(rng, layout, dtype, d=d)
    block_dim = LAYOUTS[layout][1]
    bb = sum(a.numel() * a.element_size() for a in kv) // kv[0].shape[block_dim]
    nb = kv[0].shape[block_dim]
    ids = py.sample(range(1, nb - 1), 2) + [0, nb - 1]
    py.shuffle(ids)
    slots = py.sample(range(10), len(ids))
    pool = torch.full((10 * bb,), POISON, dtype=torch.uint8)
    plan = paged.plan_fragments(kv, block_dim, bb)
    paged.gather(plan, paged.pool_words(pool, plan.word_bytes), pool.numel(), ids, [s * bb for s in slots])
    for b, s in zip(ids, slots, strict=False):
        assert pool[s * bb : (s + 1) * bb].numpy().tobytes() == paged.reference_pack(kv, block_dim, b), (
            seed,
            b,
        )
    untouched = set(range(10)) - set(slots)
    for s in untouched:
        assert bool((pool[s * bb : (s + 1) * bb] == POISON).all()), (seed, s)

    out = poisoned_like(kv)
    oplan = paged.plan_fragments(out, block_dim, bb)
    paged.scatter(oplan, paged.pool_words(pool, oplan.word_bytes), pool.numel(), ids, [s * bb for s in slots])
    for a, o in zip(kv, out, strict=False):
        for b in range(nb):
            idx = (slice(None),) * block_dim + (b,)
            got, want = o[idx].view(torch.uint8), a[idx].view(torch.uint8)
            if b in ids:
                assert torch.equal(got, want), (seed, b)
            else:
                assert bool((got == POISON).all()), (seed, b)


def test_bad_block_ids_and_offsets_are_rejected_before_launch():
    rng = torch.Generator().manual_seed(fresh_seed())
    kv = random_kv(rng, "cuda", torch.bfloat16)
    bb = sum(a.numel() * a.element_size() for a in kv) // kv[0].shape[1]
    plan = paged.plan_fragments(kv, 1, bb)
    pool = torch.full((4 * bb,), POISON, dtype=torch.uint8)
    words = paged.pool_words(pool, plan.word_bytes)
    for ids, offs in (([7], [0]), ([-1], [0]), ([0], [3 * bb + 8]), ([0], [-bb]), ([0], [1]), ([0, 1], [0])):
        with pytest.raises(ValueError):
            paged.gather(plan, words, pool.numel(), ids, offs)
    assert bool((pool == POISON).all())


def test_layouts_that_do_not_add_up_are_refused():
    rng = torch.Generator().manual_seed(fresh_seed())
    kv = random_kv(rng, "cuda", torch.float16)
    bb = sum(a.numel() * a.element_size() for a in kv) // kv[0].shape[1]
    with pytest.raises(paged.LayoutError, match="add up"):
        paged.plan_fragments(kv, 1, bb + 2)
    with pytest.raises(paged.LayoutError, match="contiguous"):
        paged.plan_fragments([a.transpose(3, 4) for a in kv], 1, bb)
