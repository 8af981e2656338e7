"""One state layout for every tensor-parallel size: the SSM / linear-attention states of a state
group (vllm_state_groups.py) stored as ``units`` pool entries per block, so that a TP rank of any
size stores and loads exactly its slice (docs/ARCHITECTURE.md, "One block layout for every TP
size"), as heads.py does for KV heads.

vLLM shards a mixer's states over the ranks along one channel dim per tensor, segment by segment:
a Gated DeltaNet conv state's channels are ``[q | k | v]`` (``key_dim, key_dim, value_dim``) and
rank ``r`` of ``t`` holds ``[q_r | k_r | v_r]``, the ``r``-th ``1/t`` of each segment
(``mamba_v2_sharded_weight_loader`` shards the conv weights so, and the conv state follows the
conv's channels); its SSM state ``[v_heads, head_v, head_k]`` is split by value head. So a block's
state is cut into ``units`` equal pieces of every segment (unit ``u``: the ``u``-th
``1/units`` of each segment of each tensor of each layer, one pool entry under
``head_key(block key, u)``), and a rank of TP ``t`` (``t`` divides ``units``) holds units
``[r * units / t, (r + 1) * units / t)``: :class:`heads.HeadPlan` with ``units`` for heads. Each
unit entry has its own checksum; a lookup asks for every unit, so a block is there only when every
rank's part is.

The bytes of a unit entry do not depend on the TP size: per layer, per tensor, per segment, the
piece's elements in the tensor's order with the block dim taken out (:func:`unit_views`).

vLLM-free (numpy or torch arrays), so the engine-free tests use it directly."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from cxlkv.integrations.heads import HeadNamespace, HeadPlan


@dataclasses.dataclass(frozen=True)
class TensorShards:
    """One state tensor of a layer: its per-block ``shape`` at TP=1 (the model's total), the dim
    of that shape vLLM shards (``dim``), and the segments along it (sizes, in order; each is
    split into ``units`` equal pieces)."""

    shape: tuple[int, ...]
    dim: int
    segments: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.segments) != self.shape[self.dim]:
            raise ValueError(f"segments {self.segments} do not cover dim {self.dim} of {self.shape}")

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """The per-block shape a rank of ``tp_size`` holds."""
        s = list(self.shape)
        s[self.dim] = sum(seg // tp_size for seg in self.segments)
        return tuple(s)


@dataclasses.dataclass(frozen=True)
class StateShards:
    """How one layer's state tensors split into ``units`` entries (every layer of a group alike)."""

    units: int
    tensors: tuple[TensorShards, ...]

    def __post_init__(self) -> None:
        if self.units < 1 or any(seg % self.units for t in self.tensors for seg in t.segments):
            raise ValueError(f"state segments cannot be cut into {self.units} units: {self.tensors}")

    def plan(self, tp_size: int, tp_rank: int) -> HeadPlan:
        """Which units a rank holds; ValueError if ``tp_size`` does not divide ``units``."""
        if self.units % tp_size:
            raise ValueError(f"{self.units} state units cannot be split over {tp_size} tensor-parallel ranks")
        return HeadPlan(self.units, tp_size, tp_rank)

    def local_shapes(self, tp_size: int) -> list[tuple[int, ...]]:
        return [t.local_shape(tp_size) for t in self.tensors]

    def describe(self) -> str:
        """For the group's identity: the model's total state and its cut (not the TP size)."""
        parts = [
            "x".join(map(str, t.shape)) + f"/d{t.dim}:" + ",".join(map(str, t.segments)) for t in self.tensors
        ]
        return f"units={self.units} total={'+'.join(parts)}"


def gdn_shards(
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, conv_layout: str
) -> StateShards:
    """A Gated DeltaNet layer (Qwen3-Next): conv state ``(kernel - 1, conv_dim)`` ("SD") or
    ``(conv_dim, kernel - 1)`` ("DS") with channels ``[q | k | v]``; SSM state ``(v_heads,
    head_v, head_k)``. One unit per key head (vLLM splits q and k by key head, v and the SSM
    state by value head, ``v_heads / k_heads`` of them with each key head)."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    conv_dim, state_len = 2 * key_dim + value_dim, conv_kernel - 1
    conv_shape, cdim = ((state_len, conv_dim), 1) if conv_layout == "SD" else ((conv_dim, state_len), 0)
    return StateShards(
        num_k_heads,
        (
            TensorShards(conv_shape, cdim, (key_dim, key_dim, value_dim)),
            TensorShards((num_v_heads, head_v_dim, head_k_dim), 0, (num_v_heads,)),
        ),
    )


def mamba2_shards(
    n_groups: int, num_heads: int, head_dim: int, state_size: int, conv_kernel: int, conv_layout: str
) -> StateShards:
    """A Mamba-2 layer (Nemotron-H, Granite 4): conv state over channels ``[x | B | C]``
    (``num_heads * head_dim, n_groups * state_size, n_groups * state_size``: the conv's
    ``MergedColumnParallelLinear`` output sizes, each split by rank), SSM state ``(num_heads,
    head_dim, state_size)`` split by head. One unit per group (its heads' x channels and SSM
    states, its B and C channels), so a TP size that divides the groups holds whole units; vLLM
    replicates the one group of an ``n_groups == 1`` model on every rank instead, a layout one
    unit per group does not describe (refused at TP > 1: vllm_state_groups.py)."""
    x_dim, g_dim = num_heads * head_dim, n_groups * state_size
    conv_dim, state_len = x_dim + 2 * g_dim, conv_kernel - 1
    conv_shape, cdim = ((state_len, conv_dim), 1) if conv_layout == "SD" else ((conv_dim, state_len), 0)
    return StateShards(
        n_groups,
        (
            TensorShards(conv_shape, cdim, (x_dim, g_dim, g_dim)),
            TensorShards((num_heads, head_dim, state_size), 0, (num_heads,)),
        ),
    )


def short_conv_shards(units: int, conv_dim: int, conv_kernel: int, conv_layout: str) -> StateShards:
    """A short-conv layer (LFM2): one conv state over ``conv_dim`` channels, which vLLM splits by
    rank in one contiguous piece each (the conv weights are a ``ColumnParallelLinear``: rank ``r``
    of ``t`` holds the ``r``-th ``1/t`` of the channels, and the conv state follows the conv's
    channels). The channels carry no heads, so the cut is the model's KV heads (``units``): a TP
    size that serves the attention layers' heads whole also holds whole units of the conv."""
    state_len = conv_kernel - 1
    conv_shape, cdim = ((state_len, conv_dim), 1) if conv_layout == "SD" else ((conv_dim, state_len), 0)
    return StateShards(units, (TensorShards(conv_shape, cdim, (conv_dim,)),))


def _strides(a: Any) -> tuple[int, ...]:
    s = a.stride() if callable(getattr(a, "stride", None)) else a.strides
    item = 1 if callable(getattr(a, "stride", None)) else a.itemsize
    return tuple(int(x) // item for x in s)


def _block_before_tail(v: Any) -> Any:
    """``v`` ([blocks, ...]) as ``[outer, blocks, contiguous tail]`` (block dim 1): the block dim
    moved just before the longest contiguous tail, one outer dim (1 when there is none)."""
    shape, strides = tuple(v.shape), _strides(v)
    tail, inner = len(shape), 1
    for d in range(len(shape) - 1, 0, -1):
        if shape[d] != 1 and strides[d] != inner:
            break
        inner *= shape[d]
        tail = d
    outer = list(range(1, tail))
    if len(outer) > 1:
        raise ValueError(f"cxlkv: a state view of shape {shape} has more than one strided dim")
    order = [*outer, 0, *range(tail, len(shape))]
    v = v.permute(*order) if hasattr(v, "permute") else v.transpose(order)
    return v if outer else v[None]


def unit_views(arrays: Sequence[Any], shards: StateShards, local_units: int, j: int) -> list:
    """Views of local unit ``j`` of a rank's state arrays (per layer, the layer's tensors in
    order, each ``[num_blocks, *local shape]``), block dim 1: what ``ns.store``/``ns.load`` take
    for one unit entry."""
    per = len(shards.tensors)
    if len(arrays) % per:
        raise ValueError(f"cxlkv: {len(arrays)} state arrays are not layers of {per} tensors")
    out = []
    for i, a in enumerate(arrays):
        t = shards.tensors[i % per]
        d = t.dim + 1  # the array leads with blocks
        base = 0
        for seg in t.segments:
            piece = seg // shards.units
            lo = base + j * piece
            out.append(_block_before_tail(a[(slice(None),) * d + (slice(lo, lo + piece),)]))
            base += piece * local_units
    return out


def unit_bytes(shards: StateShards, itemsizes: Sequence[int], layers: int) -> int:
    """Bytes of one unit entry: ``layers`` layers, tensors of the given item sizes."""
    per_layer = sum(math.prod(t.shape) * s for t, s in zip(shards.tensors, itemsizes, strict=True))
    return per_layer * layers // shards.units


class StateNamespace(HeadNamespace):
    """A namespace of per-unit state entries used with block keys: lookups ask for every unit,
    ``store``/``load`` move this rank's units of a group's state arrays (block dim 0)."""

    def __init__(self, ns: Any, plan: HeadPlan, shards: StateShards) -> None:
        super().__init__(ns, plan, None)
        self.shards = shards

    def _views(self, arrays: Sequence[Any], block_dim: int, j: int) -> tuple[list, int]:
        if block_dim != 0:
            raise ValueError("cxlkv: state arrays lead with blocks")
        return unit_views(arrays, self.shards, len(self.plan.local), j), 1

    def _merged(self, arrays: Sequence[Any], block_dim: int) -> list | None:
        return None  # each unit is several strided pieces: one call per unit
