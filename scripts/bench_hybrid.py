"""A hybrid model's KV capacity and pool bytes with the cxlkv connector (issue 22, Performance).

    flock /tmp/cxlkv-vllm.lock .venv/bin/python scripts/bench_hybrid.py [--words 3000] [--kv-mib 64]

Runs the tiny sliding-window Llama (python/cxlkv/testing/models.py ``tiny_swa_llama``: 2 of its 4
layers attend to a 256-token window) in vLLM's CPU engine (tests/vllm/llm_driver.py, one process
per engine), with the same KV cache memory:

* without a connector, and with cxlkv: the KV cache size and maximum concurrency vLLM reports at
  start-up, and whether its hybrid KV cache manager is on;
* with cxlkv, one long prompt stored on a cold pool: the pool bytes stored for it vs storing every
  group's every block (the connector's per-group counters, vllm:cxlkv_group_blocks).

Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "..", "tests", "vllm", "llm_driver.py")
CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"
)


def run(spec: dict) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    p = subprocess.run(
        [sys.executable, DRIVER, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=900
    )
    out = p.stdout + p.stderr
    results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not results:
        sys.exit("bench_hybrid: engine failed:\n" + "\n".join(out.splitlines()[-40:]))
    return results[-1], out


def capacity(log: str) -> dict:
    m = CAPACITY.search(log)
    if m is None:
        sys.exit("bench_hybrid: no KV cache size line in the engine's log")
    return {
        "kv_cache_tokens": int(m[1].replace(",", "")),
        "max_concurrency": float(m[3]),
        "per_request": int(m[2].replace(",", "")),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--kv-mib", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))
    from cxlkv.testing.prompts import seeded_words

    prompt = seeded_words(21, args.words)
    base = {"model": "tiny-swa", "kv_bytes": args.kv_mib << 20, "max_tokens": 4}
    plain, plain_log = run({**base, "connector": False, "rounds": [{"prompts": [{"prompt": "hello"}]}]})
    pool = f"/dev/shm/cxlkv-bench-hybrid-{uuid.uuid4().hex}"
    try:
        stored, cx_log = run(
            {**base, "pool": pool, "stats": True, "rounds": [{"prompts": [{"prompt": prompt}]}]}
        )
    finally:
        if os.path.exists(pool):
            os.unlink(pool)
    groups: dict = {}
    for key, n in stored["cxlkv"].items():
        m = re.match(r"vllm:cxlkv_group_blocks\{group=(\d+),outcome=(\w+)\}", key)
        if m:
            groups.setdefault(int(m[1]), {})[m[2]] = int(n)
    # the groups hold 2 layers each of the same shape: one block is the same bytes in each
    block_bytes = stored["cxlkv"].get("vllm:cxlkv_store_bytes", 0) / max(
        1, sum(g.get("stored", 0) for g in groups.values())
    )
    every = sum(g.get("stored", 0) + g.get("skipped", 0) for g in groups.values())
    kept = sum(g.get("stored", 0) for g in groups.values())
    print(
        json.dumps(
            {
                "model": "tiny-swa-llama (4 layers, 2 with a 256-token window), block 128 tokens",
                "kv_cache_bytes": args.kv_mib << 20,
                "without_connector": {**capacity(plain_log), "hybrid_manager": plain["hybrid"]},
                "with_cxlkv": {**capacity(cx_log), "hybrid_manager": stored["hybrid"]},
                "prompt_tokens": stored["outputs"][0]["len"],
                "groups": groups,
                "block_bytes": block_bytes,
                "pool_bytes_stored": kept * block_bytes,
                "pool_bytes_every_group_every_block": every * block_bytes,
                "ratio": round(kept / every, 3) if every else None,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
