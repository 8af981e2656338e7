"""What `cxlkv bench serve` makes of one run: the servers' prefix-cache counters, each request's
source class, the row per configuration and concurrency, the table, the plots.

Where a request's prefix came from. The router reads each answer's
``usage.prompt_tokens_details.cached_tokens`` (vLLM: tokens not computed, local prefix cache and
connector together). The local part is what that server itself computed earlier: the longest
prefix of this prompt held by a request of the same group whose first answer byte had left the same
server before this request reached the router (router's clock); a server that counted no external
hits in the run got all its hits locally. So per request

    local = min(cached, reusable on this server), tier = cached - local, recompute = prompt - cached

and the request's class is `recompute` when it computed most of its prompt, else `tier` when the
tier supplied any of it (the tier spared it a recompute: with N = 2, turn t of a conversation finds
turns up to t - 2 on its own server and needs only turn t - 1 from the tier), else `local`. The sum of the per-request `tier` estimates
is printed beside the servers' own ``vllm:external_prefix_cache_hits`` as a check (they differ
where vLLM evicted a local prefix the estimate assumed, or a load was partial).
"""

from __future__ import annotations

import re
import statistics
import urllib.request
from typing import Any

from cxlkv.tools._common import percentile

__all__ = ["classify", "plot", "row", "scrape", "table"]

CLASSES = ("local", "tier", "recompute")
COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "local": "vllm:prefix_cache_hits_total",
    "external": "vllm:external_prefix_cache_hits_total",
}
# The cxlkv connector's coalescing counters (docs/METRICS.md): row key -> (series, causes or None).
COALESCE = {
    "waits": ("vllm:cxlkv_coalesce_waits_total", None),
    "declined": ("vllm:cxlkv_coalesce_declined_total", None),
    "timeouts": ("vllm:cxlkv_coalesce_fallbacks_total", ("deadline", "stalled")),
    "writer_gone": ("vllm:cxlkv_coalesce_fallbacks_total", ("writer_gone",)),
    "partial_loads": ("vllm:cxlkv_coalesce_partial_loads_total", None),
    "saved_tokens": ("vllm:cxlkv_coalesce_saved_tokens_total", None),
    "wait_s": ("vllm:cxlkv_coalesce_wait_seconds_total", None),
}


def scrape(url: str) -> dict[str, float]:
    """The prefix-cache counters of one vLLM server (summed over its label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys([*COUNTERS, *(f"coalesce_{k}" for k in COALESCE)], 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
            for k, (series, causes) in COALESCE.items():
                if s.name == series and (causes is None or s.labels.get("cause") in causes):
                    out[f"coalesce_{k}"] += s.value
    return out


def classify(
    tagged: list, outputs: list[dict], records: dict[str, dict], external: list[float]
) -> list[dict]:
    """Per request: backend, prompt and cached tokens, the local / tier / recompute estimate and
    its class. `outputs[i]` is vLLM's client's view of `tagged[i]`; `records` the router's, by
    request id (its clock dates when a request reached the router and its first answer byte);
    `external[b]`: the external-hit tokens server b counted in this run (0: all its hits local)."""
    done = []  # (group, backend, prefill end, reusable) of requests whose prefill finished
    for t, o in zip(tagged, outputs, strict=True):
        rec = records.get(t.request.request_id, {})
        o["request_id"] = t.request.request_id
        o["backend"] = rec.get("backend")
        o["cached"] = int(rec.get("cached_tokens") or 0)
        o["prompt"] = int(rec.get("prompt_tokens") or t.request.prompt_len)
        o["routed_s"] = rec.get("start_s", 0.0)
        if o["success"] and rec.get("ttft_s") is not None:
            done.append((t.group, o["backend"], rec["start_s"] + rec["ttft_s"], t.reusable))
    rows = []
    for t, o in zip(tagged, outputs, strict=True):
        b = o["backend"]
        here = [r for g, bb, end, r in done if g == t.group and bb == b and end <= o["routed_s"]]
        no_tier = b is None or b >= len(external) or external[b] == 0
        local = o["cached"] if no_tier else min(o["cached"], max(here, default=0))
        parts = {"local": local, "tier": o["cached"] - local, "recompute": o["prompt"] - o["cached"]}
        cls = "recompute" if parts["recompute"] > o["cached"] else "tier" if parts["tier"] else "local"
        rows.append({**o, **parts, "class": cls})
    return rows


# A coalescing line of a server's log (coalesce.py logs each decision, wait and outcome at INFO):
# its time, the bench's request id (vLLM names it cmpl-<id>-<n>-<hex>) and what happened.
_COALESCE_LINE = re.compile(
    r"(\d\d:\d\d:\d\d) \[coalesce\.py:\d+\] cxlkv: (?:cmpl-)?(\S+?)-\d+-[0-9a-f]{8}: (.*)$"
)


def coalesce_events(logs: list[str]) -> dict[str, list[str]]:
    """Per request id: its coalescing timeline from the servers' logs ("HH:MM:SS what"): whether
    it waited or computed and why (the writer's expected time vs its own), how long a wait took,
    how it ended and what it loaded. Unreadable logs give nothing."""
    out: dict[str, list[str]] = {}
    for path in logs:
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    m = _COALESCE_LINE.search(line)
                    if m:
                        out.setdefault(m.group(2), []).append(f"{m.group(1)} {m.group(3).strip()}")
        except OSError:
            continue
    return out


def timeline(per_request: list[dict], events: dict[str, list[str]]) -> list[dict]:
    """The requests that met coalescing, in order: id, server, TTFT and their timeline."""
    return [
        {
            "request": q["request_id"],
            "backend": q.get("backend"),
            "ttft_ms": round(1000 * q["ttft_s"]) if q.get("ttft_s") is not None else None,
            "events": events[q["request_id"]],
        }
        for q in per_request
        if events.get(q["request_id"])
    ]


def _ms(xs: list[float]) -> dict[str, float]:
    return {
        "mean": 1000 * statistics.fmean(xs) if xs else 0.0,
        "median": 1000 * statistics.median(xs) if xs else 0.0,
        "p90": 1000 * percentile(xs, 90),
        "p99": 1000 * percentile(xs, 99),
    }


def row(
    config: str, concurrency: int, per_request: list[dict], duration_s: float, before: list, after: list
) -> dict[str, Any]:
    ok = [r for r in per_request if r["success"]]
    delta = {
        k: sum(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(after, before, strict=True)) for k in after[0]
    }
    prompt = delta["prompt"] or 1.0
    ttft = _ms([r["ttft_s"] for r in ok])
    itl = [x for r in ok for x in r["itl_s"]]
    classes = {}
    for c in CLASSES:
        xs = [r["ttft_s"] for r in ok if r["class"] == c]
        m = _ms(xs)
        classes[c] = {"n": len(xs), "mean_ttft_ms": m["mean"], "median_ttft_ms": m["median"]}
    return {
        "config": config,
        "concurrency": concurrency,
        "requests": len(per_request),
        "failed": len(per_request) - len(ok),
        "hit_rate": (delta["local"] + delta["external"]) / prompt,
        "local_hit_rate": delta["local"] / prompt,
        "external_hit_rate": delta["external"] / prompt,
        "prompt_tokens": int(delta["prompt"]),
        "external_hit_tokens": int(delta["external"]),
        "estimated_tier_tokens": sum(r["tier"] for r in ok),
        "mean_ttft_ms": ttft["mean"],
        "median_ttft_ms": ttft["median"],
        "p90_ttft_ms": ttft["p90"],
        "p99_ttft_ms": ttft["p99"],
        "coalesce": {k: delta.get(f"coalesce_{k}", 0.0) for k in COALESCE},
        "mean_itl_ms": 1000 * statistics.fmean(itl) if itl else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s else 0.0,
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / duration_s if duration_s else 0.0,
        "duration_s": duration_s,
        "classes": classes,
        "ttfts_ms": sorted(1000 * r["ttft_s"] for r in ok),
    }


def table(con, rows: list[dict], title: str) -> None:
    from rich.table import Table

    base = {r["concurrency"]: r for r in rows if r["config"] == "plain"}
    t = Table(title=title)
    for c in (
        "config",
        "conc",
        "hit % loc+ext",
        "TTFT ms mean/p50/p90/p99",
        "ITL ms",
        "req/s",
        "tok/s",
        "vs plain req/s, TTFT",
        "TTFT ms (n) local/tier/recomp",
        "fail",
    ):
        t.add_column(c, justify="right")
    for r in rows:
        b = base.get(r["concurrency"])
        vs = "-"
        if b and b is not r and b["requests_per_s"] and r["mean_ttft_ms"]:
            vs = f"{r['requests_per_s'] / b['requests_per_s']:.2f}x, {b['mean_ttft_ms'] / r['mean_ttft_ms']:.2f}x"
        cls = "/".join(
            f"{r['classes'][c]['mean_ttft_ms']:,.0f} ({r['classes'][c]['n']})"
            if r["classes"][c]["n"]
            else "-"
            for c in CLASSES
        )
        t.add_row(
            r["config"],
            str(r["concurrency"]),
            f"{100 * r['hit_rate']:.0f} {100 * r['local_hit_rate']:.0f}+{100 * r['external_hit_rate']:.0f}",
            f"{r['mean_ttft_ms']:,.0f}/{r['median_ttft_ms']:,.0f}/{r.get('p90_ttft_ms', 0):,.0f}/{r['p99_ttft_ms']:,.0f}",
            f"{r['mean_itl_ms']:.1f}",
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            vs,
            cls,
            str(r["failed"]),
        )
    con.print(t)
    con.print(
        "  vs plain: requests/s ratio and mean TTFT speedup against `plain` at the same concurrency, "
        "same run. TTFT by source: each request classed by where most of its prompt came from "
        "(cached_tokens per request, minus what its own server computed earlier = tier)."
    )


def plot(rows: list[dict], outdir: str, dataset: str, subtitle: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(outdir, exist_ok=True)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    files = []
    fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 4), squeeze=False)
    for ax, c in zip(axes[0], concs, strict=True):
        for cfg in configs:
            r = next((r for r in rows if r["config"] == cfg and r["concurrency"] == c), None)
            if r and r["ttfts_ms"]:
                xs = r["ttfts_ms"]
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=cfg)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"concurrency {c}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"bench serve {dataset}: TTFT CDF per configuration\n{subtitle}", fontsize=9)
    fig.tight_layout()
    files.append(os.path.join(outdir, f"serve-{dataset}-ttft-cdf.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for cfg in configs:
        rs = sorted((r for r in rows if r["config"] == cfg), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        a1.plot(xs, [100 * r["hit_rate"] for r in rs], marker="o", label=cfg)
        a2.plot(xs, [r["mean_ttft_ms"] for r in rs], marker="o", label=cfg)
    a1.set_ylabel("prefix hit rate % (servers' /metrics)")
    a2.set_ylabel("mean TTFT (ms)")
    a1.set_ylim(0, 100)
    a2.set_ylim(bottom=0)
    for a in (a1, a2):
        a.set_xlabel("concurrency")
        a.set_xticks(concs)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"bench serve {dataset}: hit rate and mean TTFT vs concurrency\n{subtitle}", fontsize=9)
    fig.tight_layout()
    files.append(os.path.join(outdir, f"serve-{dataset}-vs-concurrency.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
