"""Loads of SSM / linear-attention states across tensor-parallel sizes, measured (``cxlkv bench tp
--state``): a TP=2 rank loading its units of state blocks a TP=1 engine wrote (one pool entry per
block and Gated DeltaNet key head, integrations/state_shards.py) against the layout a same-TP
engine used before (one entry per block holding the rank's whole state), and a TP=1 load of the
unit entries against one whole-state entry per block; all in one run, one pool.

The state arrays have vLLM's layout, per layer a conv state ``[blocks, kernel - 1, conv_dim]``
(2-byte elements as bf16, channels ``[q | k | v]``) and an SSM state ``[blocks, v_heads, head_v,
head_k]`` (fp32, as vLLM CPU keeps it), a rank's arrays holding its slice only. Each measurement is the median over
``--iters`` of one load call for all ``--blocks`` blocks; GB/s counts the bytes the rank receives.
(A hit loads one state block, the one at its boundary: ``--blocks`` only steadies the timing.)
"""

from __future__ import annotations

import os
import uuid

import numpy as np

import cxlkv
from cxlkv.integrations import state_shards as ss
from cxlkv.tools.bench_tp import time_loads


def _layout(name: str, layers: int, units: int, block_bytes: int) -> cxlkv.KVLayout:
    return cxlkv.KVLayout(
        model_id=f"bench-tp-state/{name}",
        dtype="bytes",
        num_layers=layers,
        num_kv_heads=units,
        head_size=1,
        tokens_per_block=256,
        kind="opaque",
        block_bytes=block_bytes,
    )


def _rank_state(full: list, shards: ss.StateShards, tp: int, rank: int) -> list:
    """A rank's own arrays (contiguous, as vLLM allocates them): its units' pieces of each segment."""
    units = shards.plan(tp, rank).local
    out = []
    for i, a in enumerate(full):
        t = shards.tensors[i % len(shards.tensors)]
        pieces, base = [], 0
        for seg in t.segments:
            piece = seg // shards.units
            lo = base + units[0] * piece
            pieces.append(a[(slice(None),) * (t.dim + 1) + (slice(lo, lo + piece * len(units)),)])
            base += seg
        out.append(np.ascontiguousarray(np.concatenate(pieces, axis=t.dim + 1)))
    return out


def run(
    layers: int, key_heads: int, value_heads: int, blocks: int, iters: int, pool_dir: str = "/dev/shm"
) -> dict:
    shards = ss.gdn_shards(key_heads, value_heads, 128, 128, 4, "SD")
    shards.plan(2, 0)  # first: a cut TP=2 cannot split is refused before any pool exists
    rng = np.random.default_rng(1)
    full = []
    for _ in range(layers):
        full.append(rng.integers(0, 1 << 16, (blocks, *shards.tensors[0].shape), dtype=np.uint16))
        full.append(rng.standard_normal((blocks, *shards.tensors[1].shape), dtype=np.float32))
    mine = _rank_state(full, shards, 2, 0)
    whole_bytes = sum(a[0].nbytes for a in full)
    unit = ss.unit_bytes(shards, [2, 4], layers)
    path = os.path.join(pool_dir, f"cxlkv-bench-tp-state-{uuid.uuid4().hex}")
    keys = [os.urandom(32) for _ in range(blocks)]
    ids = list(range(blocks))
    out: dict = {
        "bench": "tp-state",
        "geometry": dict(layers=layers, key_heads=key_heads, value_heads=value_heads, head_dim=128, kernel=4),
        "blocks": blocks,
        "unit_bytes": unit,
        "block_bytes": whole_bytes,
    }
    try:
        with cxlkv.Pool.create(
            path, max(256 << 20, 4 * whole_bytes * blocks + (64 << 20)), chunk_size="32MiB"
        ) as pool:
            units_ns = pool.namespace(_layout("units", layers, shards.units, unit))
            shared = ss.StateNamespace(units_ns, shards.plan(1, 0), shards)
            assert shared.store(keys, full, ids) == blocks  # written once at TP=1, per unit
            r0 = ss.StateNamespace(units_ns, shards.plan(2, 0), shards)
            whole1 = pool.namespace(_layout("tp1", layers, 1, whole_bytes))  # the layout before
            assert whole1.store(keys, full, ids) == blocks
            whole2 = pool.namespace(_layout("tp2r0", layers, 1, whole_bytes // 2))
            assert whole2.store(keys, mine, ids) == blocks
            dst2, dst1 = [np.zeros_like(a) for a in mine], [np.zeros_like(a) for a in full]

            loads = {
                "tp2_rank_whole_state": (lambda: whole2.load(keys, dst2, ids), dst2),
                "tp2_rank_from_tp1_units": (lambda: r0.load(keys, dst2, ids), dst2),
                "tp1_whole_state": (lambda: whole1.load(keys, dst1, ids), dst1),
                "tp1_from_units": (lambda: shared.load(keys, dst1, ids), dst1),
            }
            out.update(time_loads(loads, blocks, iters))
            if not all(np.array_equal(a, b) for a, b in zip(dst2, mine, strict=True)):
                raise RuntimeError("the TP=2 rank's state differs from its slice of the TP=1 state")
            if not all(np.array_equal(a, b) for a, b in zip(dst1, full, strict=True)):
                raise RuntimeError("the TP=1 state read back from units differs")
            out["ratio_tp2_from_tp1_vs_same_tp"] = round(
                out["tp2_rank_whole_state"]["seconds"] / out["tp2_rank_from_tp1_units"]["seconds"], 3
            )
            out["ratio_tp1_units_vs_whole"] = round(
                out["tp1_whole_state"]["seconds"] / out["tp1_from_units"]["seconds"], 3
            )
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out["load"] = os.getloadavg()
    return out


def print_result(con, r: dict) -> None:
    """Each load's GB/s beside its same-run baseline (one whole-state entry per block at the same
    TP size); ratio > 1: faster than the baseline."""
    from rich.table import Table

    g = r["geometry"]
    t = Table(
        title=f"state loads across TP sizes: {g['layers']} Gated DeltaNet layers, {g['key_heads']} key / "
        f"{g['value_heads']} value heads of {g['head_dim']}, {r['blocks']} state blocks per load"
    )
    t.add_column("load")
    for col in ("GB/s", "baseline GB/s", "ratio"):
        t.add_column(col, justify="right")
    rows = (
        (
            "TP=2 rank from TP=1 unit entries",
            "tp2_rank_from_tp1_units",
            "tp2_rank_whole_state",
            "ratio_tp2_from_tp1_vs_same_tp",
        ),
        ("TP=1 from unit entries", "tp1_from_units", "tp1_whole_state", "ratio_tp1_units_vs_whole"),
    )
    for label, name, base, ratio in rows:
        t.add_row(label, f"{r[name]['GBps']:.2f}", f"{r[base]['GBps']:.2f}", f"{r[ratio]:.2f}x")
    con.print(t)
    con.print(
        "[dim]baseline: one whole-state entry per block, same TP size, same run (ratio > 1: faster)[/dim]"
    )
    con.print(f"[dim]load average {', '.join(f'{x:.1f}' for x in r['load'])}[/dim]")
