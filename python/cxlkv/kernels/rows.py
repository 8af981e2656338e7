"""Row gather / scatter kernels (Triton) for the token store's hot buffer (SAC Appendix C).

``gather_rows(src, idx, out)``: ``out[i] = src[idx[i]]``; ``scatter_rows(src, idx, dst)``:
``dst[idx[i]] = src[i]``. ``src``/``dst``/``out`` are 2-D torch tensors of one dtype with rows of
the same width; ``idx`` 1-D integers, each checked to lie in range before any launch (a kernel
never reads or writes out of bounds). Rows are moved as bytes, so any dtype (bf16, fp8 records as
uint8) is copied exactly.

Triton runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them);
other CPU tensors take torch's indexing, which gives the same bytes.
"""

from __future__ import annotations

import os
from typing import Any

_BLOCK = 256  # bytes of a row one program copies per iteration


def _use_triton(t: Any) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check(rows: Any, idx: Any, other: Any, what: str) -> None:
    import torch

    if rows.dim() != 2 or other.dim() != 2 or idx.dim() != 1:
        raise ValueError(f"{what}: rows and the other operand must be 2-D, idx 1-D")
    if rows.dtype != other.dtype or rows.shape[1] != other.shape[1]:
        raise ValueError(
            f"{what}: dtype and row width must match ({rows.dtype}/{other.dtype}, "
            f"{rows.shape[1]}/{other.shape[1]})"
        )
    if not (rows.device == other.device == idx.device):
        # a kernel given a pointer of another device reads or writes wherever it points
        raise ValueError(
            f"{what}: operands on different devices ({rows.device}, {other.device}, {idx.device})"
        )
    if other.shape[0] != idx.shape[0]:
        raise ValueError(f"{what}: {idx.shape[0]} indices for {other.shape[0]} rows")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: indices must be int32 or int64, not {idx.dtype}")
    if not (rows.is_contiguous() and other.is_contiguous() and idx.is_contiguous()):
        raise ValueError(f"{what}: operands must be contiguous")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows.shape[0]):
        raise IndexError(f"{what}: row index out of range 0..{rows.shape[0] - 1}")


def _as_bytes(t: Any) -> Any:
    import torch

    return t.view(torch.uint8)


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_kernel(src, idx, out, row_bytes, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        r = tl.load(idx + i).to(tl.int64)
        for start in range(0, row_bytes, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < row_bytes
            v = tl.load(src + r * row_bytes + offs, mask=m)
            tl.store(out + i.to(tl.int64) * row_bytes + offs, v, mask=m)

    @triton.jit
    def scatter_kernel(src, idx, dst, row_bytes, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        r = tl.load(idx + i).to(tl.int64)
        for start in range(0, row_bytes, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < row_bytes
            v = tl.load(src + i.to(tl.int64) * row_bytes + offs, mask=m)
            tl.store(dst + r * row_bytes + offs, v, mask=m)

    return gather_kernel, scatter_kernel


_compiled: tuple | None = None


def _get() -> tuple:
    global _compiled
    if _compiled is None:
        _compiled = _kernels()
    return _compiled


def gather_rows(src: Any, idx: Any, out: Any) -> Any:
    """``out[i] = src[idx[i]]`` for every i. Returns ``out``."""
    _check(src, idx, out, "gather_rows")
    if idx.numel() == 0:
        return out
    if not _use_triton(src):
        out.copy_(src.index_select(0, idx.long()))
        return out
    s, o = _as_bytes(src), _as_bytes(out)
    gather, _ = _get()
    gather[(idx.numel(),)](s, idx, o, s.shape[1], BLOCK=_BLOCK)
    return out


def scatter_rows(src: Any, idx: Any, dst: Any) -> Any:
    """``dst[idx[i]] = src[i]`` for every i; the indices must be distinct (programs writing one
    row at once interleave their 256-B pieces: the row would mix both sources). Returns ``dst``."""
    _check(dst, idx, src, "scatter_rows")
    if idx.numel() > 1 and idx.unique().numel() != idx.numel():
        raise ValueError("scatter_rows: duplicate destination rows")
    if idx.numel() == 0:
        return dst
    if not _use_triton(dst):
        dst.index_copy_(0, idx.long(), src)
        return dst
    s, d = _as_bytes(src), _as_bytes(dst)
    _, scatter = _get()
    scatter[(idx.numel(),)](s, idx, d, d.shape[1], BLOCK=_BLOCK)
    return dst
