"""What one `cxlkv events` poll costs: the index scan (core) and the diff (services/events.py) on a
pool holding N blocks, against a baseline measured in the same run: copying the index area
once (index_slots x 64 bytes, the least any scan must read).

    .venv/bin/python scripts/bench_events_scan.py [--size 4GiB] [--blocks 100000]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import time

import cxlkv
from cxlkv.index_scan import scan_index
from cxlkv.services.events import PoolEventSource


def best(fn, n=5) -> float:
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--blocks", type=int, default=100_000)
    a = ap.parse_args()
    path = f"/dev/shm/cxlkv-bench-events-{os.getpid()}"
    pool = cxlkv.Pool.create(path, a.size)
    try:
        info = pool.info()
        layout = cxlkv.KVLayout(model_id="bench", num_layers=1, num_kv_heads=1, head_size=8, block_bytes=4096)
        ns = pool.namespace(layout, name="kv1-bench")
        for i in range(a.blocks):
            ns.put(hashlib.sha256(i.to_bytes(8, "little")).digest(), b"x" * 4096)
        live = len(scan_index(pool))
        area = info["index_slots"] * 64
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            copy = best(lambda: bytes(m[info["index_off"] : info["index_off"] + area]))
        scan = best(lambda: scan_index(pool))
        src = PoolEventSource(pool, record_wait_s=0)
        t0 = time.perf_counter()
        src.poll()
        first = time.perf_counter() - t0
        idle = best(src.poll)
        print(
            f"index_slots {info['index_slots']}, live blocks {live}: copy of the index area {copy * 1e3:.1f} ms; "
            f"scan_index {scan * 1e3:.1f} ms ({scan / copy:.1f}x the copy); events poll: idle "
            f"{idle * 1e3:.1f} ms ({idle / copy:.1f}x), first (announces every block) {first * 1e3:.0f} ms"
        )
    finally:
        pool.close()
        os.unlink(path)


if __name__ == "__main__":
    main()
