"""One fused Triton kernel that gathers every layer's fragments of a batch of vLLM KV blocks into
pool blocks, and one that scatters them back (Beluga §6.1: one launch instead of a memcpy per
fragment).

A pool block's bytes are exactly what the core's CPU path (``ns.store`` / ``ns.load`` with
``block_dim``) writes for the same arrays: for each array in order, for each index combination of
the dims before ``block_dim`` in C order, the contiguous bytes of ``array[..., block_id, ...]``.
``plan_fragments`` derives that list the way the core's binding does (bindings.cpp,
``geometry_of`` / ``add_fragments``), so the two paths share one layout; whether two engines may
share blocks at all is the identity's ``device_layout`` (docs/IDENTITY.md), not this module's.

The kernels copy words (8, 4, 2 or 1 bytes: the widest that divides every address, stride and
size involved); the KV dtype does not matter. Fragment addresses are passed as word offsets from
one base tensor, so one launch reaches every layer's tensor; on a GPU the pool side is the
registered pool mapping (a UVA pointer, see integrations/cuda_registration.py), under
``TRITON_INTERPRET=1`` a CPU tensor over the pool bytes (Pool.transfer_view()).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

CHUNK = 1024  # words per program: 8 KiB with 8-byte words
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class LayoutError(ValueError):
    """The KV arrays cannot be described as fragments of pool blocks (shape, strides, size)."""


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
    """Where each fragment of a block lies, in words: in the KV arrays (from ``kv_base``) and in
    the pool block. One plan per set of KV arrays (register_kv_caches)."""

    device: torch.device
    word_bytes: int
    kv_base: torch.Tensor  # the storage of the lowest-addressed array, as words
    kv_base_addr: int
    src_delta: torch.Tensor  # int64 [F]: fragment f of block 0, words from kv_base
    block_stride: torch.Tensor  # int64 [F]: words from block b to block b + 1
    frag_words: torch.Tensor  # int64 [F]
    pool_delta: torch.Tensor  # int64 [F]: words from the start of the pool block
    num_blocks: int  # block ids must be in [0, num_blocks)
    block_bytes: int
    max_frag_words: int
    arrays: tuple  # keeps the arrays (and so the addresses above) alive

    @property
    def fragments(self) -> int:
        return int(self.frag_words.numel())


def _word_bytes(values: Sequence[int]) -> int:
    for w in (8, 4, 2, 1):
        if all(v % w == 0 for v in values):
            return w
    return 1


def plan_fragments(arrays: Sequence[torch.Tensor], block_dim: int, block_bytes: int) -> FragmentPlan:
    """The fragments of one block of ``arrays`` (the core's order), checked against block_bytes."""
    if not arrays:
        raise LayoutError("no KV arrays given")
    device = arrays[0].device
    frags: list[tuple[int, int, int]] = []  # (address of block 0, block stride, bytes), bytes
    num_blocks = None
    for a in arrays:
        if a.device != device:
            raise LayoutError(f"KV arrays on {device} and {a.device}: one device per transfer")
        nd, item = a.dim(), a.element_size()
        bd = block_dim + nd if block_dim < 0 else block_dim
        if not 0 <= bd < nd:
            raise LayoutError(f"block_dim {block_dim} out of range for an array of {nd} dims")
        inner = item
        for d in range(nd - 1, bd, -1):
            if a.shape[d] > 1 and a.stride(d) * item != inner:
                raise LayoutError("the dims after block_dim must be contiguous (C order)")
            inner *= a.shape[d]
        if a.stride(bd) < 0 or any(a.stride(d) < 0 for d in range(bd)):
            raise LayoutError("negative strides are not supported")
        num_blocks = a.shape[bd] if num_blocks is None else min(num_blocks, a.shape[bd])
        if inner == 0:
            continue
        outer_shape = a.shape[:bd]
        for idx in _c_order(outer_shape):
            off = sum(i * a.stride(d) * item for d, i in enumerate(idx))
            frags.append((a.data_ptr() + off, a.stride(bd) * item, inner))
    total = sum(f[2] for f in frags)
    if total != block_bytes:
        raise LayoutError(f"fragments add up to {total} bytes per block, the namespace stores {block_bytes}")
    lowest = min(arrays, key=lambda t: t.untyped_storage().data_ptr())
    storage = lowest.untyped_storage()
    base_addr = storage.data_ptr()
    if any(f[0] < base_addr for f in frags):  # arrays of several storages: measure from the lowest
        raise LayoutError("a KV array lies below the lowest storage")  # (cannot happen: min above)
    pool_deltas, acc = [], 0
    for f in frags:
        pool_deltas.append(acc)
        acc += f[2]
    w = _word_bytes(
        [f[0] - base_addr for f in frags] + [f[1] for f in frags] + [f[2] for f in frags] + [block_bytes]
    )
    dt = _WORD_DTYPES[w]
    kv_base = torch.empty(0, dtype=dt, device=device).set_(storage, 0, (storage.nbytes() // w,), (1,))
    as_i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return FragmentPlan(
        device=device,
        word_bytes=w,
        kv_base=kv_base,
        kv_base_addr=base_addr,
        src_delta=as_i64([(f[0] - base_addr) // w for f in frags]),
        block_stride=as_i64([f[1] // w for f in frags]),
        frag_words=as_i64([f[2] // w for f in frags]),
        pool_delta=as_i64([d // w for d in pool_deltas]),
        num_blocks=int(num_blocks or 0),
        block_bytes=block_bytes,
        max_frag_words=max(f[2] for f in frags) // w,
        arrays=tuple(arrays),
    )


def _c_order(shape: Sequence[int]):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _c_order(shape[1:]):
            yield (i, *rest)


@triton.jit
def _copy_blocks(
    kv_base,
    pool_base,
    block_ids,
    pool_offs,
    src_delta,
    block_stride,
    frag_words,
    pool_delta,
    n_frags,
    TO_POOL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // n_frags  # block of the batch
    f = pid % n_frags  # fragment of the block
    start = tl.program_id(1) * CHUNK
    words = tl.load(frag_words + f)
    if start < words:
        b = tl.load(block_ids + i)
        kv = tl.load(src_delta + f) + b * tl.load(block_stride + f) + start
        pool = tl.load(pool_offs + i) + tl.load(pool_delta + f) + start
        o = tl.arange(0, CHUNK)
        m = o < words - start
        if TO_POOL:
            tl.store(pool_base + pool + o, tl.load(kv_base + kv + o, mask=m), mask=m)
        else:
            tl.store(kv_base + kv + o, tl.load(pool_base + pool + o, mask=m), mask=m)


def _check(
    plan: FragmentPlan, pool_words: Any, pool_bytes: int, block_ids: Sequence[int], offsets: Sequence[int]
):
    if len(block_ids) != len(offsets):
        raise ValueError(f"{len(block_ids)} block ids for {len(offsets)} pool blocks")
    for b in block_ids:
        if not 0 <= int(b) < plan.num_blocks:
            raise ValueError(f"block id {b} out of range (the KV arrays hold {plan.num_blocks} blocks)")
    for o in offsets:  # from the core, bounds-checked there; the kernel cannot check, so again here
        if o < 0 or o % plan.word_bytes or o + plan.block_bytes > pool_bytes:
            raise ValueError(f"pool offset {o} is not a block of this pool ({pool_bytes} bytes)")
    if pool_words.dtype != plan.kv_base.dtype:
        raise ValueError(f"the pool view must be words of {plan.word_bytes} bytes ({plan.kv_base.dtype})")


def _launch(plan, pool_words, pool_bytes, block_ids, offsets, to_pool: bool, stream_device=None) -> None:
    _check(plan, pool_words, pool_bytes, block_ids, offsets)
    n = len(block_ids)
    if n == 0 or plan.fragments == 0:
        return
    dev = plan.device
    ids = torch.tensor([int(b) for b in block_ids], dtype=torch.int64)
    offs = torch.tensor([int(o) // plan.word_bytes for o in offsets], dtype=torch.int64)
    if dev.type != "cpu":
        ids = ids.pin_memory().to(dev, non_blocking=True)
        offs = offs.pin_memory().to(dev, non_blocking=True)
    grid = (n * plan.fragments, triton.cdiv(plan.max_frag_words, CHUNK))
    _copy_blocks[grid](
        plan.kv_base,
        pool_words,
        ids,
        offs,
        plan.src_delta,
        plan.block_stride,
        plan.frag_words,
        plan.pool_delta,
        plan.fragments,
        TO_POOL=to_pool,
        CHUNK=CHUNK,
    )


def gather(
    plan: FragmentPlan, pool_words: Any, pool_bytes: int, block_ids: Sequence[int], offsets: Sequence[int]
) -> None:
    """KV blocks ``block_ids`` -> pool blocks at byte ``offsets`` (one launch, all layers)."""
    _launch(plan, pool_words, pool_bytes, block_ids, offsets, to_pool=True)


def scatter(
    plan: FragmentPlan, pool_words: Any, pool_bytes: int, block_ids: Sequence[int], offsets: Sequence[int]
) -> None:
    """Pool blocks at byte ``offsets`` -> KV blocks ``block_ids`` (one launch, all layers)."""
    _launch(plan, pool_words, pool_bytes, block_ids, offsets, to_pool=False)


def pool_words(view: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """The pool bytes (a uint8 tensor) as words of ``word_bytes`` for the kernels."""
    return view.view(_WORD_DTYPES[word_bytes])


def reference_pack(arrays: Sequence[torch.Tensor], block_dim: int, block_id: int) -> bytes:
    """One block's pool bytes computed by plain indexing (tests and the GPU check compare with it)."""
    out = []
    for a in arrays:
        bd = block_dim + a.dim() if block_dim < 0 else block_dim
        for idx in _c_order(a.shape[:bd]):
            frag = a[tuple(idx) + (block_id,)].contiguous().cpu()
            out.append(frag.view(torch.uint8).reshape(-1).numpy().tobytes())
    return b"".join(out)
