"""What the benchmarks and demos share: model geometries, block keys, the one percentile rule,
the machine inventory, progress lines and a benchmark pool sized to hold what it must.

Imports only the public API (``cxlkv``, ``cxlkv.errors``), and numpy where it is used (the CLI
reads GEOMETRIES for its help without paying for numpy): never the CLI.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import cxlkv
from cxlkv.errors import CommandError

__all__ = [
    "GEOMETRIES",
    "PERCENTILE_METHOD",
    "block_key",
    "create_pool_for",
    "machine",
    "percentile",
    "pow2_at_least",
    "progress",
]

MiB = 1 << 20

# KV geometries of real models, shared by `bench copy` and `demo` (vLLM's paged layout, bf16).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        model_id="meta-llama/Meta-Llama-3-8B",
        dtype="bf16",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        tokens_per_block=16,
    ),
    "smollm2-135m": dict(
        model_id="HuggingFaceTB/SmolLM2-135M",
        dtype="bf16",
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
        tokens_per_block=16,
    ),
}

# Every percentile a tool reports: the nearest rank on (n - 1), numpy's "nearest" method; named in
# each result so figures from different runs are known to use the same estimator.
PERCENTILE_METHOD = "nearest"


def percentile(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``xs`` by :data:`PERCENTILE_METHOD`; 0 for no data."""
    import numpy as np

    if len(xs) == 0:
        return 0.0
    return float(np.percentile(np.asarray(xs), p, method=PERCENTILE_METHOD))


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def block_key(*parts: Any) -> bytes:
    """A 32-byte pool key derived from ``parts`` (each as bytes or its str), NUL-separated."""
    h = hashlib.blake2b(digest_size=32)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\x00")
    return h.digest()


def progress(quiet: bool) -> Callable[[str], None]:
    """A function that prints one dim progress line on stderr (nothing when ``quiet``)."""
    if quiet:
        return lambda msg: None
    from rich.console import Console

    con = Console(stderr=True, highlight=False)
    return lambda msg: con.print(f"[dim]{msg}[/dim]")


def machine() -> dict[str, Any]:
    """The machine a result was measured on: CPU model, cores, versions, the core's copy kernel."""
    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "core_nt_copy_kernel": cxlkv._core.nt_copy_kernel(),
        "core_checksum_copy_kernel": cxlkv._core.checksum_copy_kernel(),
    }


def create_pool_for(
    path: str, size: int, layout: dict[str, Any], ns_name: str, need_blocks: int, **create_kwargs: Any
) -> tuple[cxlkv.Pool, cxlkv.Namespace]:
    """Create a pool whose namespace ``ns_name`` can hold ``need_blocks`` blocks at once (how many
    blocks a chunk holds is the core's business, so measure it and grow the pool if short).
    Returns (pool, namespace)."""
    for _ in range(4):
        pool = cxlkv.Pool.create(path, size, **create_kwargs)
        try:
            ns = pool.namespace(cxlkv.KVLayout(**layout), name=ns_name)
            per_chunk = ns.blocks_per_chunk
            info = pool.info()
        except BaseException:
            pool.close()
            cxlkv.Pool.destroy(path)
            raise
        chunks = info["chunk_count"]
        if per_chunk * chunks >= need_blocks:
            return pool, ns
        pool.close()
        cxlkv.Pool.destroy(path)
        missing_chunks = -(-need_blocks // per_chunk) - chunks
        size += (missing_chunks + 2) * info["chunk_bytes"]
    raise CommandError(f"cannot size a benchmark pool for {need_blocks} blocks")


def split_copy(pool: Any, dst: Any, src: Any, parts: int) -> None:
    """``np.copyto(dst, src)`` of two flat arrays in ``parts`` contiguous slices: the first on the
    calling thread, the others on ``pool`` (a ``ThreadPoolExecutor``; numpy releases the GIL).
    The memcpy baselines' many-thread limit."""
    import numpy as np

    cut = [len(dst) * p // parts for p in range(parts + 1)]
    futs = [
        pool.submit(np.copyto, dst[cut[p] : cut[p + 1]], src[cut[p] : cut[p + 1]]) for p in range(1, parts)
    ]
    np.copyto(dst[: cut[1]], src[: cut[1]])
    for f in futs:
        f.result()
