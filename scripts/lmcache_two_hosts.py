#!/usr/bin/env python3
"""End to end: two LMCache MP servers ("host A", "host B") share one cxlkv pool as their L2.

vLLM A (cxlkv's CxlKVLMCacheMPConnector, LMCache's connector sending the KV identity instead of the
model name -> LMCache server A) serves long prompts; LMCache A writes their KV
through to its L2 adapters, cxlkv first. vLLM A stops; vLLM B starts against LMCache server B,
whose L1 is cold: the same prompts are hits only through B's cxlkv L2. Reports the TTFT of those
hits against recomputing prompts of the same length (fresh prefixes, a miss everywhere), B's
external prefix-cache hits from vLLM's /metrics, and the pool's counters.

    flock /tmp/cxlkv-vllm.lock ./.venv/bin/python scripts/lmcache_two_hosts.py [--prompts 4]

Needs lmcache 0.5.6 beside vLLM CPU (docs/INTEGRATIONS.md). TTFT here is the latency of a
max_tokens=1 completion (prefill + one token), median of the prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import cxlkv
from cxlkv.testing.models import smollm2

PY = sys.executable
L2_WAIT_S = 120


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 - owned by the process for its lifetime
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2] if len(proc.args) > 2 else proc.args} exited; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout_s} s; see {log}")


def lmcache_server(port: int, http: int, prom: int, pool: str, log: Path) -> subprocess.Popen:
    l2 = {
        "type": "native_plugin",
        "module_path": "cxlkv.integrations.lmcache",
        "class_name": "CxlKVL2Connector",
        "adapter_params": {"pool_path": pool},
    }
    cmd = [PY, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
           "--l1-size-gb", "1", "--eviction-policy", "LRU", "--chunk-size", "256",
           "--supported-transfer-mode", "auto", "--http-port", str(http), "--prometheus-port", str(prom),
           "--l2-adapter", json.dumps(l2)]  # fmt: skip
    p = spawn(cmd, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "Created native plugin L2 adapter" not in log.read_text():
        if p.poll() is not None:
            raise RuntimeError(f"lmcache server exited; see {log}")
        time.sleep(0.5)
    time.sleep(3)
    return p


def vllm_server(model: str, port: int, lmcache_port: int, log: Path) -> subprocess.Popen:
    kv = {
        "kv_connector": "CxlKVLMCacheMPConnector",
        "kv_connector_module_path": "cxlkv.integrations.lmcache_vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port, "lmcache.mp.mq_timeout": 60,
        },
    }  # fmt: skip
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "smollm2",
           "--port", str(port), "--enforce-eager", "--max-model-len", "8192", "--enable-prompt-tokens-details",
           "--seed", "0", "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    p = spawn(cmd, log, env)
    wait_http(f"http://127.0.0.1:{port}/health", p, log, 600)
    return p


def complete(port: int, prompt: list[int]) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of a max_tokens=1 completion."""
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    dt = time.perf_counter() - t0
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return dt, int(details.get("cached_tokens") or 0)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (whole 256-token chunks load)")
    ap.add_argument("--pool-size", default="2GiB")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cxlkv-lmcache-e2e-"))
    pool = f"/dev/shm/cxlkv-lmcache-e2e-{os.getpid()}"
    model = smollm2()
    cxlkv.Pool.create(pool, args.pool_size).close()
    procs: list[subprocess.Popen] = []
    try:
        procs.append(lmcache_server(5555, 8280, 8290, pool, work / "lmcache-a.log"))
        procs.append(lmcache_server(5556, 8281, 8291, pool, work / "lmcache-b.log"))
        shared = prompts(1, args.prompts, args.tokens)

        vllm_a = vllm_server(model, 8100, 5555, work / "vllm-a.log")
        procs.append(vllm_a)
        a_times = [complete(8100, p)[0] for p in shared]
        deadline = time.monotonic() + L2_WAIT_S  # LMCache writes L2 behind the request
        expect = args.prompts * (args.tokens // 256)
        while time.monotonic() < deadline:
            with cxlkv.Pool.open(pool, attach=False) as p:
                stored = int(p.stats()["puts"])
            if stored >= expect:
                break
            time.sleep(1)
        with cxlkv.Pool.open(pool, attach=False) as p:
            stats_before = p.stats()
        stop(vllm_a)

        vllm_b = vllm_server(model, 8101, 5556, work / "vllm-b.log")
        procs.append(vllm_b)
        hits = [complete(8101, p) for p in shared]
        fresh = [complete(8101, p) for p in prompts(2, args.prompts, args.tokens)]
        ext_hits = metric(8101, "vllm:external_prefix_cache_hits_total")
        ext_queries = metric(8101, "vllm:external_prefix_cache_queries_total")
        with cxlkv.Pool.open(pool, attach=False) as p:
            stats_after = p.stats()
        result = {
            "prompts": args.prompts,
            "prompt_tokens": args.tokens,
            "ttft_a_cold_ms": [round(t * 1e3, 1) for t in a_times],
            "ttft_b_hit_ms": [round(t * 1e3, 1) for t, _ in hits],
            "ttft_b_recompute_ms": [round(t * 1e3, 1) for t, _ in fresh],
            "median_b_hit_ms": round(statistics.median(t for t, _ in hits) * 1e3, 1),
            "median_b_recompute_ms": round(statistics.median(t for t, _ in fresh) * 1e3, 1),
            "b_cached_tokens_per_prompt": [c for _, c in hits],
            "b_recompute_cached_tokens": [c for _, c in fresh],
            "b_external_prefix_cache_hits": ext_hits,
            "b_external_prefix_cache_queries": ext_queries,
            "pool_stats_after_a": stats_before,
            "pool_stats_end": stats_after,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "logs": str(work),
        }
        result["speedup"] = round(result["median_b_recompute_ms"] / result["median_b_hit_ms"], 2)
        print(json.dumps(result, indent=2))
        return 0 if ext_hits > 0 else 1
    finally:
        for p in reversed(procs):
            stop(p)
        cxlkv.Pool.destroy(pool, ignore_attached=True)


if __name__ == "__main__":
    sys.exit(main())
