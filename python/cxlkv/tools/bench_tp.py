"""Loads across tensor-parallel sizes, measured: a TP=2 rank loading its KV heads of blocks a TP=1
engine wrote (per-head entries, integrations/heads.py) against the whole-block layout that TP
rank/size namespaces used before (one entry per block holding the rank's heads), and a TP=1 load
of per-head entries against a TP=1 whole-block load; all in one run, one pool.

    python -m cxlkv.tools.bench_tp [--layers 32] [--heads 8] [--head-size 128] [--block 16]
                                   [--blocks 64] [--iters 7] [--copy-threads N] [--json]

The KV arrays have vLLM CPU's layout, ``[blocks, kv_heads, block_size, 2 * head_size]`` per layer
(bf16), a rank's array holding its heads only. Each measurement is the median over ``--iters`` of
one load call for all ``--blocks`` blocks (the connector's load of a matched prefix); GB/s counts
the bytes the rank receives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

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


def run(layers: int, heads: int, hs: int, bs: int, blocks: int, iters: int, copy_threads: int | None) -> dict:
    per_head = layers * bs * 2 * hs * 2  # bytes of one head's entry (bf16)
    pool_bytes = max(256 << 20, 3 * per_head * heads * blocks + (64 << 20))
    path = f"/dev/shm/cxlkv-bench-tp-{uuid.uuid4().hex}"
    keys = [os.urandom(32) for _ in range(blocks)]
    ids = list(range(blocks))
    full = _arrays(layers, blocks, heads, bs, hs, 1)
    out: dict = {"geometry": dict(layers=layers, kv_heads=heads, head_size=hs, block_size=bs, dtype="bf16")}
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
            plan = HeadPlan(heads, 2, 0)
            mine = [np.ascontiguousarray(a[:, plan.local]) for a in full]
            whole2 = pool.namespace(lay("tp2r0", len(plan.local), 0))
            assert whole2.store(keys, mine, ids) == blocks
            r0 = HeadNamespace(pool.namespace(lay("heads", heads, 1)), plan, 1)
            dst2 = [np.zeros_like(a) for a in mine]
            dst1 = [np.zeros_like(a) for a in full]

            def check(n: int) -> None:
                if n != blocks:
                    raise RuntimeError(f"a load returned {n} of {blocks} blocks")

            cases = {
                "tp2_rank_whole_block": (lambda: check(whole2.load(keys, dst2, ids)), dst2),
                "tp2_rank_from_tp1_heads": (lambda: check(r0.load(keys, dst2, ids)), dst2),
                "tp1_whole_block": (lambda: check(whole1.load(keys, dst1, ids)), dst1),
                "tp1_from_heads": (lambda: check(shared.load(keys, dst1, ids)), dst1),
            }
            for name, (fn, dst) in cases.items():
                s = _median_s(fn, iters)
                nbytes = sum(a.nbytes for a in dst)
                out[name] = {"seconds": round(s, 6), "GBps": round(nbytes / s / 1e9, 3), "bytes": nbytes}
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cxlkv.tools.bench_tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--copy-threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.layers, a.heads, a.head_size, a.block, a.blocks, a.iters, a.copy_threads)
    if a.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
