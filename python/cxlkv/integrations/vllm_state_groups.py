"""The state groups of SSM / linear-attention layers (Mamba, Mamba-2, Gated DeltaNet: vLLM's
``MambaSpec``), as the connector serves them (vllm_groups.py serves every group kind).

Such a group holds no KV: each layer keeps a conv state and an SSM state per request. With
prefix caching on, vLLM runs it in ``mamba_cache_mode`` "align": block ``j`` of a request's
block table holds the state after exactly ``(j + 1) * B`` tokens, vLLM's scheduler ends every
prefill chunk on a block boundary, and a request that resumes at boundary ``h`` reads its
initial state from block ``h - 1`` (the worker copies it forward before the forward pass). So
the pool stores, per block key, the state of every layer of the group AT that boundary (one
entry: each layer's conv state then SSM state, as vLLM's tensors hold them), and a hit at
``h`` loads that one entry into the request's block ``h - 1``.

Which states are stored: a step that computed tokens ``[start, end)`` with ``end`` on a block
boundary leaves the state of boundary ``end / B`` in block ``end / B - 1`` (vLLM's own
invariant in align mode); a later step moves the running state to the next block, and vLLM may
free that block two steps later. So a state is saved in the step that produced it (and the save
ends before the next forward, as a sliding window's: the worker waits for it), and only where
a later hit can use it: the anchors (every ``window_checkpoint_blocks`` boundaries and the
prompt's last block boundary, vllm_groups.py). Every other block of the group is counted as
skipped. States that vLLM writes inside a forward pass at a boundary that is not a chunk end
(its "prefill checkpoint" blocks, used by GPU backends to avoid splitting a prefill) are not
stored: nothing here can run that path (vLLM CPU 0.32 fails on it, see README "Hybrid models"),
so a hit there is a miss, never a wrong state.

Refused at start-up (one line naming the group, :class:`vllm_groups.UnsupportedKVCacheGroup`):
``mamba_cache_mode`` other than "align" (prefix caching off: vLLM keeps only each request's
running state and cannot resume from a stored one), speculative blocks (vLLM relocates them
between steps), and tensor parallelism > 1 (vLLM splits the state over the ranks by head in a
layout of its own per mixer; the per-KV-head entries of heads.py do not describe it).

No vLLM import here: the engine-free unit tests use plain objects with the spec's fields."""

from __future__ import annotations

import math
from typing import Any


def is_state_spec(spec: Any) -> bool:
    """vLLM's MambaSpec (every SSM / linear-attention state group; subclasses included)."""
    return any(c.__name__ == "MambaSpec" for c in type(spec).__mro__)


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0) or dtype.element_size())


def state_bytes(spec: Any) -> int:
    """Bytes of one layer's state (conv + SSM), without vLLM's page padding."""
    return sum(math.prod(shape) * _itemsize(dt) for shape, dt in zip(spec.shapes, spec.dtypes, strict=True))


def describe_state(spec: Any, conv_layout: str) -> str:
    """The state layout for the group's identity: shapes and dtypes per tensor, the mixer (its
    kernels decide what the numbers mean: Mamba-1, Mamba-2, Gated DeltaNet) and the conv state's
    orientation (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``: "SD" (state_len, dim) or "DS" (dim,
    state_len); the shapes tell them apart except where the two are equal)."""
    parts = [
        "x".join(str(d) for d in shape) + ":" + str(dt).replace("torch.", "")
        for shape, dt in zip(spec.shapes, spec.dtypes, strict=True)
    ]
    kind = getattr(getattr(spec, "mamba_type", None), "name", None) or str(getattr(spec, "mamba_type", ""))
    return f"state={'+'.join(parts)} mixer={kind} conv={conv_layout}"


def conv_state_layout() -> str:
    """vLLM's conv state layout in this process ("SD" or "DS"; imported only where a state group
    is described, i.e. inside a vLLM engine)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def unservable(spec: Any, tp_size: int) -> str | None:
    """Why vLLM could not resume from a stored state of this group, or None."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (
            f"mamba_cache_mode is {mode!r} (prefix caching off): vLLM keeps only each request's "
            "running SSM state and cannot resume from a stored one; enable prefix caching "
            "(mamba_cache_mode 'align') to serve it with cxlkv"
        )
    if int(getattr(spec, "num_speculative_blocks", 0) or 0) > 0:
        return "speculative decoding moves SSM state blocks between steps; cxlkv does not store them"
    if tp_size > 1 and not getattr(spec, "tp_replicated", False):
        return (
            f"tensor_parallel_size {tp_size}: vLLM splits the SSM state over the ranks in a layout "
            "the per-KV-head entries (heads.py) do not describe; serve it at TP=1"
        )
    return None


def produced_block(start: int, end: int, block_size: int) -> int | None:
    """The block that holds a boundary state after a step computed tokens ``[start, end)``:
    ``end / B - 1`` when ``end`` is a block boundary (vLLM's running state lands there), else
    None (the running state is mid-block)."""
    if end <= start or end % block_size:
        return None
    return end // block_size - 1


def state_arrays(value: Any) -> list:
    """One state layer's tensors as the worker's KV caches hold them (conv state, SSM state: a
    list or tuple, each ``[num_blocks, ...]``)."""
    return list(value) if isinstance(value, list | tuple) else [value]
