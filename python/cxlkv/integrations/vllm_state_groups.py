"""The state groups of SSM / linear-attention layers (Mamba, Mamba-2, Gated DeltaNet: vLLM's
``MambaSpec``), as the connector serves them (vllm_groups.py serves every group kind).

Such a group holds no KV: each layer keeps a conv state and an SSM state per request. With
prefix caching on, vLLM runs it in ``mamba_cache_mode`` "align": block ``j`` of a request's
block table holds the state after exactly ``(j + 1) * B`` tokens, vLLM's scheduler ends every
prefill chunk on a block boundary, and a request that resumes at boundary ``h`` reads its
initial state from block ``h - 1`` (the worker copies it forward before the forward pass). So
the pool stores, per block key, the state of every layer of the group AT that boundary (one
entry: each layer's conv state then SSM state, as vLLM's tensors hold them), and a hit at
``h`` loads that one entry into the request's block ``h - 1``. (A multiprocess engine core
forgets a block size vLLM rounded up for the states and would end chunks on the smaller one,
mid-block: the scheduler side puts it back, ``vllm_scheduler.CxlKVScheduler._keep_block_size``.)

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
between steps), and tensor parallelism > 1 for a mixer whose sharding cxlkv does not describe yet
(Mamba-1, linear attention; Mamba-2 with one group, which vLLM replicates on every rank): vLLM
splits their states over the ranks in a layout of its own per mixer. Gated DeltaNet states
(Qwen3-Next) are stored as one entry per key head, Mamba-2 states (Nemotron-H, Granite 4) as one
entry per group and short-conv states (LFM2) as one entry per KV head of the model's attention
layers, the same at every TP size (state_shards.py), and served at any TP size that divides the
key heads (the groups, the KV heads).

No vLLM import here: the engine-free unit tests use plain objects with the spec's fields."""

from __future__ import annotations

import math
from typing import Any

from cxlkv.integrations import state_shards as ss


def is_state_spec(spec: Any) -> bool:
    """vLLM's MambaSpec (every SSM / linear-attention state group; subclasses included)."""
    return any(c.__name__ == "MambaSpec" for c in type(spec).__mro__)


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0) or dtype.element_size())


def state_bytes(spec: Any) -> int:
    """Bytes of one layer's state (conv + SSM), without vLLM's page padding."""
    return sum(math.prod(shape) * _itemsize(dt) for shape, dt in zip(spec.shapes, spec.dtypes, strict=True))


def mixer_of(spec: Any) -> str:
    """The mixer's name (vLLM's ``MambaAttentionBackendEnum`` member: GDN_ATTN, MAMBA2...)."""
    return getattr(getattr(spec, "mamba_type", None), "name", None) or str(getattr(spec, "mamba_type", ""))


def describe_state(spec: Any, conv_layout: str, shards: ss.StateShards | None = None) -> str:
    """The state layout for the group's identity: shapes and dtypes per tensor, the mixer (its
    kernels decide what the numbers mean: Mamba-1, Mamba-2, Gated DeltaNet) and the conv state's
    orientation (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``: "SD" (state_len, dim) or "DS" (dim,
    state_len); the shapes tell them apart except where the two are equal). With ``shards``
    (state stored per unit, state_shards.py) the shapes are the model's total, whatever the TP
    size, and the cut into units follows."""
    shapes = [t.shape for t in shards.tensors] if shards is not None else spec.shapes
    parts = [
        "x".join(str(d) for d in shape) + ":" + str(dt).replace("torch.", "")
        for shape, dt in zip(shapes, spec.dtypes, strict=True)
    ]
    text = f"state={'+'.join(parts)} mixer={mixer_of(spec)} conv={conv_layout}"
    return text + (f" {shards.describe()}" if shards is not None else "")


def shards_of(spec: Any, text_config: Any, conv_layout: str, tp_size: int) -> ss.StateShards | None:
    """How this group's states split over TP ranks (state_shards.py), derived from the model's
    config and checked against the shapes vLLM gave this rank; None where cxlkv does not describe
    the mixer's sharding (its states are then one entry per block, TP=1 only)."""
    if text_config is None or int(getattr(spec, "num_speculative_blocks", 0) or 0):
        return None
    try:
        shards = _mixer_shards(mixer_of(spec), spec, text_config, conv_layout, tp_size)
    except (AttributeError, TypeError, ValueError, IndexError):
        return None
    if shards is None or shards.units % tp_size:
        return None
    if [tuple(s) for s in spec.shapes] != shards.local_shapes(tp_size):
        return None  # not the sharding described: refused at TP > 1, one entry at TP=1
    return shards


def _mixer_shards(mixer: str, spec: Any, cfg: Any, conv_layout: str, tp_size: int) -> ss.StateShards | None:
    if mixer == "GDN_ATTN":
        return ss.gdn_shards(
            int(cfg.linear_num_key_heads),
            int(cfg.linear_num_value_heads),
            int(cfg.linear_key_head_dim),
            int(cfg.linear_value_head_dim),
            int(cfg.linear_conv_kernel_dim),
            conv_layout,
        )
    if mixer == "MAMBA2":
        # The groups from the config (Nemotron-H / Mamba2Config: n_groups; Granite 4, Bamba:
        # mamba_n_groups); heads, head dim and state size from this rank's SSM state (heads split
        # by rank) and the conv width from its conv state; shards_of checks the conv channels.
        groups = getattr(cfg, "n_groups", None)
        groups = getattr(cfg, "mamba_n_groups", None) if groups is None else groups
        conv, ssm = (tuple(s) for s in spec.shapes)
        if groups is None or len(conv) != 2 or len(ssm) != 3:
            return None
        state_len = conv[0] if conv_layout == "SD" else conv[1]
        return ss.mamba2_shards(int(groups), ssm[0] * tp_size, ssm[1], ssm[2], state_len + 1, conv_layout)
    if mixer == "SHORT_CONV":
        # LFM2: the channels from this rank's conv state (split by rank), the cut from the
        # attention layers' KV heads; shards_of checks the shape vLLM gave this rank.
        (conv,) = (tuple(s) for s in spec.shapes)
        if len(conv) != 2:
            return None
        state_len, chans = conv if conv_layout == "SD" else conv[::-1]
        return ss.short_conv_shards(int(cfg.num_key_value_heads), chans * tp_size, state_len + 1, conv_layout)
    return None


def conv_state_layout() -> str:
    """vLLM's conv state layout in this process ("SD" or "DS"; imported only where a state group
    is described, i.e. inside a vLLM engine)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def unservable(spec: Any, tp_size: int, shards: ss.StateShards | None = None) -> str | None:
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
    if tp_size > 1 and shards is None and not getattr(spec, "tp_replicated", False):
        return (
            f"tensor_parallel_size {tp_size}: vLLM splits the {mixer_of(spec)} state over the ranks "
            "in a layout cxlkv does not describe (it splits Gated DeltaNet states over a number of "
            "ranks dividing the key heads, Mamba-2 states over a number of ranks dividing the "
            "groups, and short-conv states over a number of ranks dividing the KV heads); serve it "
            "at TP=1"
        )
    return None


def produced_block(start: int, end: int, block_size: int) -> int | None:
    """The block that holds a boundary state after a step computed tokens ``[start, end)``:
    ``end / B - 1`` when ``end`` is a block boundary (vLLM's running state lands there), else
    None (the running state is mid-block)."""
    if end <= start or end % block_size:
        return None
    return end // block_size - 1


def state_arrays(value: Any, spec: Any = None) -> list:
    """One state layer's tensors (conv state, SSM state, each ``[num_blocks, *shape]``) from what
    the worker's KV caches hold for it: a list or tuple of them, or (vLLM 0.32) the layer's raw
    ``[num_blocks, 1, 1, page bytes]`` int8 pages, each page holding the ``spec``'s states packed
    in order (as the mixer's own ``bind_kv_cache`` views them: conv then SSM state)."""
    if isinstance(value, list | tuple):
        return list(value)
    shape = tuple(getattr(value, "shape", ()))
    if spec is None or len(shape) != 4 or shape[1:3] != (1, 1) or not hasattr(value, "view"):
        return [value]
    pages = value.view(shape[0], shape[3])
    out, offset = [], 0
    for s, dt in zip(spec.shapes, spec.dtypes, strict=True):
        n = math.prod(s) * _itemsize(dt)
        if offset + n > shape[3]:
            raise ValueError(f"cxlkv: a state page of {shape[3]} bytes cannot hold the states {spec.shapes}")
        out.append(pages[:, offset : offset + n].view(dt).view(shape[0], *s))
        offset += n
    return out
