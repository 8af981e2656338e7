"""Benchmarks behind ``cxlkv bench copy`` and ``cxlkv bench index``.

``bench copy``: the batched gather/scatter of vLLM-layout KV blocks (per layer an array shaped
``[2, num_blocks, block_tokens, kv_heads, head_size]`` of bf16, block dimension 1) into and out of a
pool, against plain memcpy of exactly the same bytes measured in the same run, interleaved round by
round so that machine noise hits every variant alike. Baselines:

* ``memcpy_loop``: one ``np.copyto`` per fragment (a Python loop over precomputed views) into a
  contiguous destination of the same size: the same fragments, but with ~0.5 us of Python call
  overhead per fragment;
* ``memcpy_strided``: the same fragments copied by numpy in one strided call per layer (no per
  fragment Python overhead; fragments in ascending block order);
* ``memcpy_contig``: one contiguous copy of the whole batch (the upper bound).

``memcpy_gbps`` is the faster of the two per-fragment baselines, so the ratios do not flatter the pool.

``bench index``: single-operation latency (each call timed with ``perf_counter_ns``) and throughput
(batches timed as a whole) of ``Namespace.contains`` and ``Namespace.put`` from 1..N processes on one
pool, plus batched lookups (``match_prefix`` over 1000 keys) and inserts (``store`` of 1000 blocks)
that amortize the Python call overhead, which dominates single calls. The core's own numbers
(``Namespace.bench_index``: no Python in the timed loop) are reported as ``core_*``, measured in
all processes at once as well.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import statistics
import time
from typing import Any

import numpy as np

import cxlkv
from cxlkv.errors import CommandError, ExitCode
from cxlkv.sizes import format_size
from cxlkv.tools._common import (
    GEOMETRIES,
    PERCENTILE_METHOD,
    block_key,
    create_pool_for,
    machine,
    percentile,
    pow2_at_least,
    progress,
    split_copy,
)
from cxlkv.tools.workers import report_failure, run_workers

__all__ = ["GEOMETRIES", "bench_copy", "bench_index", "print_copy_result", "print_index_result"]

_MiB = 1 << 20


def _gbps(nbytes: int, ns: float) -> float:
    return nbytes / ns if ns > 0 else float("inf")  # bytes per ns == GB/s (1e9 B/s)


def _med(xs: list[int]) -> float:
    return float(statistics.median(xs))


def _huge_buffer(nbytes: int) -> np.ndarray:
    """uint16 zeros of nbytes in anonymous memory on a 2 MiB boundary with MADV_HUGEPAGE, so the
    memcpy baselines copy into huge pages where the kernel gives them (what it gave is read back
    with ``page_info`` and reported beside the pool's)."""
    huge = 2 * _MiB
    # private: Python's default anonymous map is shared, i.e. shmem, which shmem_enabled governs
    m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(m, dtype=np.uint8)
    off = -base.ctypes.data % huge
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    return base[off : off + nbytes].view(np.uint16)


def _page_bytes(a: np.ndarray) -> int:
    return int(cxlkv._core.page_info(a.ctypes.data, a.nbytes)["page_bytes"])


# =============================================================================================
# bench copy


def bench_copy(
    geometry: str = "all",
    iters: int = 7,
    batch_bytes: int = 128 * _MiB,
    pool_dir: str = "/dev/shm",
    quiet: bool = False,
    copy_threads: int | None = None,
    devices: int = 1,
    backend: str = "coherent",
) -> dict[str, Any]:
    """Store/load bandwidth per geometry vs memcpy of the same bytes. Returns one JSON-able dict
    whose top-level store/load/memcpy fields are those of the first geometry (llama3-8b for "all").
    copy_threads: threads the core may use for one large batch (default: the core's own choice).
    devices > 1: each geometry also runs on a pool striped over that many files in pool_dir
    (default stripe); the single-file and striped runs go in ABBA order (single, striped,
    striped, single) so a machine that drifts during the run favours neither, and the result's
    ``striped`` holds the means of each pair and their ratios.

    backend: the pool's coherence backend (compare_backends runs two in one process)."""
    names = list(GEOMETRIES) if geometry == "all" else [geometry]
    for n in names:
        if n not in GEOMETRIES:
            raise ValueError(f"unknown geometry {n!r} (choose from {', '.join(GEOMETRIES)} or all)")
    log = progress(quiet)
    if copy_threads is not None:
        cxlkv._core.set_copy_threads(copy_threads)
        threads = copy_threads
    else:  # the core's default: CXLKV_COPY_THREADS, else min(8, hardware threads)
        try:
            threads = max(1, int(os.environ.get("CXLKV_COPY_THREADS", "")))
        except ValueError:
            threads = min(8, os.cpu_count() or 1)
    results = []
    for n in names:
        r = _bench_copy_one(n, iters, batch_bytes, pool_dir, log, threads, backend=backend)
        if devices > 1:
            s1 = _bench_copy_one(n, iters, batch_bytes, pool_dir, log, threads, devices, backend)
            s2 = _bench_copy_one(n, iters, batch_bytes, pool_dir, log, threads, devices, backend)
            r2 = _bench_copy_one(n, iters, batch_bytes, pool_dir, log, threads, backend=backend)

            def mean(a: dict, b: dict, k: str) -> float:
                return round((a[k] + b[k]) / 2, 3)

            single = {k: mean(r, r2, k) for k in ("store_gbps", "load_gbps")}
            striped = {k: mean(s1, s2, k) for k in ("store_gbps", "load_gbps")}
            r["striped"] = {
                "devices": devices,
                "stripe_bytes": s1["stripe_bytes"],
                "order": "single, striped, striped, single",
                "single_store_gbps": single["store_gbps"],
                "single_load_gbps": single["load_gbps"],
                **striped,
                "store_vs_single": round(striped["store_gbps"] / single["store_gbps"], 3),
                "load_vs_single": round(striped["load_gbps"] / single["load_gbps"], 3),
                "verified": s1["verified"] and s2["verified"] and r2["verified"],
            }
        results.append(r)
    head = results[0]
    out: dict[str, Any] = {"bench": "copy", "backend": backend}
    for k in (
        "geometry",
        "page_bytes",
        "memcpy_page_bytes",
        "store_gbps",
        "load_gbps",
        "memcpy_gbps",
        "memcpy_contig_gbps",
        "memcpy_mt_gbps",
        "store_vs_memcpy",
        "load_vs_memcpy",
        "store_vs_memcpy_mt",
        "load_vs_memcpy_mt",
        "memcpy_contig_2t_gbps",
        "store_vs_memcpy_contig",
        "load_vs_memcpy_contig",
        "store_vs_memcpy_contig_2t",
        "load_vs_memcpy_contig_2t",
    ):
        out[k] = head[k]
    out["copy_threads"] = threads
    out["results"] = results
    out["machine"] = machine()
    out["notes"] = (
        "GB/s = 1e9 bytes/s, medians over interleaved rounds (best values in *_best_gbps). "
        "memcpy_gbps: the faster per-fragment memcpy of the same fragments (store direction: "
        "gather into a contiguous buffer); load_vs_memcpy compares with the same memcpy in the "
        "scatter direction. memcpy_contig_gbps: one contiguous copy of the whole batch. These "
        "memcpy baselines run on one thread, while the core splits a batch of >= 4 MiB over "
        "copy_threads threads: memcpy_mt_gbps / memcpy_scatter_mt_gbps are the strided per-fragment "
        "copies split over the same number of threads (numpy releases the GIL), and *_vs_memcpy_mt "
        "the like-for-like ratios. Use --copy-threads 1 to compare single-threaded. "
        "memcpy_contig_2t_gbps: the contiguous copy split in two halves on two threads; "
        "*_vs_memcpy_contig (goal >= 0.9 with --copy-threads 1) and *_vs_memcpy_contig_2t (goal "
        ">= 0.9 with --copy-threads 2) compare the pool, checksum included, with those limits. "
        "page_bytes: the page size the pool's mapping got (read back from the kernel, not the one "
        "asked for; 2 MiB needs --dir on hugetlbfs or a tmpfs mounted huge=always|advise); "
        "memcpy_page_bytes: the same for the memcpy baselines' buffers (MADV_HUGEPAGE)."
    )
    return out


def _bench_copy_one(
    name: str,
    iters: int,
    batch_bytes: int,
    pool_dir: str,
    log,
    threads: int = 1,
    devices: int = 1,
    backend: str = "coherent",
) -> dict[str, Any]:
    g = GEOMETRIES[name]
    L, H, D, T = g["num_layers"], g["num_kv_heads"], g["head_size"], g["tokens_per_block"]
    frag_elems = T * H * D
    frag_bytes = frag_elems * 2
    block_bytes = L * 2 * frag_bytes
    nblocks = max(1, batch_bytes // block_bytes)
    nbytes = nblocks * block_bytes
    log(
        f"bench copy {name}: {nblocks} blocks of {format_size(block_bytes)} "
        f"({L * 2} fragments of {format_size(frag_bytes)}), batch {format_size(nbytes)}"
    )

    rng = np.random.default_rng(0x5EED)
    shape = (2, nblocks, T, H, D)
    src = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for _ in range(L)]
    dst = [np.ones(shape, dtype=np.uint16) for _ in range(L)]  # ones: fault the pages in now
    block_ids = [int(b) for b in rng.permutation(nblocks)]

    # memcpy baselines: gather into / scatter out of a contiguous buffer in pool block order, on
    # huge pages where the kernel gives them (the pool's pages are compared with these)
    flat = _huge_buffer(nbytes)
    flat2 = _huge_buffer(nbytes)
    flat.fill(1)  # ones: fault the pages in now
    flat2.fill(1)
    gather: list[tuple[np.ndarray, np.ndarray]] = []
    scatter: list[tuple[np.ndarray, np.ndarray]] = []
    for i, bid in enumerate(block_ids):
        for l in range(L):
            for kv in range(2):
                off = ((i * L + l) * 2 + kv) * frag_elems
                f = flat[off : off + frag_elems]
                gather.append((f, src[l][kv, bid].reshape(-1)))
                scatter.append((dst[l][kv, bid].reshape(-1), f))
    flat_v = flat.reshape(nblocks, L, 2, frag_elems)
    src_v = [s.reshape(2, nblocks, frag_elems) for s in src]
    dst_v = [d.reshape(2, nblocks, frag_elems) for d in dst]
    copyto = np.copyto

    def memcpy_loop(pairs):
        t0 = time.perf_counter_ns()
        for a, b in pairs:
            copyto(a, b)
        return time.perf_counter_ns() - t0

    def gather_strided():
        t0 = time.perf_counter_ns()
        for l in range(L):
            copyto(flat_v[:, l].transpose(1, 0, 2), src_v[l])
        return time.perf_counter_ns() - t0

    def scatter_strided():
        t0 = time.perf_counter_ns()
        for l in range(L):
            copyto(dst_v[l], flat_v[:, l].transpose(1, 0, 2))
        return time.perf_counter_ns() - t0

    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None

    def _split(fn) -> int:
        # the same strided copies, layers dealt out over `threads` threads
        t0 = time.perf_counter_ns()
        if executor is None:
            fn(range(L))
        else:
            for f in [executor.submit(fn, range(p, L, threads)) for p in range(threads)]:
                f.result()
        return time.perf_counter_ns() - t0

    def _gather_layers(layers):
        for l in layers:
            copyto(flat_v[:, l].transpose(1, 0, 2), src_v[l])

    def _scatter_layers(layers):
        for l in layers:
            copyto(dst_v[l], flat_v[:, l].transpose(1, 0, 2))

    def contig():
        t0 = time.perf_counter_ns()
        copyto(flat2, flat)
        return time.perf_counter_ns() - t0

    pair = ThreadPoolExecutor(max_workers=1)

    def contig_2t():
        # the same contiguous copy, halves on two threads: the 2-thread limit for the core
        t0 = time.perf_counter_ns()
        split_copy(pair, flat2, flat, 2)
        return time.perf_counter_ns() - t0

    def baseline_check(order: list[int]) -> None:
        # the memcpy baselines must have copied the same fragments the pool gathers
        for i in {0, nblocks // 2, nblocks - 1}:
            for l in {0, L - 1}:
                if not np.array_equal(flat_v[i, l], src_v[l][:, order[i]]):
                    raise CommandError("memcpy baseline self-check failed", exit_code=ExitCode.CHECK_FAILED)

    chunk = min(max(8 * _MiB, pow2_at_least(16 * block_bytes)), 256 * _MiB)
    pool_size = 2 * nbytes + 4 * chunk + 64 * _MiB
    path = os.path.join(pool_dir, f"cxlkv-bench-copy-{os.getpid()}")
    if devices > 1:  # one pool striped over `devices` files
        path = ",".join(f"{path}-d{k}" for k in range(devices))
    t: dict[str, list[int]] = {
        k: []
        for k in (
            "store",
            "load",
            "gather_loop",
            "gather_strided",
            "scatter_loop",
            "scatter_strided",
            "contig",
            "gather_mt",
            "scatter_mt",
            "contig_2t",
        )
    }
    verified = False
    try:
        pool, ns = create_pool_for(
            path, pool_size, g, f"bench-{name}", 2 * nblocks, chunk_size=chunk, backend=backend
        )
        with pool:
            if ns.block_bytes != block_bytes:
                raise CommandError(f"namespace block_bytes {ns.block_bytes} != expected {block_bytes}")
            prev: list[bytes] = []
            keys: list[bytes] = []
            for it in range(iters + 1):  # round 0 warms up (page faults, chunk carving)
                for k in prev:  # store skips present keys: free the previous round's blocks
                    ns.delete(k)
                keys = [block_key("bench-copy", name, it, i) for i in range(nblocks)]
                t0 = time.perf_counter_ns()
                n = ns.store(keys, src, block_ids, block_dim=1)
                t_store = time.perf_counter_ns() - t0
                if n != nblocks:
                    raise CommandError(
                        f"bench copy: store stored {n} of {nblocks} blocks (pool of "
                        f"{format_size(pool_size)} too small?)"
                    )
                prev = keys
                t0 = time.perf_counter_ns()
                n = ns.load(keys, dst, block_ids, block_dim=1)
                t_load = time.perf_counter_ns() - t0
                if n != nblocks:
                    raise CommandError(
                        f"bench copy: load loaded {n} of {nblocks} blocks", exit_code=ExitCode.CHECK_FAILED
                    )
                if not verified:
                    for l in range(L):
                        if not np.array_equal(src[l], dst[l]):
                            raise CommandError(
                                f"bench copy: loaded bytes differ from the source (layer {l})",
                                exit_code=ExitCode.CHECK_FAILED,
                            )
                    verified = True
                    for d in dst:  # so that the scatter baseline below writes real changes
                        d.fill(1)
                t_gl = memcpy_loop(gather)
                if it == 0:
                    baseline_check(block_ids)
                t_gs = gather_strided()
                if it == 0:
                    baseline_check(list(range(nblocks)))
                t_sl = memcpy_loop(scatter)
                t_ss = scatter_strided()
                t_c = contig()
                t_c2 = contig_2t()
                t_gm = _split(_gather_layers)
                t_sm = _split(_scatter_layers)
                if it == 0:
                    continue
                t["gather_mt"].append(t_gm)
                t["scatter_mt"].append(t_sm)
                t["store"].append(t_store)
                t["load"].append(t_load)
                t["gather_loop"].append(t_gl)
                t["gather_strided"].append(t_gs)
                t["scatter_loop"].append(t_sl)
                t["scatter_strided"].append(t_ss)
                t["contig"].append(t_c)
                t["contig_2t"].append(t_c2)
            stats = pool.stats()
            info = pool.info()
            stripe_bytes = info["stripe_bytes"]
            page_bytes = info["page_bytes"]  # what the pool's mapping got, after every round
    finally:
        pair.shutdown()
        if executor is not None:
            executor.shutdown()
        try:
            cxlkv.Pool.destroy(path)
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001 - best-effort cleanup: the result (or error) is what counts
            pass

    med = {k: _gbps(nbytes, _med(v)) for k, v in t.items()}
    best = {k: _gbps(nbytes, min(v)) for k, v in t.items()}
    gather_base = max(("gather_loop", "gather_strided"), key=lambda k: med[k])
    scatter_base = max(("scatter_loop", "scatter_strided"), key=lambda k: med[k])
    r = {
        "geometry": name,
        "devices": devices,
        "stripe_bytes": stripe_bytes,
        "pool_dir": pool_dir,
        "page_bytes": page_bytes,
        "memcpy_page_bytes": _page_bytes(flat2),
        "layout": dict(g),
        "blocks": nblocks,
        "block_bytes": block_bytes,
        "fragments_per_block": L * 2,
        "fragment_bytes": frag_bytes,
        "batch_bytes": nbytes,
        "iters": iters,
        "verified": verified,
        "store_gbps": round(med["store"], 3),
        "load_gbps": round(med["load"], 3),
        "memcpy_gbps": round(med[gather_base], 3),
        "memcpy_scatter_gbps": round(med[scatter_base], 3),
        "memcpy_contig_gbps": round(med["contig"], 3),
        "memcpy_loop_gbps": round(med["gather_loop"], 3),
        "memcpy_strided_gbps": round(med["gather_strided"], 3),
        "memcpy_scatter_loop_gbps": round(med["scatter_loop"], 3),
        "memcpy_scatter_strided_gbps": round(med["scatter_strided"], 3),
        "memcpy_baseline": gather_base.replace("gather_", ""),
        "copy_threads": threads,
        "memcpy_mt_gbps": round(med["gather_mt"], 3),
        "memcpy_scatter_mt_gbps": round(med["scatter_mt"], 3),
        "store_vs_memcpy_mt": round(med["store"] / med["gather_mt"], 3),
        "load_vs_memcpy_mt": round(med["load"] / med["scatter_mt"], 3),
        "store_vs_memcpy": round(med["store"] / med[gather_base], 3),
        "load_vs_memcpy": round(med["load"] / med[scatter_base], 3),
        "store_vs_memcpy_contig": round(med["store"] / med["contig"], 3),
        "load_vs_memcpy_contig": round(med["load"] / med["contig"], 3),
        "memcpy_contig_2t_gbps": round(med["contig_2t"], 3),
        "store_vs_memcpy_contig_2t": round(med["store"] / med["contig_2t"], 3),
        "load_vs_memcpy_contig_2t": round(med["load"] / med["contig_2t"], 3),
        "store_best_gbps": round(best["store"], 3),
        "load_best_gbps": round(best["load"], 3),
        "memcpy_best_gbps": round(max(best["gather_loop"], best["gather_strided"]), 3),
        "memcpy_contig_best_gbps": round(best["contig"], 3),
        "store_ms": round(_med(t["store"]) / 1e6, 3),
        "load_ms": round(_med(t["load"]) / 1e6, 3),
    }
    for k in ("checksum_failures", "evictions"):
        r["pool_" + k] = stats[k]
    log(
        f"  store {r['store_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s, "
        f"memcpy {r['memcpy_gbps']:.2f} GB/s, contiguous memcpy {r['memcpy_contig_gbps']:.2f} GB/s "
        f"(pages: pool {format_size(page_bytes)}, memcpy {format_size(r['memcpy_page_bytes'])})"
    )
    return r


def print_copy_result(console, result: dict[str, Any]) -> None:
    from rich.table import Table

    rs = result["results"]
    t = Table(title="cxlkv bench copy (GB/s = 1e9 B/s, median of rounds)", title_justify="left")
    t.add_column("")
    for r in rs:
        t.add_column(r["geometry"], justify="right")
    rows = [
        ("batch", lambda r: f"{r['blocks']} x {format_size(r['block_bytes'])}"),
        ("fragments/block", lambda r: f"{r['fragments_per_block']} x {format_size(r['fragment_bytes'])}"),
        (
            "pages: pool / memcpy",
            lambda r: f"{format_size(r['page_bytes'])} / {format_size(r['memcpy_page_bytes'])}",
        ),
        ("store GB/s", lambda r: f"[bold]{r['store_gbps']:.2f}[/bold]"),
        ("load GB/s", lambda r: f"[bold]{r['load_gbps']:.2f}[/bold]"),
        ("memcpy gather GB/s", lambda r: f"{r['memcpy_gbps']:.2f} ({r['memcpy_baseline']})"),
        ("memcpy scatter GB/s", lambda r: f"{r['memcpy_scatter_gbps']:.2f}"),
        ("memcpy contiguous GB/s", lambda r: f"{r['memcpy_contig_gbps']:.2f}"),
        (
            "memcpy gather/scatter, N thr",
            lambda r: f"{r['memcpy_mt_gbps']:.2f} / {r['memcpy_scatter_mt_gbps']:.2f} ({r['copy_threads']})",
        ),
        ("store / memcpy", lambda r: _ratio(r["store_vs_memcpy"])),
        ("load / memcpy", lambda r: _ratio(r["load_vs_memcpy"])),
        ("store / memcpy N thr", lambda r: _ratio(r["store_vs_memcpy_mt"])),
        ("load / memcpy N thr", lambda r: _ratio(r["load_vs_memcpy_mt"])),
        ("store / contiguous", lambda r: _ratio(r["store_vs_memcpy_contig"])),
        ("load / contiguous", lambda r: _ratio(r["load_vs_memcpy_contig"])),
        ("bytes verified", lambda r: "yes" if r["verified"] else "[red]NO[/red]"),
    ]
    if all("striped" in r for r in rs):
        rows += [
            (
                "single file store / load GB/s",
                lambda r: f"{r['striped']['single_store_gbps']:.2f} / {r['striped']['single_load_gbps']:.2f}",
            ),
            (
                "striped store / load GB/s",
                lambda r: (
                    f"{r['striped']['store_gbps']:.2f} / {r['striped']['load_gbps']:.2f} "
                    f"({r['striped']['devices']} files)"
                ),
            ),
            (
                "striped / single file",
                lambda r: f"{r['striped']['store_vs_single']:.2f}x / {r['striped']['load_vs_single']:.2f}x",
            ),
        ]
    for label, f in rows:
        t.add_row(label, *[f(r) for r in rs])
    console.print(t)
    m = result.get("machine", {})
    kern = m.get("core_nt_copy_kernel")
    console.print(
        f"[dim]{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
        + (f", copy kernel {kern}" if kern else "")
        + f"; the core copies with up to {result.get('copy_threads')} thread(s) per batch"
        + ". memcpy gather/scatter: one thread, the faster "
        "of a per-fragment np.copyto loop and a strided numpy copy of the same fragments "
        "(load is compared with scatter); N thr: the strided copies over as many threads "
        "as the core uses; contiguous: one copy of the whole batch.[/dim]"
    )


def _ratio(x: float) -> str:
    style = "green" if x >= 0.9 else ("yellow" if x >= 0.7 else "red")
    return f"[{style}]{x:.2f}x[/{style}]"


# =============================================================================================
# bench index

_INDEX_LAYOUT = dict(
    model_id="cxlkv-bench-index", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=64, tokens_per_block=1
)  # 256-byte blocks
_INDEX_BLOCK = 256
_INDEX_NS = "bench-index"


def _index_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32, person=b"cxlkv-idx").digest()


def _pct(xs: list[int], p: float) -> int:
    """An integer nanosecond percentile (the tools' one rule: _common.percentile)."""
    return int(percentile(xs, p))


def _timer_overhead_ns(n: int = 20000) -> int:
    pc = time.perf_counter_ns
    xs = []
    for _ in range(n):
        a = pc()
        b = pc()
        xs.append(b - a)
    xs.sort()
    return _pct(xs, 50)


def _core_bench(ns, nkeys: int, lookups: int, seed: int, barrier, seconds: float = 1.0) -> dict:
    """C++-side index numbers via ``Namespace.bench_index``: it inserts ``nkeys`` fresh keys of
    256-byte blocks (per-op timed), then times random single lookups among them per op and back
    to back for ``seconds``, with no Python in the loop."""
    barrier.wait(timeout=300)
    return dict(
        ns.bench_index(inserts=nkeys, lookups=lookups, payload_bytes=_INDEX_BLOCK, seed=seed, seconds=seconds)
    )


_BATCH = 1000  # keys per match_prefix / store call in the batched measurements


def _index_worker(
    path: str, run: int, rank: int, nkeys: int, ops: int, samples: int, inserts: int, barrier, queue
) -> None:
    """One benchmark process: attach, time lookups and inserts (single calls and batches), report.
    Every phase starts at a barrier so that all processes run it at the same time."""
    try:
        pc = time.perf_counter_ns
        # multihost: every process its own row of the cross-host lock (0 is the parent's); other
        # backends ignore it
        os.environ["CXLKV_HOST_SLOT"] = str(rank + 1)
        # map every page now: measure the index, not this process's first-touch faults
        with cxlkv.Pool.open(path, populate=True) as pool:
            ns = pool.namespace(cxlkv.KVLayout(**_INDEX_LAYOUT), name=_INDEX_NS)
            keys = [_index_key(i) for i in range(nkeys)]
            rng = random.Random(1000 * run + rank)
            order = [keys[j] for j in rng.choices(range(nkeys), k=ops)]
            lat_keys = [keys[j] for j in rng.choices(range(nkeys), k=samples)]
            ins_keys = [block_key("bench-index-insert", run, rank, i) for i in range(inserts)]
            bins_keys = [block_key("bench-index-binsert", run, rank, i) for i in range(inserts)]
            lookup_batches = [order[i : i + _BATCH] for i in range(0, len(order), _BATCH)]
            insert_batches = [bins_keys[i : i + _BATCH] for i in range(0, len(bins_keys), _BATCH)]
            payload = bytes(range(256)) * (_INDEX_BLOCK // 256)
            payloads = np.frombuffer(payload * _BATCH, dtype=np.uint8).reshape(_BATCH, _INDEX_BLOCK).copy()
            contains, put, match = ns.contains, ns.put, ns.match_prefix
            for k in order[: min(len(order), 20000)]:  # warm caches and the code path
                contains(k)
            overhead = _timer_overhead_ns()

            # 1. single-call throughput: the whole run timed at once (no per-op timer cost)
            barrier.wait(timeout=300)
            c0 = time.process_time_ns()
            t0 = pc()
            hits = sum(map(contains, order))
            t1 = pc()
            cpu_share = (time.process_time_ns() - c0) / max(1, t1 - t0)

            # 2. single-call latency: every lookup timed on its own
            barrier.wait(timeout=300)
            lat = []
            append = lat.append
            for k in lat_keys:
                a = pc()
                contains(k)
                b = pc()
                append(b - a)

            # 3. batched lookups: match_prefix over _BATCH present keys = _BATCH index lookups in
            #    one call (Python overhead amortized; includes converting the keys)
            barrier.wait(timeout=300)
            blat = []
            bhits = 0
            tb0 = pc()
            for batch in lookup_batches:
                a = pc()
                bhits += match(batch)
                b = pc()
                blat.append((b - a) / len(batch))
            tb1 = pc()

            # 4. single-call inserts
            barrier.wait(timeout=300)
            ins = []
            append = ins.append
            failed = 0
            for k in ins_keys:
                a = pc()
                ok = put(k, payload)
                b = pc()
                append(b - a)
                if not ok:
                    failed += 1

            # 5. batched inserts: store() of _BATCH fresh 256-byte blocks per call
            barrier.wait(timeout=300)
            bins = []
            bstored = 0
            for batch in insert_batches:
                ids = list(range(len(batch)))
                a = pc()
                n = ns.store(batch, [payloads], ids, block_dim=0)
                b = pc()
                bins.append((b - a) / len(batch))
                bstored += n
            # 6. optional C++-side numbers (no Python in the timed loop), all processes at once
            # (as many random lookups as the Python throughput phase: the helper repeats that
            #  sequence for its throughput loop, so a short one would measure cache-resident keys)
            core = _core_bench(ns, nkeys, max(ops, samples), 1_000_003 * (run + 1) + rank, barrier)
        lat.sort()
        ins.sort()
        blat.sort()
        bins.sort()
        queue.put(
            {
                "rank": rank,
                "ok": True,
                "t0": t0,
                "t1": t1,
                "ops": ops,
                "hits": hits,
                "cpu_share": cpu_share,
                "lookups_per_s": ops / ((t1 - t0) / 1e9),
                "lookup_ns": [_pct(lat, 50), _pct(lat, 90), _pct(lat, 99), _pct(lat, 99.9)],
                "insert_ns": [_pct(ins, 50), _pct(ins, 90), _pct(ins, 99), _pct(ins, 99.9)],
                "lat_sample": lat[:: max(1, len(lat) // 2000)],
                "ins_sample": ins[:: max(1, len(ins) // 2000)],
                "insert_failed": failed,
                "tb0": tb0,
                "tb1": tb1,
                "batch_ops": sum(len(b) for b in lookup_batches),
                "batch_hits": bhits,
                "batch_lookup_ns": [_pct(blat, 50), _pct(blat, 99)],
                "batch_insert_ns": [_pct(bins, 50), _pct(bins, 99)],
                "batch_insert_failed": len(bins_keys) - bstored,
                "timer_overhead_ns": overhead,
                "core": core,
            }
        )
    except BaseException as e:  # noqa: BLE001 - report instead of hanging the parent
        report_failure(rank, barrier, queue, e)


def _run_index_procs(
    path: str, run: int, nprocs: int, nkeys: int, ops: int, samples: int, inserts: int
) -> dict[str, Any]:
    results = run_workers(
        _index_worker,
        nprocs,
        lambda r, barrier, q: (path, run, r, nkeys, ops, samples, inserts, barrier, q),
        "bench index",
        timeout_s=900,
    )
    total_ops = sum(r["ops"] for r in results)
    span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    bspan = max(r["tb1"] for r in results) - min(r["tb0"] for r in results)
    lat = sorted(x for r in results for x in r["lat_sample"])
    ins = sorted(x for r in results for x in r["ins_sample"])
    med = statistics.median
    core: dict[str, Any] = {}
    cores = [r["core"] for r in results]
    if cores:

        def cget(k):
            return [c[k] for c in cores if isinstance(c.get(k), (int, float))]

        if cget("lookups_per_s"):
            core["core_lookups_per_s"] = round(sum(cget("lookups_per_s")))
        if cget("inserts") and cget("inserts_per_s"):
            core["core_inserts_per_s"] = round(sum(cget("inserts_per_s")))
        for k in ("lookup_p50_ns", "insert_p50_ns", "lookup_mean_ns", "line_read_p50_ns"):
            if cget(k):
                core["core_" + k] = round(med(cget(k)))
        for k in _LIMIT_FIELDS:
            if cget(k):
                core["core_" + k] = round(med(cget(k)), 3)
        for k in ("lookup_p99_ns", "insert_p99_ns"):
            if cget(k):
                core["core_" + k] = round(max(cget(k)))
    return {
        **core,
        "procs": nprocs,
        "lookups_per_s": round(total_ops / (span / 1e9)),
        "per_proc_lookups_per_s": [round(r["lookups_per_s"]) for r in results],
        "lookup_p50_ns": int(med(r["lookup_ns"][0] for r in results)),
        "lookup_p99_ns": max(r["lookup_ns"][2] for r in results),
        "lookup_p999_ns": max(r["lookup_ns"][3] for r in results),
        "lookup_p50_ns_pooled": _pct(lat, 50),
        "insert_p50_ns": int(med(r["insert_ns"][0] for r in results)),
        "insert_p99_ns": max(r["insert_ns"][2] for r in results),
        "insert_p999_ns": max(r["insert_ns"][3] for r in results),
        "insert_p50_ns_pooled": _pct(ins, 50),
        "batch_lookups_per_s": round(sum(r["batch_ops"] for r in results) / (bspan / 1e9)),
        "batch_lookup_ns_p50": round(med(r["batch_lookup_ns"][0] for r in results), 1),
        "batch_lookup_ns_p99": round(max(r["batch_lookup_ns"][1] for r in results), 1),
        "batch_insert_ns_p50": round(med(r["batch_insert_ns"][0] for r in results), 1),
        "batch_insert_ns_p99": round(max(r["batch_insert_ns"][1] for r in results), 1),
        "lookup_misses": sum(r["ops"] - r["hits"] for r in results)
        + sum(r["batch_ops"] - r["batch_hits"] for r in results),
        "insert_failed": sum(r["insert_failed"] + r["batch_insert_failed"] for r in results),
        "timer_overhead_ns": int(med(r["timer_overhead_ns"] for r in results)),
        # CPU time / wall time of each process during the timed lookups: < 1 means it was
        # descheduled (more runnable processes than cores), which caps the scaling measured
        "cpu_share": [round(r["cpu_share"], 2) for r in results],
    }


# Read path against the memory's limit (from Namespace.bench_index, same process, same run):
# the batched prefix match of 256 keys per key, and the ratios to a dependent random line read.
_LIMIT_FIELDS = (
    "prefix256_match_ns_per_key",
    "prefix256_acquire_ns_per_key",
    "lookup_vs_line_read",
    "prefix256_vs_line_read",
)


def bench_index(
    procs: list[int] | None = None,
    ops: int = 300_000,
    keys: int = 100_000,
    samples: int = 20_000,
    inserts: int = 20_000,
    pool_dir: str = "/dev/shm",
    quiet: bool = False,
    backend: str = "coherent",
) -> dict[str, Any]:
    """Lookup/insert latency and multi-process lookup throughput on one pool of `backend`."""
    log = progress(quiet)
    cores = os.cpu_count() or 1
    if not procs:
        procs = []
        n = 1
        while n <= cores:
            procs.append(n)
            n *= 2
        if procs[-1] != cores:
            procs.append(cores)
    counts = sorted(set([1] + list(procs)))

    total_entries = keys + (2 * inserts + keys) * sum(counts) + 1024
    index_slots = pow2_at_least(2 * total_entries)  # load factor <= 0.5
    data = total_entries * (_INDEX_BLOCK + 8)
    pool_size = index_slots * 80 + int(data * 1.3) + 64 * _MiB
    path = os.path.join(pool_dir, f"cxlkv-bench-index-{os.getpid()}")
    runs: list[dict[str, Any]] = []
    saved_slot = os.environ.get("CXLKV_HOST_SLOT")
    if backend == "multihost":
        os.environ["CXLKV_HOST_SLOT"] = "0"  # this process's row; the workers take 1, 2, ...
    try:
        # enough room for every key inserted (no eviction in the timed inserts), 1 MiB chunks
        pool, ns = create_pool_for(
            path,
            pool_size,
            _INDEX_LAYOUT,
            _INDEX_NS,
            int(total_entries * 1.1),
            index_slots=index_slots,
            chunk_size=1 * _MiB,
            backend=backend,
        )
        log(
            f"bench index: pool {format_size(pool.size)}, {index_slots} index slots, prefill {keys} "
            f"keys, process counts {counts}"
        )
        with pool:
            payload = bytes(range(256)) * (_INDEX_BLOCK // 256)
            put = ns.put
            t0 = time.perf_counter_ns()
            for i in range(keys):
                if not put(_index_key(i), payload):
                    raise CommandError(f"bench index: prefill put failed at key {i} (pool full?)")
            log(f"  prefill {keys} keys: {(time.perf_counter_ns() - t0) / keys:.0f} ns/put from Python")
            for run, n in enumerate(counts):
                r = _run_index_procs(path, run, n, keys, ops, samples, inserts)
                log(
                    f"  {n} proc(s): {r['lookups_per_s'] / 1e6:.2f} M lookups/s, lookup p50 "
                    f"{r['lookup_p50_ns']} ns p99 {r['lookup_p99_ns']} ns, insert p50 "
                    f"{r['insert_p50_ns']} ns p99 {r['insert_p99_ns']} ns"
                )
                runs.append(r)
    finally:
        if saved_slot is None:
            os.environ.pop("CXLKV_HOST_SLOT", None)
        else:
            os.environ["CXLKV_HOST_SLOT"] = saved_slot
        try:
            cxlkv.Pool.destroy(path)
        except Exception:  # noqa: BLE001 - best-effort cleanup: the result (or error) is what counts
            pass

    base = runs[0]
    for r in runs:
        r["scaling"] = round(r["lookups_per_s"] / base["lookups_per_s"], 3)
        r["scaling_per_proc"] = round(r["scaling"] / r["procs"], 3)
        r["batch_scaling"] = round(r["batch_lookups_per_s"] / base["batch_lookups_per_s"], 3)
        r["batch_scaling_per_proc"] = round(r["batch_scaling"] / r["procs"], 3)
        if "core_lookups_per_s" in r and "core_lookups_per_s" in base:
            r["core_scaling"] = round(r["core_lookups_per_s"] / base["core_lookups_per_s"], 3)
            r["core_scaling_per_proc"] = round(r["core_scaling"] / r["procs"], 3)
    top = runs[-1]
    out: dict[str, Any] = {
        "bench": "index",
        "backend": backend,
        "procs": top["procs"],
        "lookup_p50_ns": base["lookup_p50_ns"],
        "lookup_p99_ns": base["lookup_p99_ns"],
        "insert_p50_ns": base["insert_p50_ns"],
        "insert_p99_ns": base["insert_p99_ns"],
        "lookups_per_s": top["lookups_per_s"],
        "lookups_per_s_1proc": base["lookups_per_s"],
        "scaling": top["scaling"],
        "scaling_per_proc": top["scaling_per_proc"],
        "batch_lookup_ns_p50": base["batch_lookup_ns_p50"],
        "batch_lookup_ns_p99": base["batch_lookup_ns_p99"],
        "batch_insert_ns_p50": base["batch_insert_ns_p50"],
        "batch_lookups_per_s": top["batch_lookups_per_s"],
        "batch_lookups_per_s_1proc": base["batch_lookups_per_s"],
        "batch_scaling": top["batch_scaling"],
        "batch_scaling_per_proc": top["batch_scaling_per_proc"],
        "timer_overhead_ns": base["timer_overhead_ns"],
        "keys": keys,
        "block_bytes": _INDEX_BLOCK,
        "index_slots": index_slots,
        "ops_per_proc": ops,
        "samples_per_proc": samples,
        "inserts_per_proc": inserts,
        "runs": runs,
    }
    if "core_lookups_per_s" in base:
        for k in (
            "core_lookup_p50_ns",
            "core_lookup_p99_ns",
            "core_lookup_mean_ns",
            "core_insert_p50_ns",
            "core_insert_p99_ns",
        ):
            if k in base:
                out[k] = base[k]
        if "core_line_read_p50_ns" in base:  # the limit, from the 1-process run like the latencies
            out["line_read_p50_ns"] = base["core_line_read_p50_ns"]
            for k in _LIMIT_FIELDS:
                if "core_" + k in base:
                    out[k] = base["core_" + k]
        out["core_lookups_per_s"] = top["core_lookups_per_s"]
        out["core_lookups_per_s_1proc"] = base["core_lookups_per_s"]
        out["core_scaling"] = top["core_scaling"]
        out["core_scaling_per_proc"] = top["core_scaling_per_proc"]
    out["percentile_method"] = PERCENTILE_METHOD
    out["machine"] = machine()
    out["notes"] = (
        "Latencies are single Python calls (ns.contains / ns.put of a 256-byte block) timed one by "
        "one with time.perf_counter_ns (timer_overhead_ns included) and are dominated by Python "
        "call overhead; top-level latencies are from the 1-process run, lookups_per_s and scaling "
        "from the largest process count (aggregate ops over the common wall-clock span). "
        "batch_* fields: match_prefix over 1000 present keys (1000 index lookups in one call) and "
        "store of 1000 fresh 256-byte blocks, timed per call and divided by 1000: the index cost "
        "with the Python call overhead amortized (key conversion still included). "
        "core_* fields come from Namespace.bench_index (timed in C++, no Python in the loop; "
        "each process inserts as many fresh keys as were prefilled, then looks them up; "
        "core_lookups_per_s: back-to-back lookups, summed over processes). "
        "line_read_p50_ns: a dependent random 64-byte read (pointer chase, one clock read per hop "
        "like core lookups) in a private mapping the size of the index; lookup_vs_line_read = "
        "core_lookup_p50_ns / line_read_p50_ns (goal <= 1.5); prefix256_*_ns_per_key: p50 of one "
        "match_prefix (or acquire) call over 256 random present keys, divided by 256; "
        "prefix256_vs_line_read (goal <= 0.5)."
    )
    return out


def print_index_result(console, result: dict[str, Any]) -> None:
    from rich.table import Table

    runs = result["runs"]
    t = Table(title="cxlkv bench index (latencies in ns)", title_justify="left")
    t.add_column("")
    for r in runs:
        t.add_column(f"{r['procs']} proc" + ("s" if r["procs"] > 1 else ""), justify="right")
    rows = [
        ("[bold]single calls[/bold] (contains / put)", None),
        ("lookups/s (all procs)", lambda r: f"{r['lookups_per_s'] / 1e6:.2f} M"),
        ("scaling vs 1 proc", lambda r: f"{r['scaling']:.2f}x ({r['scaling_per_proc']:.2f}/proc)"),
        ("lookup p50 / p99", lambda r: f"{r['lookup_p50_ns']} / {r['lookup_p99_ns']}"),
        ("insert p50 / p99", lambda r: f"{r['insert_p50_ns']} / {r['insert_p99_ns']}"),
        ("[bold]batches of 1000[/bold] (match_prefix / store)", None),
        ("lookups/s (all procs)", lambda r: f"{r['batch_lookups_per_s'] / 1e6:.2f} M"),
        (
            "scaling vs 1 proc",
            lambda r: f"{r['batch_scaling']:.2f}x ({r['batch_scaling_per_proc']:.2f}/proc)",
        ),
        (
            "lookup per key p50 / p99",
            lambda r: f"{r['batch_lookup_ns_p50']:.0f} / {r['batch_lookup_ns_p99']:.0f}",
        ),
        (
            "insert per key p50 / p99",
            lambda r: f"{r['batch_insert_ns_p50']:.0f} / {r['batch_insert_ns_p99']:.0f}",
        ),
        ("misses / failed inserts", lambda r: f"{r['lookup_misses']} / {r['insert_failed']}"),
        ("CPU share per proc", lambda r: " ".join(f"{x:.2f}" for x in r["cpu_share"])),
    ]
    if all("core_lookups_per_s" in r for r in runs):
        rows += [
            ("[bold]core[/bold] (C++ side, no Python)", None),
            ("lookups/s (all procs)", lambda r: f"{r['core_lookups_per_s'] / 1e6:.2f} M"),
            (
                "scaling vs 1 proc",
                lambda r: f"{r.get('core_scaling', 1):.2f}x ({r.get('core_scaling_per_proc', 1):.2f}/proc)",
            ),
            (
                "lookup p50 / p99",
                lambda r: f"{r.get('core_lookup_p50_ns', '-')} / {r.get('core_lookup_p99_ns', '-')}",
            ),
            (
                "insert p50 / p99",
                lambda r: f"{r.get('core_insert_p50_ns', '-')} / {r.get('core_insert_p99_ns', '-')}",
            ),
            ("line read p50 (the limit)", lambda r: f"{r.get('core_line_read_p50_ns', '-')}"),
            ("lookup / line read", lambda r: f"{r.get('core_lookup_vs_line_read', '-')}"),
            ("prefix-256 match ns/key", lambda r: f"{r.get('core_prefix256_match_ns_per_key', '-')}"),
            ("prefix-256 / line read", lambda r: f"{r.get('core_prefix256_vs_line_read', '-')}"),
        ]
    for label, f in rows:
        t.add_row(label, *[(f(r) if f else "") for r in runs])
    console.print(t)
    m = result.get("machine", {})
    console.print(
        f"[dim]{m.get('cpu', '?')}, {m.get('cores', '?')} cores; {result['keys']} keys of "
        f"{result['block_bytes']} B, {result['index_slots']} index slots. Single-call numbers "
        f"are Python calls timed one by one (timer ~{result['timer_overhead_ns']} ns included); "
        "batch numbers are per key, Python overhead amortized.[/dim]"
    )


# =============================================================================================
# coherent vs multihost, same run

# The headline fields each comparison reports as multihost / coherent (a latency ratio > 1 and a
# throughput ratio < 1 are both the discipline's cost).
COMPARE_FIELDS = {
    "copy": ("store_gbps", "load_gbps"),
    "index": (
        "lookup_p50_ns",
        "insert_p50_ns",
        "lookups_per_s",
        "batch_lookup_ns_p50",
        "batch_insert_ns_p50",
        "core_lookup_p50_ns",
        "core_insert_p50_ns",
        "core_lookups_per_s",
    ),
}


def compare_backends(
    run, backends: tuple[str, str] = ("coherent", "multihost"), **kwargs: Any
) -> dict[str, Any]:
    """Runs ``run(backend=b, **kwargs)`` (bench_copy or bench_index) for the baseline backend,
    then the other one, in this process, and reports the other's headline fields over the
    baseline's (``<other>_vs_<baseline>``)."""
    base_name, other_name = backends
    base = run(backend=base_name, **kwargs)
    other = run(backend=other_name, **kwargs)
    ratios = {
        f: round(other[f] / base[f], 3)
        for f in COMPARE_FIELDS[base["bench"]]
        if isinstance(base.get(f), (int, float)) and isinstance(other.get(f), (int, float)) and base[f]
    }
    return {
        "bench": base["bench"],
        "compare_backends": [base_name, other_name],
        f"{other_name}_vs_{base_name}": ratios,
        base_name: base,
        other_name: other,
    }
