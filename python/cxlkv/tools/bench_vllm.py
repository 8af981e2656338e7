"""`cxlkv bench vllm`: a multi-turn agentic workload on real vLLM engines (CPU build).

C conversations x T turns; every turn appends --turn-words words to its conversation's
context and asks for the first token (TTFT = wall time of a one-token generate, one request at a
time, after a warm-up request). Six configurations, each a fresh engine process:

  off       vLLM with prefix caching disabled: every turn recomputes the whole context
  local     vLLM's in-memory prefix cache, one instance, replaying the conversations a second
            time (the second pass is reported): the upper bound for one instance
  cxlkv-1   replica 1 with the cxlkv connector on a fresh pool (publishes every block; its local
            prefix cache is on as in production)
  cxlkv-2   replica 2, a second process on the same pool, replaying the same conversations: its
            local cache is cold, every prefix comes from the pool (cross-instance reuse)
  example-1, example-2   the same two replicas with vLLM's ExampleConnector (safetensors files
            per layer in a /dev/shm directory), the shared-storage baseline that runs on CPU

With --turns 1 and several --contexts this is Beluga's first-run / second-run experiment:
replica 1 populates the cache, replica 2 hits it (mean and p99 TTFT, requests/s).

Prints per-turn TTFT and the speedups against `off` measured in the same run; --plot writes a PNG.
Needs vLLM (scripts/setup-vllm.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Any

from cxlkv.errors import CommandError
from cxlkv.tools._common import PERCENTILE_METHOD, percentile

__all__ = ["CONFIGS", "conversations", "print_result", "run"]

CONFIGS = ("off", "local", "cxlkv-1", "cxlkv-2", "example-1", "example-2")


def conversations(n: int, turns: int, turn_words: int) -> list[list[str]]:
    """Per conversation, the prompt of each turn (each extends the previous one)."""
    vocab = [
        "agent",
        "tool",
        "call",
        "result",
        "observation",
        "plan",
        "step",
        "memory",
        "context",
        "file",
        "search",
        "query",
        "answer",
        "code",
        "test",
        "error",
        "retry",
        "summary",
        "document",
        "section",
        "table",
        "value",
        "request",
    ]
    out = []
    for c in range(n):
        rng = random.Random(1000 + c)
        text, prompts = f"Conversation {c}.", []
        for _ in range(turns):
            text += " " + " ".join(rng.choice(vocab) for _ in range(turn_words))
            prompts.append(text)
        out.append(prompts)
    return out


def _worker(spec: dict) -> None:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    from cxlkv.testing import models

    model = models.smollm2() if spec["model"] == "smollm2" else models.tiny_llama()
    kw: dict[str, Any] = dict(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=2 << 30,
        max_model_len=spec["max_model_len"],
        seed=0,
        enable_prefix_caching=spec["config"] != "off",
        # whole prompts in one step: ExampleConnector breaks on chunked prefill
        max_num_batched_tokens=spec["max_model_len"],
    )
    if spec["config"].startswith("cxlkv"):
        kw["kv_transfer_config"] = {
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"pool_path": spec["pool"], "pool_size": "4GiB"},
        }
    elif spec["config"].startswith("example"):
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": spec["pool"] + ".example"},
        }
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(["warm up " * 20], sp)
    convs = conversations(spec["contexts"], spec["turns"], spec["turn_words"])
    for _ in range(2 if spec["config"] == "local" else 1):
        ttft: list[list[dict]] = [[] for _ in convs]
        for turn in range(spec["turns"]):  # conversations interleave turn by turn, as agents do
            for c, prompts in enumerate(convs):
                t0 = time.perf_counter()
                out = llm.generate([prompts[turn]], sp, use_tqdm=False)[0]
                dt = time.perf_counter() - t0
                ttft[c].append(
                    {
                        "turn": turn + 1,
                        "tokens": len(out.prompt_token_ids),
                        "cached": out.num_cached_tokens or 0,
                        "ttft_s": dt,
                    }
                )
    # Into a file, not stdout: vLLM's worker processes share our stdout and may write into the
    # middle of a line (a run lost its results that way: "Extra data" when parsing it).
    with open(spec["result_path"], "w") as f:
        json.dump(ttft, f)


def run(
    model: str = "smollm2",
    contexts: int = 2,
    turns: int = 5,
    turn_words: int = 1100,
    max_model_len: int = 8192,
    plot: str | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Runs every configuration of :data:`CONFIGS` in turn and returns the summary; progress
    lines (and a failed engine's last output) go to ``console`` (a rich Console), if given."""
    if plot and importlib.util.find_spec("matplotlib") is None:
        # Before the engines run, not after: a run takes many minutes and its results were lost
        # once to a missing matplotlib at the very end.
        raise CommandError("bench vllm --plot needs matplotlib: pip install matplotlib (or drop --plot)")
    if console is None:
        from rich.console import Console

        console = Console(quiet=True)
    con = console
    pool = os.path.join("/dev/shm", f"cxlkv-bench-vllm-{os.getpid()}")
    results: dict[str, Any] = {}
    try:
        for cfg in CONFIGS:
            spec = dict(
                config=cfg,
                model=model,
                contexts=contexts,
                turns=turns,
                turn_words=turn_words,
                max_model_len=max_model_len,
                pool=pool,
                result_path=f"{pool}.{cfg}.json",
            )
            con.print(f"bench vllm: running {cfg} ...")
            env = dict(os.environ)
            env.pop("PYTHONHASHSEED", None)
            p = subprocess.run(
                [sys.executable, "-m", "cxlkv.tools.bench_vllm", "--worker", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
            )
            if p.returncode != 0 or not os.path.exists(spec["result_path"]):
                con.print((p.stdout + p.stderr)[-4000:])
                raise CommandError(f"bench vllm: the {cfg} engine failed (exit {p.returncode})")
            with open(spec["result_path"]) as f:
                results[cfg] = json.load(f)
    finally:
        for leftover in [pool] + [f"{pool}.{cfg}.json" for cfg in CONFIGS]:
            if os.path.exists(leftover):
                os.unlink(leftover)
        shutil.rmtree(pool + ".example", ignore_errors=True)

    def per_turn(cfg: str) -> list[float]:
        return [sum(c[t]["ttft_s"] for c in results[cfg]) / contexts for t in range(turns)]

    turns_ttft = {cfg: per_turn(cfg) for cfg in CONFIGS}
    tokens = [sum(c[t]["tokens"] for c in results["off"]) / contexts for t in range(turns)]
    cached2 = [sum(c[t]["cached"] for c in results["cxlkv-2"]) / contexts for t in range(turns)]
    summary = {
        "model": model,
        "contexts": contexts,
        "turns": turns,
        "mean_tokens_per_turn": tokens,
        "ttft_s": turns_ttft,
        "cxlkv2_cached_tokens": cached2,
        "warm_turn_speedup_cxlkv2_vs_off": turns_ttft["off"][-1] / turns_ttft["cxlkv-2"][-1],
        "warm_turn_cxlkv2_vs_local": turns_ttft["cxlkv-2"][-1] / turns_ttft["local"][-1],
        "wall_s": {cfg: sum(turns_ttft[cfg]) * contexts for cfg in CONFIGS},
        "raw": results,
    }
    summary["wall_speedup_cxlkv2_vs_off"] = summary["wall_s"]["off"] / summary["wall_s"]["cxlkv-2"]
    # Over every request of a configuration: mean and p99 TTFT, sequential requests per second.
    summary["per_request"] = {}
    for cfg in CONFIGS:
        xs = sorted(t["ttft_s"] for conv in results[cfg] for t in conv)
        mean = sum(xs) / len(xs)
        summary["per_request"][cfg] = {
            "mean_ttft_s": mean,
            "p99_ttft_s": percentile(xs, 99),
            "requests_per_s": 1.0 / mean,
        }
    summary["percentile_method"] = PERCENTILE_METHOD
    if plot:
        _plot(summary, plot)
        summary["plot"] = plot
    return summary


def print_result(con: Any, summary: dict[str, Any]) -> None:
    """The summary of :func:`run` as tables on ``con`` (a rich Console)."""
    from rich.table import Table

    model, contexts, turns = summary["model"], summary["contexts"], summary["turns"]
    turns_ttft, tokens = summary["ttft_s"], summary["mean_tokens_per_turn"]
    cached2 = summary["cxlkv2_cached_tokens"]
    t = Table(title=f"TTFT per turn, {model}, {contexts} conversations (mean, seconds)")
    t.add_column("turn")
    t.add_column("tokens", justify="right")
    for cfg in CONFIGS:
        t.add_column(cfg, justify="right")
    t.add_column("cxlkv-2 cached", justify="right")
    for i in range(turns):
        t.add_row(
            str(i + 1), f"{tokens[i]:.0f}", *[f"{turns_ttft[c][i]:.3f}" for c in CONFIGS], f"{cached2[i]:.0f}"
        )
    con.print(t)
    t2 = Table(title="per request (all turns of all conversations)")
    for c in ("config", "mean TTFT", "p99 TTFT", "requests/s"):
        t2.add_column(c, justify="right")
    for cfg in CONFIGS:
        r = summary["per_request"][cfg]
        t2.add_row(cfg, f"{r['mean_ttft_s']:.3f}", f"{r['p99_ttft_s']:.3f}", f"{r['requests_per_s']:.2f}")
    con.print(t2)
    con.print(
        f"last turn: cxlkv-2 {summary['warm_turn_speedup_cxlkv2_vs_off']:.1f}x faster than off, "
        f"{summary['warm_turn_cxlkv2_vs_local']:.2f}x vLLM's local prefix hit; whole workload "
        f"{summary['wall_speedup_cxlkv2_vs_off']:.1f}x faster than off"
    )


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(1, summary["turns"] + 1))
    for cfg, style in zip(CONFIGS, ("o-", "s-", "^--", "d-", "v--", "x-"), strict=True):
        ax.plot(x, summary["ttft_s"][cfg], style, label=cfg)
    ax.set_xlabel("turn (context grows every turn)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"Multi-turn TTFT, {summary['model']}, vLLM CPU, 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":  # one engine process of run(); `cxlkv bench vllm` is the command
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m cxlkv.tools.bench_vllm --worker SPEC_JSON (use `cxlkv bench vllm`)")
    _worker(json.loads(sys.argv[2]))
