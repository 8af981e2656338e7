"""``cxlkv demo``: several processes sharing one pool, printing hit rates and bandwidth.

The pool (the default pool, ``$CXLKV_POOL``, unless ``--pool``) is opened, or created if missing, and left in place
afterwards. Each process keeps a private "GPU" KV cache in vLLM's paged layout (per layer an array
``[2, num_blocks, 16, kv_heads, head_size]`` of bf16, SmolLM2-135M geometry: 30 layers, 3 KV heads,
head 64, 16-token blocks of 360 KiB) and serves requests over a catalogue of shared prompt prefixes
(system prompts, documents), each a chain of block keys as vLLM hashes them (every key depends on
its parent):

* **prefill** processes publish the catalogue: for each request they ``match_prefix`` the chain,
  ``load`` the blocks already in the pool (reuse) and ``store`` the KV they "computed" for the rest;
* **consumer** processes (decode side) request popular prefixes, ``match_prefix`` them and ``load``
  the hits into their own cache.

Every block's bytes are derived from its key, and every loaded block is verified.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any

import numpy as np

import cxlkv
from cxlkv.sizes import format_size
from cxlkv.tools._common import GEOMETRIES
from cxlkv.tools.workers import report_failure, run_workers

__all__ = ["DEMO_LAYOUT", "print_demo_result", "run_demo"]

DEMO_LAYOUT = GEOMETRIES["smollm2-135m"]
NAMESPACE = "demo"
DOCS = 64  # shared prefixes in the catalogue
MIN_DEPTH, MAX_DEPTH = 8, 24  # blocks per prefix (16 tokens each: 128..384 tokens)
CACHE_SLOTS = 64  # blocks in each process's private KV cache
_GOLD = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------------------------
# deterministic catalogue and payloads


def _chain(salt: bytes, doc: int) -> list[bytes]:
    depth = MIN_DEPTH + (doc * 7919) % (MAX_DEPTH - MIN_DEPTH + 1)
    keys = []
    parent = salt
    for j in range(depth):
        parent = hashlib.blake2b(
            parent + doc.to_bytes(4, "little") + j.to_bytes(4, "little"), digest_size=32
        ).digest()
        keys.append(parent)
    return keys


class _KV:
    """A process-private paged KV cache and the key -> bytes rule used to fill and verify it."""

    def __init__(self) -> None:
        g = DEMO_LAYOUT
        self.L = g["num_layers"]
        self.shape = (2, CACHE_SLOTS, g["tokens_per_block"], g["num_kv_heads"], g["head_size"])
        self.frag = g["tokens_per_block"] * g["num_kv_heads"] * g["head_size"]  # uint16 elements
        self.block_bytes = self.L * 2 * self.frag * 2
        self.layers = [np.zeros(self.shape, dtype=np.uint16) for _ in range(self.L)]
        self.pattern = np.arange(self.block_bytes // 8, dtype=np.uint64) * _GOLD

    def expected(self, keys: list[bytes]) -> np.ndarray:
        """[n, layers, 2, frag] uint16: the bytes of each block, in pool order."""
        seeds = np.array([int.from_bytes(k[:8], "little") for k in keys], dtype=np.uint64)
        words = self.pattern[None, :] ^ seeds[:, None]
        return words.view(np.uint16).reshape(len(keys), self.L, 2, self.frag)

    def fill(self, keys: list[bytes], slots: list[int]) -> None:
        e = self.expected(keys)
        n = len(keys)
        for l in range(self.L):
            self.layers[l][:, slots] = e[:, l].transpose(1, 0, 2).reshape((2, n) + self.shape[2:])

    def poison(self, slots: list[int]) -> None:
        for layer in self.layers:
            layer[:, slots] = 0xDEAD

    def verify(self, keys: list[bytes], slots: list[int]) -> int:
        """Number of blocks whose cached bytes differ from what their key implies."""
        if not keys:
            return 0
        n = len(keys)
        got = np.stack([layer[:, slots].reshape(2, n, self.frag) for layer in self.layers])
        got = got.transpose(2, 0, 1, 3)  # [n, layers, 2, frag]
        exp = self.expected(keys)
        return int(np.count_nonzero((got != exp).reshape(n, -1).any(axis=1)))


# ---------------------------------------------------------------------------------------------
# worker


def _open_populated(path: str) -> cxlkv.Pool:
    """Attach with every page mapped up front (as a long-lived engine would), so the copies below
    measure memory bandwidth rather than this process's first-touch page faults. Only for file
    pools of up to 4 GiB: mapping a huge pool in every worker would cost more than it shows."""
    import stat

    try:
        st = os.stat(path)
        small_file = stat.S_ISREG(st.st_mode) and st.st_size <= (4 << 30)
    except OSError:
        small_file = False
    return cxlkv.Pool.open(path, populate=small_file)


def _copy_threads(procs: int) -> int:
    """Copy threads per process: the cores shared out among the demo's processes (more would only
    make the processes wait for each other's threads on a small machine)."""
    return max(1, (os.cpu_count() or 1) // max(1, procs))


def _worker(
    path: str, rank: int, role: str, nprefill: int, salt: bytes, seconds: float, procs: int, barrier, queue
) -> None:
    try:
        cxlkv._core.set_copy_threads(_copy_threads(procs))

        kv = _KV()
        chains = [_chain(salt, d) for d in range(DOCS)]
        rng = random.Random(rank * 7 + 1)
        weights = [1.0 / (d + 1) ** 0.8 for d in range(DOCS)]  # popular prefixes first
        st = dict(
            rank=rank,
            role=role,
            pid=os.getpid(),
            requests=0,
            blocks_requested=0,
            blocks_hit=0,
            blocks_stored=0,
            store_failed=0,
            bytes_stored=0,
            store_ns=0,
            blocks_loaded=0,
            bytes_loaded=0,
            load_ns=0,
            load_short=0,
            verify_errors=0,
            node_id=None,
        )
        with _open_populated(path) as pool:
            st["node_id"] = pool.node_id
            ns = pool.namespace(cxlkv.KVLayout(**DEMO_LAYOUT), name=NAMESPACE)
            bb = ns.block_bytes
            barrier.wait(timeout=120)
            start = time.monotonic()
            deadline = start + seconds
            if role == "prefill":
                own = list(range(rank, DOCS, nprefill))  # first pass: this process's share
                interval = 0.5 * seconds / max(1, len(own))
            else:
                own, interval = [], 0.002
            i = 0
            while True:
                now = time.monotonic()
                if now >= deadline:
                    break
                if role == "prefill":
                    due = start + i * interval
                    if now < due:
                        time.sleep(min(due - now, deadline - now))
                        continue
                    doc = own[i] if i < len(own) else rng.choices(range(DOCS), weights)[0]
                    keys = chains[doc]
                else:
                    doc = rng.choices(range(DOCS), weights)[0]
                    chain = chains[doc]
                    keys = chain[: rng.randint(max(1, len(chain) // 2), len(chain))]
                i += 1
                m = len(keys)
                slots = rng.sample(range(CACHE_SLOTS), m)
                st["requests"] += 1
                st["blocks_requested"] += m
                h = ns.match_prefix(keys)
                st["blocks_hit"] += h
                if h:
                    kv.poison(slots[:h])
                    t0 = time.perf_counter_ns()
                    got = ns.load(keys[:h], kv.layers, slots[:h], block_dim=1)
                    st["load_ns"] += time.perf_counter_ns() - t0
                    st["blocks_loaded"] += got
                    st["bytes_loaded"] += got * bb
                    if got < h:
                        st["load_short"] += 1  # evicted between match and load: a miss, not an error
                    st["verify_errors"] += kv.verify(keys[:got], slots[:got])
                if role == "prefill" and h < m:
                    kv.fill(keys[h:], slots[h:])  # "compute" the missing KV
                    t0 = time.perf_counter_ns()
                    n = ns.store(keys[h:], kv.layers, slots[h:], block_dim=1)
                    st["store_ns"] += time.perf_counter_ns() - t0
                    # store returns the leading keys present afterwards (stored or already there)
                    st["blocks_stored"] += n
                    st["bytes_stored"] += n * bb
                    if n < m - h:
                        st["store_failed"] += m - h - n
                if role != "prefill":
                    time.sleep(interval)
            st["seconds"] = time.monotonic() - start
        queue.put({"ok": True, **st})
    except BaseException as e:  # noqa: BLE001 - report instead of hanging the parent
        report_failure(rank, barrier, queue, e)


# ---------------------------------------------------------------------------------------------
# driver


def _gbps(b: int, ns: int) -> float | None:
    return round(b / ns, 2) if ns > 0 else None


_TOTAL_KEYS = (
    "requests",
    "blocks_requested",
    "blocks_hit",
    "blocks_stored",
    "store_failed",
    "bytes_stored",
    "store_ns",
    "blocks_loaded",
    "bytes_loaded",
    "load_ns",
    "load_short",
    "verify_errors",
)


def _hit_rate(r: dict[str, Any]) -> float:
    return r["blocks_hit"] / r["blocks_requested"] if r["blocks_requested"] else 0.0


def run_demo(
    pool_path: str | None = None,
    procs: int = 4,
    seconds: float = 8.0,
    size: int | str = cxlkv.DEFAULT_POOL_SIZE,
    console: Any = None,
) -> dict[str, Any]:
    """Runs the demo on ``pool_path`` (default: the default pool), creating a pool of ``size`` if
    there is none, and returns its summary (``verify_errors`` > 0: wrong bytes were read back).
    Progress lines go to ``console`` (a rich Console), if given."""
    pool_path = pool_path or cxlkv.default_pool_path()
    if console is None:
        from rich.console import Console

        console = Console(quiet=True)
    con = console
    existed = os.path.exists(pool_path)
    pool = cxlkv.Pool.open(pool_path) if existed else cxlkv.Pool.open_or_create(pool_path, size)
    with pool:
        ns = pool.namespace(cxlkv.KVLayout(**DEMO_LAYOUT), name=NAMESPACE)
        nprefill = max(1, (procs + 1) // 2) if procs > 1 else 1
        roles = ["prefill"] * nprefill + ["consumer"] * (procs - nprefill)
        salt = os.urandom(16)  # a fresh catalogue each run: hit rates start cold
        catalogue_blocks = sum(len(_chain(salt, d)) for d in range(DOCS))
        con.print(
            f"[bold]cxlkv demo[/bold]: {procs} processes ({roles.count('prefill')} prefill, "
            f"{roles.count('consumer')} consumer) sharing "
            f"{'existing' if existed else 'new'} pool {pool_path} ({format_size(pool.size)}), "
            f"{seconds:g} s"
        )
        con.print(
            f"  model layout {DEMO_LAYOUT['model_id']}: blocks of {format_size(ns.block_bytes)}; "
            f"catalogue of {DOCS} shared prefixes = {catalogue_blocks} blocks "
            f"({format_size(catalogue_blocks * ns.block_bytes)}); "
            f"{_copy_threads(procs)} copy thread(s) per process on {os.cpu_count()} cores"
        )

        t_start = time.monotonic()
        results = run_workers(
            _worker,
            procs,
            lambda r, barrier, q: (pool_path, r, roles[r], nprefill, salt, seconds, procs, barrier, q),
            "demo",
            timeout_s=seconds + 120,
        )
        wall = time.monotonic() - t_start
        stats = pool.stats()
        pool_size, block_bytes = pool.size, ns.block_bytes

    total = {k: sum(r[k] for r in results) for k in _TOTAL_KEYS}
    run_s = max(r["seconds"] for r in results)
    summary = {
        "pool": pool_path,
        "pool_size": pool_size,
        "pool_existed": existed,
        "procs": procs,
        "seconds": round(run_s, 2),
        "wall_seconds": round(wall, 2),
        "block_bytes": block_bytes,
        "copy_threads_per_proc": _copy_threads(procs),
        "hit_rate": round(_hit_rate(total), 4),
        "consumer_hit_rate": round(
            sum(r["blocks_hit"] for r in results if r["role"] == "consumer")
            / max(1, sum(r["blocks_requested"] for r in results if r["role"] == "consumer")),
            4,
        ),
        "store_gbps": _gbps(total["bytes_stored"], total["store_ns"]),
        "load_gbps": _gbps(total["bytes_loaded"], total["load_ns"]),
        "stored_gb_per_s_wall": round(total["bytes_stored"] / run_s / 1e9, 3),
        "loaded_gb_per_s_wall": round(total["bytes_loaded"] / run_s / 1e9, 3),
        **total,
        "processes": [
            {
                **r,
                "hit_rate": round(_hit_rate(r), 4),
                "store_gbps": _gbps(r["bytes_stored"], r["store_ns"]),
                "load_gbps": _gbps(r["bytes_loaded"], r["load_ns"]),
            }
            for r in results
        ],
        "pool_stats": stats,
    }
    return summary


def print_demo_result(con: Any, summary: dict[str, Any]) -> None:
    """The demo's summary as tables on ``con`` (a rich Console)."""
    from rich import box
    from rich.table import Table

    procs, pool_path, run_s = summary["procs"], summary["pool"], summary["seconds"]
    results = summary["processes"]
    total = {k: summary[k] for k in _TOTAL_KEYS}
    stats = summary["pool_stats"]
    t = Table(
        title=f"cxlkv demo: {procs} processes sharing {pool_path}, {run_s:.1f} s",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for c in ("proc", "role", "reqs", "hit/asked", "hit %", "stored", "GB/s", "loaded", "GB/s ", "bad"):
        t.add_column(c, justify="left" if c in ("proc", "role") else "right", no_wrap=True)

    def row(name, role, r, last=False):
        t.add_row(
            name,
            role,
            str(r["requests"]),
            f"{r['blocks_hit']}/{r['blocks_requested']}",
            f"[bold]{100 * _hit_rate(r):.1f}%[/bold]",
            _mib(r["bytes_stored"]),
            _fmt_gbps(r["bytes_stored"], r["store_ns"]),
            _mib(r["bytes_loaded"]),
            _fmt_gbps(r["bytes_loaded"], r["load_ns"]),
            ("[red]" if r["verify_errors"] else "[green]") + str(r["verify_errors"]),
            end_section=last,
        )

    for i, r in enumerate(results):
        row(str(r["rank"]), r["role"], r, last=(i == len(results) - 1))
    row("all", "", total)
    con.print(t)
    con.print(
        f"  hit/asked: blocks found by match_prefix / blocks requested; bad: loaded blocks "
        f"with wrong bytes. GB/s: bytes "
        f"moved / time inside store and load calls; over the whole run: "
        f"{summary['stored_gb_per_s_wall']:.2f} GB/s stored, "
        f"{summary['loaded_gb_per_s_wall']:.2f} GB/s loaded."
    )
    if total["load_short"] or total["store_failed"]:
        con.print(
            f"  {total['load_short']} loads came up short (blocks evicted between match and "
            f"load), {total['store_failed']} blocks could not be stored (pool full)."
        )
    extra = _stats_line(stats)
    if extra:
        con.print(f"  pool: {extra}")
    if total["verify_errors"]:
        con.print(f"[bold red]{total['verify_errors']} loaded blocks had wrong bytes[/bold red]")
    else:
        con.print("  every loaded block matched the bytes its key implies.")
    con.print(
        f"The pool stays in place. Inspect it with: [bold]cxlkv pool stats {pool_path}[/bold]"
        f"  (remove it with: cxlkv pool destroy {pool_path})"
    )


def _mib(b: int) -> str:
    return f"{b / (1 << 20):.0f}M" if b else "-"


def _fmt_gbps(b: int, ns: int) -> str:
    return f"{b / ns:.2f}" if ns > 0 and b > 0 else "-"


def _stats_line(stats: Any) -> str:
    if not isinstance(stats, dict):
        return ""
    parts = []
    cap, used = stats.get("capacity_blocks"), stats.get("used_blocks")
    if isinstance(cap, int) and isinstance(used, int):
        parts.append(f"{used} of {cap} carved blocks in use")
    for key, label in (
        ("free_chunks", "free chunks"),
        ("evictions", "evictions"),
        ("checksum_failures", "checksum failures"),
        ("namespaces", "namespaces"),
    ):
        v = stats.get(key)
        if isinstance(v, int):
            parts.append(f"{label} {v}")
    return ", ".join(parts)
