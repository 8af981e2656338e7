"""The KV cache groups of a vLLM engine, as the connector serves them (vLLM's hybrid KV cache
manager gives each attention type its own group, with its own block ids).

Each group is stored in its own namespace (its layers' bytes per block; the group's attention type,
window and layers are in its identity, so a change is another namespace), under the same chained
token keys. What a prefix hit at block boundary ``h`` needs from a group follows vLLM's own hybrid
prefix cache:

* full attention (MLA included): every block ``[0, h)``;
* sliding window of ``W`` tokens: the blocks holding the ``W - 1`` tokens before ``h``, i.e.
  ``[h - ceil((W - 1) / B), h)`` (vLLM's ``SlidingWindowManager``);
* chunked local attention of ``C`` tokens: the blocks of the chunk ``h`` is in,
  ``[floor(h * B / C) * C / B, h)``.

So the external hit is the longest ``h`` every group can serve, and a group with a bounded reach
stores only the blocks a later hit can use: the window before each *anchor* boundary, which is
every ``checkpoint`` blocks of the sequence (hits inside long shared prefixes) and the last block
boundary of the prompt (the same prompt again: the deepest hit there is). A hit at any other
boundary is served from the deepest anchor below it; blocks outside every anchor's window are
counted as skipped, never stored. State groups of SSM / linear-attention layers (Mamba, Gated
DeltaNet) hold one state per block boundary: a hit at ``h`` needs the state of ``h`` alone, and
only anchors are stored (vllm_state_groups.py, which also says what is refused at start-up with
:class:`UnsupportedKVCacheGroup`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from cxlkv.integrations import vllm_state_groups as vsg

FULL = "full"
SLIDING = "sliding_window"
CHUNKED = "chunked_local"
STATE = "state"  # an SSM / linear-attention state group (vllm_state_groups.py)

# Blocks between two anchors of a bounded-reach group (sliding window, chunked local); the
# kv_connector_extra_config key "window_checkpoint_blocks" changes it.
DEFAULT_CHECKPOINT_BLOCKS = 16


class UnsupportedKVCacheGroup(ValueError):
    """A KV cache group the connector cannot store (raised at start-up, one line naming it)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One KV cache group: ``index`` in vLLM's kv_cache_groups, its ``reach`` (FULL, SLIDING,
    CHUNKED), ``window`` (tokens of the sliding window or of the local chunk; 0 for FULL) and
    ``layer_names`` (in vLLM's order: the order of the bytes of a block)."""

    index: int
    reach: str
    window: int
    block_size: int
    spec: Any
    layer_names: tuple[str, ...]
    conv_layout: str = ""  # a STATE group's conv state orientation (vllm_state_groups.py)
    shards: Any = None  # a STATE group's cut into per-unit entries (state_shards.py), or None

    @property
    def bounded(self) -> bool:
        return self.reach != FULL

    @property
    def block_bytes(self) -> int:
        if self.reach == STATE:  # the states' bytes, not vLLM's page (padded to the KV page size)
            return vsg.state_bytes(self.spec) * len(self.layer_names)
        return int(self.spec.page_size_bytes) * len(self.layer_names)

    def first_needed(self, hit: int) -> int:
        """The first block a prefix hit of ``hit`` blocks needs from this group."""
        if self.reach == STATE:  # the state at the boundary: the block ending there
            return max(0, hit - 1)
        if self.reach == SLIDING:
            return max(0, hit - _cdiv(self.window - 1, self.block_size))
        if self.reach == CHUNKED:
            return hit * self.block_size // self.window * self.window // self.block_size
        return 0

    def describe(self, total: int) -> str:
        """The group's part of the identity (the device layout field): attention reach, window
        and which layers, by name digest."""
        names = hashlib.sha256("\n".join(self.layer_names).encode()).hexdigest()[:16]
        text = f"group {self.index}/{total} {self.reach} window={self.window} layers={names}"
        if self.reach == STATE:  # the state tensors' shapes and dtypes decide its bytes
            text += f" {vsg.describe_state(self.spec, self.conv_layout, self.shards)}"
        return text

    def anchors_needing(self, block: int, checkpoint: int, prompt_anchor: int) -> bool:
        """Whether a later hit can use this group's ``block``: it lies in the reach of an anchor
        (every ``checkpoint`` blocks, and ``prompt_anchor``). FULL groups need every block."""
        if not self.bounded:
            return True
        if self.reach == STATE:  # block j holds the state of boundary j + 1
            return (block + 1) % checkpoint == 0 or block + 1 == prompt_anchor
        # first_needed grows with the hit: of the checkpoints past the block, the nearest reaches
        # back the furthest
        nearest = (block // checkpoint + 1) * checkpoint
        return any(a > block and self.first_needed(a) <= block for a in (nearest, prompt_anchor))


def group_layouts(
    kv_cache_config: Any,
    block_size: int,
    tp_size: int = 1,
    conv_layout: str | None = None,
    text_config: Any = None,
) -> list[GroupLayout]:
    """The engine's groups, or :class:`UnsupportedKVCacheGroup` for the first it cannot serve.
    ``conv_layout``: vLLM's conv state orientation (default: this process's vLLM setting);
    ``text_config``: the model's (text) config, whose mixer dims say how vLLM splits a state
    group over TP ranks (vllm_state_groups.shards_of)."""
    groups = list(kv_cache_config.kv_cache_groups)
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        what = f"cxlkv: KV cache group {i} of {len(groups)} ({kind}, layers {list(g.layer_names)[:3]}...)"
        if not hasattr(spec, "page_size_bytes"):
            raise UnsupportedKVCacheGroup(f"{what}: a KV cache spec without pages is not stored by cxlkv")
        shards = None
        if vsg.is_state_spec(spec):
            conv_layout = conv_layout or vsg.conv_state_layout()
            shards = vsg.shards_of(spec, text_config, conv_layout, tp_size)
            why = vsg.unservable(spec, tp_size, shards)
            if why:
                raise UnsupportedKVCacheGroup(f"{what}: {why}")
        if int(getattr(spec, "block_size", block_size)) != block_size:
            raise UnsupportedKVCacheGroup(
                f"{what}: block size {spec.block_size} differs from the cache's {block_size}"
            )
        layout = ""
        if vsg.is_state_spec(spec):
            reach, window = STATE, 0
            layout = conv_layout or vsg.conv_state_layout()
        elif "SlidingWindow" in kind:
            reach, window = SLIDING, int(spec.sliding_window)
        elif "ChunkedLocal" in kind:
            reach, window = CHUNKED, int(spec.attention_chunk_size)
        else:  # full attention, MLA and any attention that reads the whole prefix: every block
            reach, window = FULL, 0
        out.append(GroupLayout(i, reach, window, block_size, spec, tuple(g.layer_names), layout, shards))
    return out


def primary_group(groups: list[GroupLayout]) -> int:
    """The group whose keys name a request's blocks in events and coalescing: the first full
    attention group (every block of the prefix), else group 0."""
    return next((g.index for g in groups if not g.bounded), 0)
