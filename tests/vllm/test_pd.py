"""Prefill -> decode handoff through the pool: two real vLLM OpenAI servers (kv_producer and
kv_consumer) behind cxlkv's proxy. The decode server must load the prompt's full blocks from the
pool instead of recomputing them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import BLOCK, words

pytestmark = pytest.mark.timeout(900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_proxy_args(prefill_port: int, decode_port: int, port: int, *extra: str) -> list[str]:
    """The interpreter's arguments that start the P/D proxy on `port` before the two sides."""
    return [
        "-m",
        "cxlkv.integrations.pd_proxy",
        "--prefill",
        f"http://127.0.0.1:{prefill_port}",
        "--decode",
        f"http://127.0.0.1:{decode_port}",
        "--port",
        str(port),
        *extra,
    ]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def wait_ready(url: str, procs, deadline: float) -> None:
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a server exited early with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise AssertionError(f"{url} not ready in time")


def scrape(port: int) -> dict[str, float]:
    """An engine's /metrics: {series: value}, summed over the labels vLLM adds (model, engine);
    labels of the connector's own (outcome, cause) are kept in the name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        name, labels, value = m.groups()
        kept = [kv for kv in (labels or "").split(",") if kv.split("=")[0] in ("outcome", "cause")]
        key = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_metric(port: int, series: str, procs, bound_s: float = 60) -> dict[str, float]:
    """/metrics once `series` is positive (vLLM publishes a step's stats after the response)."""
    deadline = time.time() + bound_s
    while True:
        got = scrape(port)
        if got.get(series, 0) > 0 or time.time() > deadline:
            return got
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a server exited early")
        time.sleep(0.5)


def server(model: str, port: int, role: str, pool: str, log) -> subprocess.Popen:
    cfg = {
        "kv_connector": "CxlKVConnector",
        "kv_connector_module_path": "cxlkv.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"pool_path": pool, "pool_size": "1GiB"},
    }
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONHASHSEED", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--max-model-len",
            "4096",
            "--served-model-name",
            "tiny",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(cfg),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def test_prefill_then_decode_through_proxy(tiny_model, pool_path, tmp_path):
    pp, dp, xp = free_port(), free_port(), free_port()
    logs = [open(tmp_path / n, "w") for n in ("prefill.log", "decode.log", "proxy.log")]
    procs = [
        server(tiny_model, pp, "kv_producer", pool_path, logs[0]),
        server(tiny_model, dp, "kv_consumer", pool_path, logs[1]),
        subprocess.Popen(
            [sys.executable, *pd_proxy_args(pp, dp, xp)],
            stdout=logs[2],
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        deadline = time.time() + 600
        for port in (pp, dp, xp):
            wait_ready(f"http://127.0.0.1:{port}/health", procs, deadline)
        prompt = words(11, 600)
        out = post(
            f"http://127.0.0.1:{xp}/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        n = out["usage"]["prompt_tokens"]
        cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached == (n - 1) // BLOCK * BLOCK, out["usage"]
        assert len(out["choices"][0]["text"]) > 0
        # The decode server alone (no proxy) answers the same prompt with the same text.
        direct = post(
            f"http://127.0.0.1:{dp}/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert direct["choices"][0]["text"] == out["choices"][0]["text"]
        # Each engine's /metrics (vLLM's own hooks: build_prom_metrics) shows the connector's
        # series: the decode engine looked up and loaded the prompt's blocks, the prefill engine
        # stored them; the hit is also vLLM's external prefix-cache hit.
        decode = wait_metric(dp, "vllm:cxlkv_hit_tokens_total", procs)
        assert decode["vllm:cxlkv_hit_tokens_total"] == cached
        assert decode["vllm:cxlkv_lookup_tokens_total"] == cached  # every looked-up block hit
        assert decode["vllm:external_prefix_cache_hits_total"] == cached
        assert decode["vllm:cxlkv_load_bytes_total"] > 0 and decode["vllm:cxlkv_load_seconds_count"] >= 1
        assert decode['vllm:cxlkv_load_failed_blocks_total{cause="missing_or_corrupt"}'] == 0
        assert decode['vllm:cxlkv_store_outcome_blocks_total{outcome="stored"}'] == 0  # a consumer
        prefill = wait_metric(pp, 'vllm:cxlkv_store_outcome_blocks_total{outcome="stored"}', procs)
        assert prefill['vllm:cxlkv_store_outcome_blocks_total{outcome="stored"}'] >= cached // BLOCK
        assert prefill["vllm:cxlkv_store_bytes_total"] > 0 and prefill["vllm:cxlkv_store_seconds_count"] >= 1
        assert prefill['vllm:cxlkv_store_outcome_blocks_total{outcome="pool_full"}'] == 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
