"""Saving's cost on requests that miss (issue 16 item 2): TTFT of new prompts (every one a miss:
distinct words, prefix caching on, nothing in the pool) on plain vLLM and on vLLM with the cxlkv
connector (which saves every block of each), the engines run alternately, each a fresh process.
TTFT = wall time of a one-token generate, one request at a time after a warm-up request.

    flock /tmp/cxlkv-vllm.lock python tests/vllm/ttft_miss.py [--model smollm2] [--prompts 8]
        [--words 1500] [--repeats 2]
"""

import argparse
import os
import statistics
import subprocess
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_engine, words


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    ttft: dict = {"plain": [], "cxlkv": []}
    for rep in range(a.repeats):
        for cfg in ("plain", "cxlkv"):
            pool = f"/dev/shm/cxlkv-ttft-{uuid.uuid4().hex}"
            seed = 1000 * (rep + 1) + (0 if cfg == "plain" else 500)
            rounds = [{"prompts": [{"prompt": words(seed - 1, 50)}]}]  # warm-up
            rounds += [{"prompts": [{"prompt": words(seed + i, a.words)}]} for i in range(a.prompts)]
            spec = {
                "model": a.model,
                "pool": pool,
                "connector": cfg == "cxlkv",
                "max_tokens": 1,
                "max_model_len": 4096,
                "rounds": rounds,
            }
            res = run_engine(spec)
            ttft[cfg] += [r["seconds"] * 1000 for r in res[1:]]
            if os.path.exists(pool):
                os.unlink(pool)
            print(cfg, rep, [round(r["seconds"] * 1000) for r in res[1:]], flush=True)
    p, c = statistics.median(ttft["plain"]), statistics.median(ttft["cxlkv"])
    print(
        f"median TTFT of misses: plain {p:.0f} ms, cxlkv {c:.0f} ms, ratio {c / p:.3f} "
        f"({len(ttft['plain'])} requests each)"
    )
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
