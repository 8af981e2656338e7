"""A tenant's engine in its own process (tests/python/test_quota.py): opens the pool, the shared
model's namespace as `--tenant`, and puts `--chains` new prefix chains of `--depth` blocks each
(keys from `--salt`), or checks that such chains are all present (`--verify`). Prints one JSON
line: puts stored/refused, blocks found, this process's view of the counters."""

from __future__ import annotations

import argparse
import json
import sys

import cxlkv
import cxlkv_testutil as tu
from conftest import small_layout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", required=True)
    ap.add_argument("--tenant", required=True)
    ap.add_argument("--salt", required=True)
    ap.add_argument("--chains", type=int, required=True)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    with cxlkv.Pool.open(a.pool) as pool:
        ns = pool.namespace(small_layout(), tenant=a.tenant)
        stored = refused = found = 0
        for c in range(a.chains):
            keys = tu.chain_keys(f"{a.salt}-{c}", a.depth, salt=a.salt)
            if a.verify:
                found += ns.match_prefix(keys)
                continue
            for d, k in enumerate(keys):
                if ns.put(k, k * 128, d):  # 4 KiB of bytes derived from the key
                    stored += 1
                else:
                    refused += 1
        s = pool.stats()
        print(
            json.dumps(
                {
                    "stored": stored,
                    "refused": refused,
                    "found": found,
                    "puts_over_quota": s["puts_over_quota"],
                    "quota_evictions": s["quota_evictions"],
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
