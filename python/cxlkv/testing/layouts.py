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
