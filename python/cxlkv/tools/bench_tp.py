"""Loads across tensor-parallel sizes, measured: a TP=2 rank loading its KV heads of blocks a TP=1
engine wrote (per-head entries, integrations/heads.py) against the whole-block layout that TP
rank/size namespaces used before (one entry per block holding the rank's heads), and a TP=1 load
of per-head entries against a TP=1 whole-block load; all in one run, one pool.

    cxlkv bench tp [--layers 32] [--heads 8] [--head-size 128] [--block 16] [--blocks 64]
                   [--iters 7] [--copy-threads N] [--pool-dir /dev/shm] [--json]

(``python -m cxlkv.tools.bench_tp`` takes the same arguments: it is that command.)

The KV arrays have vLLM CPU's layout, ``[blocks, kv_heads, block_size, 2 * head_size]`` per layer
(bf16), a rank's array holding its heads only. Each measurement is the median over ``--iters`` of
one load call for all ``--blocks`` blocks (the connector's load of a matched prefix); GB/s counts
the bytes the rank receives.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np

import cxlkv
from cxlkv.integrations.heads import HeadNamespace, HeadPlan


def _arrays(layers: int, blocks: int, heads: int, bs: int, hs: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, (blocks, heads, bs, 2 * hs), dtype=np.uint16) for _ in range(layers)]


def _median_s(fn, iters: int) -> float:
    fn()  # warm: pages faulted in, caches primed alike for every variant
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_loads(loads: dict, blocks: int, iters: int) -> dict:
    """Median seconds and GB/s of each named load, {name: (load() -> blocks loaded, its
    destination arrays)}; a load that returns fewer than `blocks` blocks is an error."""
    out = {}
    for name, (load, dst) in loads.items():

        def timed(load=load) -> None:
            if (n := load()) != blocks:
                raise RuntimeError(f"a load returned {n} of {blocks} blocks")

        s = _median_s(timed, iters)
        nbytes = sum(a.nbytes for a in dst)
        out[name] = {"seconds": round(s, 6), "GBps": round(nbytes / s / 1e9, 3), "bytes": nbytes}
    return out


def run(
    layers: int,
    heads: int,
    hs: int,
    bs: int,
    blocks: int,
    iters: int,
    copy_threads: int | None,
    pool_dir: str = "/dev/shm",
) -> dict:
    plan = HeadPlan(heads, 2, 0)  # first: heads TP=2 cannot split are refused before any pool exists
    per_head = layers * bs * 2 * hs * 2  # bytes of one head's entry (bf16)
    pool_bytes = max(256 << 20, 3 * per_head * heads * blocks + (64 << 20))
    path = os.path.join(pool_dir, f"cxlkv-bench-tp-{uuid.uuid4().hex}")
    keys = [os.urandom(32) for _ in range(blocks)]
    ids = list(range(blocks))
    full = _arrays(layers, blocks, heads, bs, hs, 1)
    out: dict = {
        "bench": "tp",
        "geometry": dict(layers=layers, kv_heads=heads, head_size=hs, block_size=bs, dtype="bf16"),
    }
    try:
        with cxlkv.Pool.create(path, pool_bytes, chunk_size="8MiB") as pool:
            if copy_threads:
                cxlkv._core.set_copy_threads(copy_threads)

            def lay(name: str, h: int, per_entry: int) -> cxlkv.KVLayout:
                return cxlkv.KVLayout(
                    model_id=f"bench-tp/{name}",
                    dtype="bf16",
                    num_layers=layers,
                    num_kv_heads=h,
                    head_size=hs,
                    tokens_per_block=bs,
                    heads_per_entry=per_entry,
                )

            # written once at TP=1 in the per-head layout (every TP size reads these)
            shared = HeadNamespace(pool.namespace(lay("heads", heads, 1)), HeadPlan(heads), 1)
            assert shared.store(keys, full, ids) == blocks
            # the old layout: one entry per block per TP layout, a rank's heads in it
            whole1 = pool.namespace(lay("tp1", heads, 0))
            assert whole1.store(keys, full, ids) == blocks
            mine = [np.ascontiguousarray(a[:, plan.local]) for a in full]
            whole2 = pool.namespace(lay("tp2r0", len(plan.local), 0))
            assert whole2.store(keys, mine, ids) == blocks
            r0 = HeadNamespace(pool.namespace(lay("heads", heads, 1)), plan, 1)
            dst2 = [np.zeros_like(a) for a in mine]
            dst1 = [np.zeros_like(a) for a in full]

            loads = {
                "tp2_rank_whole_block": (lambda: whole2.load(keys, dst2, ids), dst2),
                "tp2_rank_from_tp1_heads": (lambda: r0.load(keys, dst2, ids), dst2),
                "tp1_whole_block": (lambda: whole1.load(keys, dst1, ids), dst1),
                "tp1_from_heads": (lambda: shared.load(keys, dst1, ids), dst1),
            }
            out.update(time_loads(loads, blocks, iters))
            np.testing.assert_array_equal(dst2[0], mine[0])
            np.testing.assert_array_equal(dst1[-1], full[-1])
            out["ratio_tp2_from_tp1_vs_same_tp"] = round(
                out["tp2_rank_whole_block"]["seconds"] / out["tp2_rank_from_tp1_heads"]["seconds"], 3
            )
            out["ratio_tp1_heads_vs_whole"] = round(
                out["tp1_whole_block"]["seconds"] / out["tp1_from_heads"]["seconds"], 3
            )
            out["entry_bytes"] = per_head
            out["blocks"] = blocks
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out["load"] = os.getloadavg()
    return out


# The rows print_result shows: (label, the load measured, its same-run baseline, the ratio's key).
_RATIOS = (
    (
        "TP=2 rank from TP=1 head entries",
        "tp2_rank_from_tp1_heads",
        "tp2_rank_whole_block",
        "ratio_tp2_from_tp1_vs_same_tp",
    ),
    ("TP=1 from head entries", "tp1_from_heads", "tp1_whole_block", "ratio_tp1_heads_vs_whole"),
)


def print_result(con: Any, r: dict) -> None:
    """Each load's GB/s beside its same-run baseline (the whole-block layout at the same TP size);
    ratio > 1: faster than the baseline."""
    from rich.table import Table

    g = r["geometry"]
    t = Table(
        title=f"loads across TP sizes: {g['layers']} layers, {g['kv_heads']} KV heads of "
        f"{g['head_size']}, {g['block_size']} tokens per block, {r['blocks']} blocks per load ({g['dtype']})"
    )
    t.add_column("load")
    for col in ("GB/s", "baseline GB/s", "ratio"):
        t.add_column(col, justify="right")
    for label, name, base, ratio in _RATIOS:
        t.add_row(label, f"{r[name]['GBps']:.2f}", f"{r[base]['GBps']:.2f}", f"{r[ratio]:.2f}x")
    con.print(t)
    con.print("[dim]baseline: whole-block layout, same TP size, same run (ratio > 1: faster)[/dim]")
    con.print(f"[dim]load average {', '.join(f'{x:.1f}' for x in r['load'])}[/dim]")


def main(argv: list[str] | None = None) -> None:
    """``python -m cxlkv.tools.bench_tp ARGS`` runs ``python -m cxlkv bench tp ARGS``: one parser,
    one output. A process, not an import: tools do not import the CLI (tests/python/test_layers.py)."""
    args = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "cxlkv", "bench", "tp", *args])


if __name__ == "__main__":
    main()
