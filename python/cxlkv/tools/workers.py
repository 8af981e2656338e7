"""Running N worker processes that start together at a barrier and report one dict each through
a queue (``{"rank": r, "ok": bool, ...}``): shared by ``cxlkv bench index`` and ``cxlkv demo``."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from collections.abc import Callable
from typing import Any

from cxlkv.errors import CommandError


def report_failure(rank: int, barrier, queue, exc: BaseException) -> None:
    """Called by a worker in its `except BaseException`: releases the others from the barrier and
    reports the error (with its traceback) instead of leaving the parent waiting."""
    import traceback

    try:
        barrier.abort()
    except Exception:  # noqa: BLE001 - the barrier may already be broken
        pass
    queue.put(
        {
            "rank": rank,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    )


def run_workers(
    target: Callable, nprocs: int, args_of: Callable[[int, Any, Any], tuple], what: str, timeout_s: float
) -> list[dict[str, Any]]:
    """Spawns target(*args_of(rank, barrier, queue)) for each rank and returns their reports,
    sorted by rank. A worker that died or reported ok=False raises CommandError (the root cause
    first: the others then fail at the aborted barrier)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nprocs)
    q = ctx.Queue()
    procs = [
        ctx.Process(target=target, name=f"cxlkv-{what.replace(' ', '-')}-{r}", args=args_of(r, barrier, q))
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < nprocs:
            try:
                results.append(q.get(timeout=0.5))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise CommandError(f"{what}: workers did not finish in time") from None
                if all(not p.is_alive() for p in procs) and q.empty():
                    raise CommandError(
                        f"{what}: {nprocs - len(results)} worker(s) died "
                        f"(exit codes {[p.exitcode for p in procs]})"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    bad = sorted(
        (r for r in results if not r.get("ok")), key=lambda r: r["error"].startswith("BrokenBarrierError")
    )
    if bad:
        raise CommandError(
            f"{what} worker {bad[0]['rank']} failed: {bad[0]['error']}", detail=bad[0].get("traceback", "")
        )
    return sorted(results, key=lambda r: r["rank"])
