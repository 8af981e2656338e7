"""Layouts of the tests and benchmarks that store bytes rather than KV tensors."""

from __future__ import annotations


def opaque_layout(model_id: str, block_bytes: int = 1024) -> dict:
    """The fields of a `cxlkv.KVLayout` of opaque blocks of `block_bytes` bytes (one layer, one
    head, one token a block). Fields, not the layout: they cross to child processes as JSON."""
    return dict(
        model_id=model_id,
        dtype="bytes",
        num_layers=1,
        num_kv_heads=1,
        head_size=block_bytes,
        tokens_per_block=1,
        kind="opaque",
        block_bytes=block_bytes,
    )


def state_units_layout(
    model_id: str, units: int, unit_bytes: int, layers: int, tokens_per_block: int = 16
) -> dict:
    """The fields of the `cxlkv.KVLayout` of a state group's unit entries (integrations/
    state_shards.py): one entry a block and unit, of `unit_bytes` (state_shards.unit_bytes)."""
    return dict(
        model_id=model_id,
        dtype="bytes",
        num_layers=layers,
        num_kv_heads=units,
        head_size=1,
        tokens_per_block=tokens_per_block,
        kind="opaque",
        block_bytes=unit_bytes,
    )
