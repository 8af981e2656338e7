"""``cxlkv bench sparse``: top-k token fetch from the pool vs fetching the whole context (SAC).

DeepSeek-V3.2 geometry: 61 layers, rows of 656 B (``fp8_ds_mla``) or 1,152 B (bf16 MLA), top-2048
tokens per layer per decode step, contexts 16K..128K. Per context and row format, in one run:

* full: every block of the sequence read from the pool (``ns.get``, whole-block checksums): what
  a step costs when it fetches the whole context;
* sparse: ``TokenStore.gather_layers`` of random top-k indices (distinct, unsorted) per layer,
  every row verified;
* memcpy: a copy of the same number of bytes from packed (contiguous) rows, out of a buffer as
  large as the context's rows, a different slice each time: the limit; on one thread
  (``gather_vs_memcpy``) and split over as many threads as the core's gather uses
  (the result's ``copy_threads``; ``gather_vs_memcpy_mt``, the like-for-like ratio when that is more than 1);
* private gather: the same rows (same indices) gathered by a plain C loop of row copies
  (``_core.rows_gather_private``; numpy's ``np.take`` is reported beside it) from private memory
  holding the context's rows ``[layers, context, row]``: what a gather costs without the pool, so
  ``gather_vs_private`` says what the pool (offsets, verification) costs and ``gather_vs_memcpy``
  what gathering costs at all;
* call overhead: ``gather_layers`` of one row per layer (Python, nanobind, the view's checks);
* hot buffer: steps whose top-k share a fraction ``h`` of the previous step's tokens, through a
  HiSparse buffer of 2k + 1 rows per layer; bytes fetched from the pool and latency per step.

A 128K context of 61 layers is 5.2 GB (656 B) / 9.2 GB (1,152 B), more than a shared machine
gives a benchmark, so ``--layers`` of them (default 4) are stored and measured; a step's bytes and
times are linear in the layer count (each layer is the same work on its own rows), and the JSON
reports both the measured values and the 61-layer scaling (``*_model``). Ratios do not depend on it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

import cxlkv

from .. import _core
from ..integrations.hot_buffer import HotBuffer
from ._common import machine, progress, split_copy

MODEL_LAYERS = 61
FORMATS = {"fp8_ds_mla": 656, "bf16": 1152}
TOKENS_PER_BLOCK = 64


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, in seconds (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _private_gather_s(
    private: np.ndarray, idx: np.ndarray, out: np.ndarray, repeats: int
) -> tuple[float, float]:
    """The fastest gather of rows ``idx`` (``[layers, k]``) from private rows ``[layers, context,
    row]`` into ``out``, by a plain C loop of row copies (the core's reference) and by numpy
    (``np.take``): the same work as the pool's gather, without the pool."""
    row_bytes = private.shape[2]

    def c_loop() -> None:
        for layer in range(private.shape[0]):
            _core.rows_gather_private(private[layer], row_bytes, idx[layer], out[layer])

    def numpy_take() -> None:
        for layer in range(private.shape[0]):
            np.take(private[layer], idx[layer], axis=0, out=out[layer])

    return _best(c_loop, repeats), _best(numpy_take, repeats)


def _topk(rng: np.random.Generator, layers: int, context: int, k: int) -> np.ndarray:
    return np.stack([rng.choice(context, k, replace=False) for _ in range(layers)]).astype(np.int64)


def _next_topk(rng: np.random.Generator, prev: np.ndarray, context: int, hit: float) -> np.ndarray:
    """Keeps a fraction ``hit`` of each layer's previous top-k and draws the rest anew."""
    layers, k = prev.shape
    keep = round(hit * k)
    out = np.empty_like(prev)
    for layer in range(layers):
        kept = rng.choice(prev[layer], keep, replace=False)
        fresh = np.setdiff1d(rng.choice(context, 2 * k, replace=False), prev[layer])[: k - keep]
        if len(fresh) < k - keep:  # tiny contexts only
            fresh = np.setdiff1d(np.arange(context), prev[layer])[: k - keep]
        out[layer] = rng.permutation(np.concatenate([kept, fresh]))
    return out


def _measure_context(
    pool_dir: str,
    fmt: str,
    row_bytes: int,
    context: int,
    layers: int,
    topk: int,
    hit_rates: list,
    steps: int,
    repeats: int,
    rng: np.random.Generator,
    say: Callable[[str], None],
) -> dict:
    layout = cxlkv.KVLayout(
        f"bench/deepseek-v3.2-{fmt}",
        dtype="uint8",
        kind="mla",
        num_layers=layers,
        head_size=row_bytes,
        tokens_per_block=TOKENS_PER_BLOCK,
    )
    row_total = layers * context * row_bytes
    path = os.path.join(pool_dir, f"cxlkv-bench-sparse-{uuid.uuid4().hex}")
    size = int(row_total * 1.15) + (64 << 20)
    pool = cxlkv.Pool.create(path, size, chunk_size=8 << 20)
    try:
        ts = pool.token_store(layout, max_tokens_per_seq=context)
        seq = b"bench-sparse-request"
        say(f"{fmt} {context // 1024}K: writing {cxlkv.format_size(row_total)} of rows ({layers} layers)")
        piece = 8192
        for start in range(0, context, piece):
            n = min(piece, context - start)
            ts.append(seq, rng.integers(0, 256, (layers, n, row_bytes), dtype=np.uint8))
        n_blocks = -(-context // TOKENS_PER_BLOCK)
        keys = [ts.block_key(seq, c, TOKENS_PER_BLOCK) for c in range(n_blocks)]
        full_buf = np.empty((n_blocks, ts.block_bytes), np.uint8)
        ns = ts._ns

        def full() -> None:
            for c, key in enumerate(keys):
                if not ns.get(key, full_buf[c]):
                    raise cxlkv.SequenceMissError(f"block {c} missing in the full fetch")

        k = min(topk, context)
        idx = _topk(rng, layers, context, k)
        out = np.empty((layers, k, row_bytes), np.uint8)
        ts.gather_layers(seq, idx, out)  # pins the sequence (once, as a decode loop would)
        sparse_s = _best(lambda: ts.gather_layers(seq, idx, out), repeats)
        full_s = _best(full, max(1, repeats // 2))
        sparse_bytes = layers * k * row_bytes
        # The limit: the same number of bytes copied from packed rows, out of a buffer as large as
        # the context's rows (so the copy meets the same cache regime as the gather), a different
        # slice each time.
        packed = np.empty(max(row_total, 2 * sparse_bytes), np.uint8)
        packed.fill(1)
        slices = max(1, len(packed) // sparse_bytes)
        turn = iter(range(1 << 30))
        flat_out = out.reshape(-1)

        def memcpy() -> None:
            start = (next(turn) % slices) * sparse_bytes
            np.copyto(flat_out, packed[start : start + sparse_bytes])

        memcpy_s = _best(memcpy, repeats)
        threads = _core.copy_threads()
        memcpy_mt_s = memcpy_s
        if threads > 1:  # the same copy in `threads` contiguous parts (numpy releases the GIL)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads - 1) as ex:

                def memcpy_mt() -> None:
                    start = (next(turn) % slices) * sparse_bytes
                    split_copy(ex, flat_out, packed[start : start + sparse_bytes], threads)

                memcpy_mt_s = _best(memcpy_mt, repeats)
        private_s, numpy_s = _private_gather_s(
            packed[:row_total].reshape(layers, context, row_bytes), idx, out, repeats
        )
        packed = np.empty(0, np.uint8)  # frees the reference's buffer before the hot-buffer runs
        one_idx, one_out = idx[:, :1].copy(), out[:, :1].copy()
        call_s = _best(lambda: ts.gather_layers(seq, one_idx, one_out), repeats * 20)
        full_bytes = row_total
        say(f"{fmt} {context // 1024}K: full {full_s * 1e3:.1f} ms, top-{k} {sparse_s * 1e3:.2f} ms")
        hot = []
        for h in hit_rates:
            hb = HotBuffer(ts, seq, capacity=2 * k + 1)
            cur = _topk(rng, layers, context, k)
            hb.step(cur, out)  # cold start: fills the buffer
            base = dict(hb.counters)
            times = []
            for _ in range(steps):
                cur = _next_topk(rng, cur, context, h)
                t = time.perf_counter()
                hb.step(cur, out)
                times.append(time.perf_counter() - t)
            fetched = hb.counters["bytes_from_pool"] - base["bytes_from_pool"]
            hits = hb.counters["hits"] - base["hits"]
            lookups = hits + hb.counters["misses"] - base["misses"]
            step_s = float(np.median(times))
            hot.append(
                {
                    "target_hit_rate": h,
                    "hit_rate": hits / lookups,
                    "bytes_per_step": fetched / steps,
                    "bytes_per_step_model": fetched / steps * MODEL_LAYERS / layers,
                    "latency_s": step_s,
                    "latency_s_model": step_s * MODEL_LAYERS / layers,
                    "bytes_ratio": full_bytes / max(1.0, fetched / steps),
                    "latency_ratio": full_s / step_s,
                }
            )
            del hb
        scale = MODEL_LAYERS / layers
        return {
            "format": fmt,
            "row_bytes": row_bytes,
            "context_tokens": context,
            "topk": k,
            "full_bytes": full_bytes,
            "full_bytes_model": full_bytes * scale,
            "sparse_bytes": sparse_bytes,
            "sparse_bytes_model": sparse_bytes * scale,
            "bytes_ratio": full_bytes / sparse_bytes,
            "full_latency_s": full_s,
            "full_latency_s_model": full_s * scale,
            "sparse_latency_s": sparse_s,
            "sparse_latency_s_model": sparse_s * scale,
            "latency_ratio": full_s / sparse_s,
            "gather_gbps": sparse_bytes / sparse_s / 1e9,
            "memcpy_packed_gbps": sparse_bytes / memcpy_s / 1e9,
            "gather_vs_memcpy": memcpy_s / sparse_s,
            "memcpy_packed_mt_gbps": sparse_bytes / memcpy_mt_s / 1e9,
            "gather_vs_memcpy_mt": memcpy_mt_s / sparse_s,
            "gather_private_gbps": sparse_bytes / private_s / 1e9,
            "gather_vs_private": private_s / sparse_s,
            "gather_numpy_gbps": sparse_bytes / numpy_s / 1e9,
            "gather_call_s": call_s,
            "full_fetch_gbps": full_bytes / full_s / 1e9,
            "hot_buffer": hot,
        }
    finally:
        pool.close()
        cxlkv.Pool.destroy(path)


def bench_sparse(
    *,
    contexts: list,
    topk: int = 2048,
    layers: int = 4,
    formats: list | None = None,
    hit_rates: list | None = None,
    steps: int = 8,
    repeats: int = 5,
    pool_dir: str = "/dev/shm",
    seed: int | None = None,
    quiet: bool = False,
    copy_threads: int | None = None,
) -> dict:
    """Runs the benchmark (see the module doc) and returns the JSON-able result. copy_threads:
    threads one gather may use (default: the core's own choice, see ``_core.copy_threads``)."""
    if copy_threads is not None:
        _core.set_copy_threads(copy_threads)
    formats = formats or list(FORMATS)
    hit_rates = hit_rates if hit_rates is not None else [0.5, 0.8, 0.95]
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = np.random.default_rng(seed)
    say = progress(quiet)
    results = [
        _measure_context(pool_dir, fmt, FORMATS[fmt], ctx, layers, topk, hit_rates, steps, repeats, rng, say)
        for fmt in formats
        for ctx in contexts
    ]
    return {
        "benchmark": "sparse",
        "model_layers": MODEL_LAYERS,
        "layers_measured": layers,
        "scaling": f"*_model fields = measured x {MODEL_LAYERS}/{layers} (per-layer work is identical); "
        "ratios are measured",
        "tokens_per_block": TOKENS_PER_BLOCK,
        "topk": topk,
        "copy_threads": _core.copy_threads(),
        # the token block format and the row check kernel the gathers ran (token_rows.h, row_check.h)
        "token_format": _core.token_block_layout(1, 1, 1)["version"],
        "row_check_kernel": _core.token_block_layout(1, 1, 1).get("row_check_kernel", "xxh3_vec"),
        "seed": seed,
        "load_average": os.getloadavg(),
        "machine": machine(),
        "results": results,
    }


def print_result(con: Any, r: dict) -> None:
    from rich.table import Table

    t = Table(
        title=f"top-{r['topk']} token fetch vs the whole context ({r['layers_measured']} of "
        f"{r['model_layers']} layers measured; bytes and ms scaled to {r['model_layers']})"
    )
    for col in (
        "format",
        "context",
        "full MB",
        "top-k MB",
        "bytes ratio",
        "full ms",
        "top-k ms",
        "latency ratio",
        "gather GB/s",
        "memcpy GB/s",
        "gather/memcpy",
        f"gather/memcpy ({r['copy_threads']} t.)",
        "private gather GB/s",
        "gather/private",
    ):
        t.add_column(col, justify="right")
    for x in r["results"]:
        t.add_row(
            x["format"],
            f"{x['context_tokens'] // 1024}K",
            f"{x['full_bytes_model'] / 1e6:.0f}",
            f"{x['sparse_bytes_model'] / 1e6:.1f}",
            f"{x['bytes_ratio']:.1f}x",
            f"{x['full_latency_s_model'] * 1e3:.1f}",
            f"{x['sparse_latency_s_model'] * 1e3:.2f}",
            f"{x['latency_ratio']:.1f}x",
            f"{x['gather_gbps']:.2f}",
            f"{x['memcpy_packed_gbps']:.2f}",
            f"{x['gather_vs_memcpy']:.2f}",
            f"{x['gather_vs_memcpy_mt']:.2f}",
            f"{x['gather_private_gbps']:.2f}",
            f"{x['gather_vs_private']:.2f}",
        )
    con.print(t)
    h = Table(title="with the hot buffer (2k+1 rows per layer): per decode step")
    for col in ("format", "context", "hit rate", "pool MB/step", "ms/step", "bytes ratio", "latency ratio"):
        h.add_column(col, justify="right")
    for x in r["results"]:
        for y in x["hot_buffer"]:
            h.add_row(
                x["format"],
                f"{x['context_tokens'] // 1024}K",
                f"{y['hit_rate']:.2f}",
                f"{y['bytes_per_step_model'] / 1e6:.1f}",
                f"{y['latency_s_model'] * 1e3:.2f}",
                f"{y['bytes_ratio']:.0f}x",
                f"{y['latency_ratio']:.1f}x",
            )
    con.print(h)
    con.print(f"[dim]seed {r['seed']}, load average {r['load_average']}[/dim]")
