"""`cxlkv bench serve` smoke on the tiny model: real vLLM OpenAI servers behind the router, vLLM's
own benchmark client, two configurations (`single`, then `cxlkv` on two servers), one
concurrency. Three server start-ups: the slow part.

It checks the contract of --json (a list of rows with the agreed fields), that every request
succeeded, that the servers' counters saw the prefix reused, that the cxlkv pair took prefixes
from the pool (external hits, and requests classed `tier`), and that no server outlives the
command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.timeout(900)]

FIELDS = {"config", "concurrency", "hit_rate", "mean_ttft_ms", "p99_ttft_ms", "requests_per_s"}


def vllm_servers() -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"vllm.entrypoints.openai.api_server" in f.read():
                        out.add(int(pid))
            except OSError:
                pass
    return out


def test_bench_serve_tiny_single_and_cxlkv():
    before = vllm_servers()
    argv = [
        sys.executable,
        "-m",
        "cxlkv",
        "bench",
        "serve",
        "--model",
        "tiny",
        "--instances",
        "2",
        "--concurrency",
        "1",
        "--configs",
        "single,cxlkv",
        "--num-prompts",
        "8",
        "--num-prefixes",
        "2",
        "--prefix-len",
        "512",
        "--suffix-len",
        "32",
        "--output-len",
        "4",
        "--json",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=880, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout)
    assert [(r["config"], r["concurrency"]) for r in rows] == [("single", 1), ("cxlkv", 1)]
    for r in rows:
        assert FIELDS <= set(r), r.keys()
        assert r["requests"] == 8 and r["failed"] == 0, r
        assert r["hit_rate"] > 0 and r["mean_ttft_ms"] > 0 and r["requests_per_s"] > 0
    single, cx = rows
    assert single["external_hit_rate"] == 0 and single["classes"]["tier"]["n"] == 0
    # two prefixes x four requests over two servers round robin: some first request of a prefix
    # on a server comes after the other server computed it
    assert cx["external_hit_tokens"] > 0 and cx["classes"]["tier"]["n"] > 0, cx
    assert vllm_servers() <= before, "a vLLM server outlived bench serve"
