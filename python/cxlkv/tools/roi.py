"""``cxlkv roi``: how many GPUs a KV pool saves, by the ByteDance ROI model (docs/REFERENCES.md:
§3.4 and Appendix A.1, Table 1).

The model: a prefill that must finish within the TTFT SLO ``T_slo`` needs ``P0 = C0 / T_slo``
FLOP/s when computed from scratch. A follow-up request (a fraction ``h`` of all requests) loads its
prefix from the pool in ``T_load`` and computes only its new prompt, ``C1 = r * C0``, in what is left
of the SLO: ``P1 = C1 / (T_slo - T_load)``. One GPU of ``P`` FLOP/s then serves
``R_gpu = P / (P0 * (1 - h) + P1 * h)`` requests/s, against ``P / P0`` without a pool, and ``R``
requests/s need ``ceil(R / R_gpu)`` GPUs against ``ceil(R / (P / P0))``.

The paper's example (P = 100 TFLOP/s, C0 = 25 TFLOP, r = 10 %, T_slo = 0.4 s, T_load = 0.1 s,
h = 1): 1.6 against 12 requests/s per GPU, 7.5x, 87 % fewer GPUs. tests/python/test_roi.py checks
that this module reproduces it.

Where the inputs come from, when not given directly:

* ``--model-config config.json --context-tokens N``: ``C0 = 2 * M * N`` (Table 1's estimate; M is
  the parameter count computed from the Hugging Face config, the *activated* parameters for a
  mixture of experts) and the bytes of KV that a hit loads, ``(1 - r) * N`` tokens of
  ``2 * layers * kv_heads * head_dim * dtype bytes`` each; with ``--load-gbps`` that gives T_load.
* ``--from-bench serve.json`` (``cxlkv bench serve --json``): the pool's measured prefix hit rate
  and, when the rows carry it, its load bandwidth. A token hit rate ``t`` over all requests is
  read as ``h = 1, r = 1 - t``: every request loads the share of its prompt that was cached and
  computes the rest — the same aggregate compute as the per-request split, since Table 1's
  demand is linear in ``h * r``. Said in the output, since it is an approximation (a request that
  missed entirely does not pay ``T_load``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cxlkv import dtype_bytes
from cxlkv.errors import CommandError

__all__ = [
    "RoiInputs",
    "compute",
    "from_bench",
    "kv_bytes_per_token",
    "model_params",
    "print_result",
]

TERA = 1e12
# ceil() of a ratio that is a whole number up to float rounding (120 / 12.000000000000002).
_CEIL_SLACK = 1e-9


@dataclass(frozen=True)
class RoiInputs:
    """Table 1's symbols, in base units (FLOP, FLOP/s, seconds, requests/s)."""

    gpu_flops: float  # P
    prefill_flop: float  # C0
    new_prompt_ratio: float  # r
    slo_s: float  # T_slo
    load_s: float  # T_load
    multi_round_ratio: float  # h
    rps: float  # R

    def validate(self) -> None:
        if self.gpu_flops <= 0 or self.prefill_flop <= 0:
            raise CommandError("--gpu-tflops and the prefill FLOPs must be positive")
        for name, v in (
            ("--new-prompt-ratio", self.new_prompt_ratio),
            ("--multi-round-ratio", self.multi_round_ratio),
        ):
            if not 0.0 <= v <= 1.0:
                raise CommandError(f"{name} must lie in [0, 1], got {v}")
        if self.slo_s <= 0 or self.load_s < 0 or self.rps <= 0:
            raise CommandError("--slo-s and --rps must be positive and --load-s not negative")
        if self.load_s >= self.slo_s and self.multi_round_ratio > 0:
            raise CommandError(
                f"loading the prefix takes {self.load_s:g} s, which leaves nothing of the "
                f"{self.slo_s:g} s SLO for the new prompt: no hit can meet the SLO"
            )


def _gpus(rps: float, per_gpu: float) -> int:
    return max(1, math.ceil(rps / per_gpu - _CEIL_SLACK))


def compute(inp: RoiInputs) -> dict[str, Any]:
    """Table 1, evaluated. Returns the inputs (in the CLI's units too) and every derived quantity."""
    inp.validate()
    p0 = inp.prefill_flop / inp.slo_s
    c1 = inp.new_prompt_ratio * inp.prefill_flop
    p1 = c1 / (inp.slo_s - inp.load_s) if inp.multi_round_ratio > 0 else 0.0
    per_gpu_baseline = inp.gpu_flops / p0
    per_gpu_pool = inp.gpu_flops / (p0 * (1 - inp.multi_round_ratio) + p1 * inp.multi_round_ratio)
    n_baseline = _gpus(inp.rps, per_gpu_baseline)
    n_pool = _gpus(inp.rps, per_gpu_pool)
    return {
        "inputs": asdict(inp),
        "p0_tflops": p0 / TERA,
        "p1_tflops": p1 / TERA,
        "requests_per_s_per_gpu_baseline": per_gpu_baseline,
        "requests_per_s_per_gpu_pool": per_gpu_pool,
        "throughput_ratio": per_gpu_pool / per_gpu_baseline,
        "gpus_baseline": n_baseline,
        "gpus_pool": n_pool,
        # For this R (whole GPUs) and for large R (the paper's "87 %": 1 - R_base / R_pool).
        "gpu_reduction": 1 - n_pool / n_baseline,
        "gpu_reduction_asymptotic": 1 - per_gpu_baseline / per_gpu_pool,
    }


# ---------------------------------------------------------------------------------------------
# inputs derived from a model's config.json


def _cfg_int(cfg: dict, *names: str, default: int | None = None) -> int:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise CommandError(f"the model config has no positive integer {' / '.join(names)}")


def _text_config(cfg: dict) -> dict:
    # Multimodal configs nest the language model's fields.
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def _attention_geometry(cfg: dict) -> tuple[int, int, int, int, int]:
    """(hidden size, layers, query heads, KV heads, head dim) of a decoder config."""
    hidden = _cfg_int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _cfg_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _cfg_int(cfg, "num_attention_heads", "n_head")
    kv_heads = _cfg_int(cfg, "num_key_value_heads", default=heads)
    head_dim = _cfg_int(cfg, "head_dim", default=hidden // heads)
    return hidden, layers, heads, kv_heads, head_dim


def model_params(cfg: dict) -> int:
    """Parameters one token's forward pass touches (activated experts only), from a Hugging Face
    config of a decoder-only transformer: embeddings, attention projections, the (gated) MLP."""
    cfg = _text_config(cfg)
    hidden, layers, heads, kv_heads, head_dim = _attention_geometry(cfg)
    vocab = _cfg_int(cfg, "vocab_size")
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    experts = cfg.get("num_experts_per_tok")
    if isinstance(experts, int) and experts > 0 and cfg.get("moe_intermediate_size"):
        inter = _cfg_int(cfg, "moe_intermediate_size")
        shared = cfg.get("n_shared_experts") or 0
        mlp = 3 * hidden * inter * (experts + (shared if isinstance(shared, int) else 0))
    else:
        mlp = 3 * hidden * _cfg_int(cfg, "intermediate_size", "n_inner", default=4 * hidden)
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + layers * (attn + mlp)


def kv_bytes_per_token(cfg: dict, dtype: str | None = None) -> int:
    """Bytes of K and V one token stores over all layers (dense attention)."""
    cfg = _text_config(cfg)
    _hidden, layers, _heads, kv_heads, head_dim = _attention_geometry(cfg)
    name = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    try:
        size = dtype_bytes(name)  # the core's dtype table, the only one
    except ValueError as e:
        raise CommandError(f"KV dtype: {e}") from None
    return 2 * layers * kv_heads * head_dim * size


def load_config(path: str) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CommandError(f"cannot read the model config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise CommandError(f"{path} is not a JSON object")
    return cfg


# ---------------------------------------------------------------------------------------------
# inputs measured by `cxlkv bench serve --json`


def from_bench(
    path: str, config: str = "cxlkv", concurrency: int | None = None, dataset: str | None = None
) -> dict[str, Any]:
    """The measured prefix hit rate (and load bandwidth, when recorded) of one configuration of
    a `bench serve --json` file: {"hit_rate", "load_gbps" (or None), "concurrency", "rows"}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CommandError(f"cannot read the bench results {path}: {e}") from None
    rows = data.get("rows", data) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise CommandError(f"{path}: expected a list of rows (cxlkv bench serve --json)")
    mine = [r for r in rows if isinstance(r, dict) and r.get("config") == config]
    datasets = sorted({str(r["dataset"]) for r in mine if r.get("dataset") is not None})
    if dataset is not None:
        mine = [r for r in mine if r.get("dataset") == dataset]
    elif len(datasets) > 1:
        raise CommandError(
            f"{path} measured several datasets ({', '.join(datasets)}): choose one with --bench-dataset"
        )
    if concurrency is not None:
        mine = [r for r in mine if r.get("concurrency") == concurrency]
    if not mine:
        raise CommandError(
            f"{path} has no row of configuration {config!r}"
            + (f" at concurrency {concurrency}" if concurrency is not None else "")
            + (f" on dataset {dataset!r}" if dataset is not None else "")
        )
    if concurrency is None:  # the most loaded measurement: what capacity planning is about
        top = max(int(r.get("concurrency") or 0) for r in mine)
        mine = [r for r in mine if int(r.get("concurrency") or 0) == top]
    hits = [float(r["hit_rate"]) for r in mine if isinstance(r.get("hit_rate"), (int, float))]
    if not hits:
        raise CommandError(f"{path}: the {config!r} rows carry no hit_rate")
    gbps = [
        float(r["load_gbps"])
        for r in mine
        if isinstance(r.get("load_gbps"), (int, float)) and r["load_gbps"] > 0
    ]
    return {
        "hit_rate": sum(hits) / len(hits),
        "load_gbps": (sum(gbps) / len(gbps)) if gbps else None,
        "concurrency": mine[0].get("concurrency"),
        "dataset": mine[0].get("dataset"),
        "rows": len(mine),
    }


# ---------------------------------------------------------------------------------------------
# output


def print_result(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    inp = result["inputs"]
    for note in result.get("notes", []):
        console.print(f"[dim]{note}[/dim]")
    t = Table(title=f"GPUs for {inp['rps']:g} prefill requests/s within a {inp['slo_s']:g} s TTFT SLO")
    t.add_column("")
    t.add_column("recompute", justify="right")
    t.add_column("KV pool", justify="right")
    t.add_row(
        "FLOP/s per request",
        f"{result['p0_tflops']:.3g} T",
        f"{result['p1_tflops']:.3g} T (new prompt, h = {inp['multi_round_ratio']:.0%})",
    )
    t.add_row(
        "requests/s per GPU",
        f"{result['requests_per_s_per_gpu_baseline']:.3g}",
        f"{result['requests_per_s_per_gpu_pool']:.3g}",
    )
    t.add_row("GPUs needed", str(result["gpus_baseline"]), str(result["gpus_pool"]))
    console.print(t)
    console.print(
        f"{result['throughput_ratio']:.2f}x the requests per GPU; "
        f"{result['gpu_reduction']:.0%} fewer GPUs at this load "
        f"({result['gpu_reduction_asymptotic']:.0%} as the load grows)"
    )
