"""Saving's cost on requests that miss (issue 16 item 2: <= 2 % of their TTFT): plain vLLM, vLLM
with the cxlkv connector saving synchronously ("async_saves": false) and asynchronously (the
default), as three live engines side by side, each its own process and pool.

Every prompt is new (distinct words; a miss in each engine: separate pools, its own prefix cache)
and goes to the three engines one after another, one request at a time, in an order that rotates
per prompt, so that load drifting on a shared machine falls on every configuration alike. TTFT is
the wall time of a one-token generate inside the engine's process (the connector's work in the
step, sync saves included, is in it). Prints per configuration the median TTFT and the median of
the per-prompt ratios to plain vLLM, the blocks each pool holds (the saves happened), the save
copies' time per request (the connector's store-seconds histogram: what a sync save adds to the
step, with far less noise than a TTFT difference on a loaded machine), `uptime`.

    flock /tmp/cxlkv-vllm.lock .venv/bin/python tests/vllm/ttft_miss.py [--model smollm2]
        [--prompts 12] [--words 1500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import words

CONFIGS = ("plain", "sync", "async")


def serve(cfg: str, model: str, pool: str) -> None:
    """Child: one engine; reads one JSON prompt per stdin line, answers `TTFT <seconds>`."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: three engines share the machine
    from vllm import LLM, SamplingParams

    from cxlkv.testing import models

    path = models.tiny_llama() if model == "tiny" else models.smollm2() if model == "smollm2" else model
    # Stats on: the connector's store-seconds histogram (what a sync save adds to the step).
    kw: dict = dict(model=path, enforce_eager=True, max_model_len=4096, seed=0, disable_log_stats=False)
    if cfg != "plain":
        kw["kv_transfer_config"] = {
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "pool_path": pool,
                "pool_size": "2GiB",
                "async_saves": cfg == "async",
            },
        }
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    print("READY", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        llm.generate([json.loads(line)], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        store = [m for m in llm.get_metrics() if m.name == "vllm:cxlkv_store_seconds"]
        copy_s, copies = (sum(m.sum for m in store), sum(m.count for m in store)) if store else (0.0, 0)
        print(f"TTFT {seconds:.6f} {copy_s:.6f} {copies}", flush=True)


class Engine:
    def __init__(self, cfg: str, model: str, log_dir: str) -> None:
        self.cfg, self.pool = cfg, f"/dev/shm/cxlkv-ttft-{cfg}-{uuid.uuid4().hex}"
        self.log = open(os.path.join(log_dir, f"ttft-{cfg}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", cfg, "--model", model, "--pool", self.pool],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def expect(self, prefix: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # vLLM's own log lines are skipped
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if time.monotonic() > deadline:
                break
        raise SystemExit(f"ttft_miss: the {self.cfg} engine stopped answering (log: {self.log.name})")

    def ttft_ms(self, prompt: str) -> float:
        """The request's TTFT; the engine's save copies so far in self.copy_s, self.copies."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        seconds, copy_s, copies = self.expect("TTFT ").split()
        self.copy_s, self.copies = float(copy_s), int(copies)
        return float(seconds) * 1000

    def pool_blocks(self) -> int | None:
        if self.cfg == "plain":
            return None
        import cxlkv

        with cxlkv.Pool.open(self.pool) as pool:
            return int(pool.stats()["puts"])

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if os.path.exists(self.pool):
            os.unlink(self.pool)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--json", help="write the per-request TTFTs here")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--serve", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--pool", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.model, a.pool)
    engines = [Engine(c, a.model, a.log_dir) for c in CONFIGS]
    try:
        for e in engines:
            e.expect("READY")
        for e in engines:  # warm-up
            e.ttft_ms(words(999, 50))
        copy0 = {e.cfg: e.copy_s for e in engines}
        ttft: dict = {c: [] for c in CONFIGS}
        for i in range(a.prompts):
            prompt = words(5000 + i, a.words)
            order = engines[i % 3 :] + engines[: i % 3]
            for e in order:
                ttft[e.cfg].append(e.ttft_ms(prompt))
            print(
                f"prompt {i + 1}/{a.prompts}: " + ", ".join(f"{c} {ttft[c][-1]:.0f} ms" for c in CONFIGS),
                flush=True,
            )
        time.sleep(1)  # the last async copies are accounted on the engine's next steps
        for e in engines:
            e.ttft_ms(words(998, 20))  # one more step to report them (not counted)
        copy_ms = {e.cfg: (e.copy_s - copy0[e.cfg]) * 1000 / a.prompts for e in engines}
        blocks = {e.cfg: e.pool_blocks() for e in engines}
    finally:
        for e in engines:
            e.stop()
    med = {c: statistics.median(v) for c, v in ttft.items()}
    for c in ("sync", "async"):
        ratios = [x / p for x, p in zip(ttft[c], ttft["plain"], strict=True)]
        print(
            f"{c}: median TTFT {med[c]:.0f} ms vs plain {med['plain']:.0f} ms: ratio of medians "
            f"{med[c] / med['plain']:.4f}, median per-prompt ratio {statistics.median(ratios):.4f} "
            f"({len(ratios)} prompts; blocks saved: {blocks[c]}); save copies {copy_ms[c]:.1f} ms per "
            f"request = {copy_ms[c] / med['plain'] * 100:.2f} % of plain's median TTFT"
            + (" (inside the step)" if c == "sync" else " (off the step)")
        )
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(up)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ttft_ms": ttft, "uptime": up, "model": a.model, "words": a.words}, f)


if __name__ == "__main__":
    main()
