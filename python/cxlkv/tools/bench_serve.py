"""`cxlkv bench serve`: N vLLM OpenAI servers behind a cache-unaware router, driven by vLLM's own
benchmark client (``vllm.benchmarks.serve.benchmark`` and its datasets, as a library), in several
configurations one after another in the same run, each on fresh servers:

  single   one server takes every request: the hit-rate ceiling of a cache-unaware router
  plain    N servers, vLLM's own prefix caching only
  cxlkv    N servers on one cxlkv pool (python/cxlkv/integrations/vllm.py)
  nocoalesce  the same with coalescing of in-flight prefixes off (``"coalesce": false``)
  lmcache  N servers on one LMCache multiprocess server (LMCacheMPConnector), the leading peer;
           skipped with the reason when lmcache is not installed (scripts/setup-peers.sh)

Cores: each of the N servers' engine threads is bound to its own share of the cores
(``VLLM_CPU_OMP_THREADS_BIND``; on 2 cores one core each). `single` compares like with like per
server by default (``single_cores="share"``: the cores of one server, so its TTFT is what one
server of the N-server rows would give with every prefix local; the N-server rows have N times
the cores, which is the scale-out being measured); ``single_cores="all"`` gives it the union of
the N shares instead (the same cores as the N-server rows, the same total compute). On a loaded
machine the second can be much slower than one core: OpenMP threads that wait at a barrier for a
preempted sibling. The router, the client and the servers' API front ends are not bound.

Per configuration and concurrency: the prefix hit rate from the servers' /metrics (local and
external tokens), mean / median / p99 TTFT, ITL, requests/s, output tokens/s, and TTFT per source
class (serve_report.py). Needs vLLM (scripts/setup-vllm.sh); --plot needs matplotlib.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import os
import signal
import tempfile
import time
import urllib.request
from typing import Any

from cxlkv.errors import CommandError
from cxlkv.tools import serve_report, serve_workloads
from cxlkv.tools.serve_fleet import Fleet, Server, cpu_sets, wait_port, wait_ready

__all__ = ["CONFIGS", "DATASETS", "run"]

CONFIGS = ("single", "plain", "cxlkv", "nocoalesce", "lmcache")
DATASETS = ("prefix_repetition", "multiturn", "multiturn_overlap")
MODEL_LIMIT = {"tiny": 16384, "smollm2": 8192}


def resolve_model(model: str) -> tuple[str, str]:
    """(directory, served name) of `tiny`, `smollm2` or a model directory."""
    from cxlkv.testing import models

    if model == "tiny":
        return models.tiny_llama(), "tiny"
    if model == "smollm2":
        return models.smollm2(), "smollm2"
    if not os.path.isdir(model):
        raise CommandError(f"bench serve --model {model!r}: not tiny, smollm2 or a model directory")
    return model, os.path.basename(os.path.normpath(model))


def _kv_config(config: str, pool: str, pool_gib: int, lmcache_port: int | None) -> dict | None:
    if config in ("cxlkv", "nocoalesce"):
        extra: dict[str, Any] = {"pool_path": pool, "pool_size": f"{pool_gib}GiB"}
        if config == "nocoalesce":
            extra["coalesce"] = False
        return {
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if config == "lmcache":
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": lmcache_port,
                # LMCache's own default (300 s): its engines give up reaching the MP server after
                # this long, and on a loaded machine a server's start took more than 60 s.
                "lmcache.mp.mq_timeout": 300,
            },
        }
    return None


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


async def _drive(
    rounds, router: str, served: str, tokenizer, concurrency: int, endpoint: str, on_progress
) -> tuple[list[dict], float]:
    """Runs each round through vLLM's benchmark client; returns per-request outputs (in input
    order) and the summed duration. Its printed report goes to the log, not the terminal."""
    from vllm.benchmarks.serve import TaskType, benchmark

    outputs: list[dict] = []
    duration = 0.0
    for rnd in rounds:
        buf = io.StringIO()
        poll = asyncio.create_task(_poll_progress(router, on_progress))
        try:
            with contextlib.redirect_stdout(buf):
                res = await benchmark(
                    task_type=TaskType.GENERATION,
                    endpoint_type=endpoint,
                    api_url=router + "/v1/completions",
                    base_url=router,
                    model_id=served,
                    model_name=served,
                    tokenizer=tokenizer,
                    input_requests=[t.request for t in rnd],
                    logprobs=None,
                    request_rate=float("inf"),
                    burstiness=1.0,
                    disable_tqdm=True,
                    num_warmups=0,
                    profile=False,
                    selected_percentile_metrics=["ttft", "itl"],
                    selected_percentiles=[50.0, 99.0],
                    ignore_eos=True,
                    goodput_config_dict={},
                    max_concurrency=concurrency,
                    lora_modules=None,
                    extra_headers=None,
                    extra_body={"temperature": 0.0},
                    ready_check_timeout_sec=0,  # its test request would warm a prefix before the run
                )
        finally:
            poll.cancel()
        duration += res["duration"]
        outputs.extend(
            {
                "success": not res["errors"][i],
                "error": res["errors"][i],
                "ttft_s": res["ttfts"][i],
                "itl_s": res["itls"][i],
                "start_s": res["start_times"][i],
                "output_tokens": res["output_lens"][i],
            }
            for i in range(len(rnd))
        )
    on_progress(None)
    return outputs, duration


async def _poll_progress(router: str, on_progress) -> None:
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(Exception):
            on_progress(len(await loop.run_in_executor(None, _get_json, router + "/router/requests")))
        await asyncio.sleep(0.5)


def _start(
    fleet: Fleet,
    config: str,
    n: int,
    model: str,
    served: str,
    max_len: int,
    pool_gib: int,
    shares: list[str],
    union: str,
) -> list[Server]:
    pool = os.path.join("/dev/shm", f"cxlkv-bench-serve-{os.getpid()}")
    lm_port = None
    if config == "lmcache":
        lm = fleet.lmcache_server(pool_gib)
        wait_port(lm, lm.extra["port"])
        lm_port = lm.extra["port"]
    kv = _kv_config(config, pool, pool_gib, lm_port)
    if config == "single":
        servers = [fleet.vllm_server("single-0", model, served, max_len, union, kv)]
    else:
        servers = [
            fleet.vllm_server(f"{config}-{i}", model, served, max_len, shares[i], kv) for i in range(n)
        ]
    wait_ready(servers)
    return servers


def _cleanup_pool() -> None:
    pool = os.path.join("/dev/shm", f"cxlkv-bench-serve-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pool)


def run(
    model: str = "smollm2",
    instances: int = 2,
    concurrency: list[int] | None = None,
    configs: list[str] | None = None,
    dataset: str | list[str] = "prefix_repetition",
    num_prompts: int = 32,
    num_prefixes: int = 8,
    prefix_len: int = 2048,
    suffix_len: int = 64,
    output_len: int = 16,
    turns: int = 4,
    turn_len: int = 512,
    pool_gib: int = 2,
    single_cores: str = "share",
    plot: str | None = None,
    console: Any = None,
) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    concurrency = concurrency or [1, 4, 8]
    configs = configs or list(CONFIGS)
    datasets = dataset.split(",") if isinstance(dataset, str) else list(dataset)
    bad = [d for d in datasets if d not in DATASETS]
    if bad or not datasets:
        raise CommandError(f"bench serve --dataset {','.join(bad)!r}: one of {', '.join(DATASETS)}")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise CommandError(f"bench serve --configs: unknown {', '.join(bad)} (known: {', '.join(CONFIGS)})")
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise CommandError(
            "bench serve --plot needs matplotlib: bash scripts/setup-peers.sh (or pip install matplotlib)"
        )
    con = console if console is not None else Console()
    skipped = {}
    if "lmcache" in configs and importlib.util.find_spec("lmcache") is None:
        skipped["lmcache"] = "lmcache is not installed (bash scripts/setup-peers.sh installs LMCache 0.5.6)"
        configs = [c for c in configs if c != "lmcache"]
    for c, why in skipped.items():
        con.print(f"[yellow]bench serve: skipping {c}: {why}[/yellow]")

    model_dir, served = resolve_model(model)
    users = max(1, num_prompts // turns)
    need = prefix_len + suffix_len + output_len + 64
    if "multiturn" in datasets or "multiturn_overlap" in datasets:
        need = max(need, prefix_len + turns * (turn_len + output_len) + 64)
    max_len = -(-need // 1024) * 1024
    limit = MODEL_LIMIT.get(model)
    if limit and max_len > limit:
        raise CommandError(f"bench serve: prompts need {need} tokens, more than {model}'s {limit}")
    if single_cores not in ("share", "all"):
        raise CommandError(f"bench serve --single-cores {single_cores!r}: share or all")
    shares, union = cpu_sets(instances)
    union = union if single_cores == "all" else shares[0]
    con.print(
        f"[bold]bench serve[/bold] {','.join(datasets)}, model {served}, {instances} servers behind a "
        f"round-robin router (multiturn: turn t of user u on server (u + t) mod N), configs "
        f"{','.join(configs)}, concurrency {','.join(map(str, concurrency))}; cores per server "
        f"{' | '.join(shares)}, single on {union}; load {os.getloadavg()[0]:.2f}"
    )

    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_dir)

    def workload(dataset: str, c: int):
        # fresh prompts per dataset and concurrency (no reuse across levels), the same per config
        seed = 1000 * (1 + DATASETS.index(dataset)) + c
        tag = f"{''.join(w[0] for w in dataset.split('_'))}c{c}"
        if dataset in ("multiturn", "multiturn_overlap"):
            make = serve_workloads.multiturn if dataset == "multiturn" else serve_workloads.multiturn_overlap
            return make(tokenizer, users, turns, prefix_len, turn_len, output_len, seed, tag)
        return serve_workloads.prefix_repetition(
            tokenizer, num_prompts, num_prefixes, prefix_len, suffix_len, output_len, seed, tag
        )

    levels = [(d, c) for d in datasets for c in concurrency]
    per_config = sum(len(r) for d, c in levels for r in workload(d, c))
    logdir = tempfile.mkdtemp(prefix="cxlkv-bench-serve-")
    con.print(f"  server, router and client logs in {logdir}")
    rows: list[dict] = []
    per_request: dict[str, list[dict]] = {}
    endpoint = "openai"  # completions: prompts as text (prefix_repetition) or token ids (multiturn)
    mode = "turn"  # requests without a route key (prefix_repetition) go round robin

    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # SIGTERM ends the run like Ctrl-C: every process is stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=con
    )
    try:
        with progress:
            total = progress.add_task("requests", total=len(configs) * per_config)
            finished = 0
            for config in configs:
                n = 1 if config == "single" else instances
                with Fleet(logdir) as fleet:
                    t0 = time.monotonic()
                    progress.update(total, description=f"{config}: starting {n} server(s)")
                    try:
                        servers = _start(
                            fleet, config, n, model_dir, served, max_len, pool_gib, shares, union
                        )
                    except CommandError as e:  # the other configurations' rows still count
                        skipped[config] = f"its servers did not start: {str(e)[:300]}"
                        con.print(f"  [red]{config}: skipped, {skipped[config]}[/red]")
                        finished += per_config
                        progress.update(total, completed=finished)
                        _cleanup_pool()
                        continue
                    router = fleet.router([s.url for s in servers], mode)
                    wait_ready([router])
                    con.print(f"  {config}: {n} server(s) ready in {time.monotonic() - t0:.0f} s")
                    seen_before = 0
                    for dataset_, c in levels:
                        rounds = workload(dataset_, c)
                        progress.update(total, description=f"{config}: {dataset_} @ concurrency {c}")
                        before = [serve_report.scrape(s.url) for s in servers]
                        base = finished

                        def on_progress(k, base=base, seen=seen_before):
                            if k is not None:
                                progress.update(total, completed=base + max(0, k - seen))

                        outputs, duration = asyncio.run(
                            _drive(rounds, router.url, served, tokenizer, c, endpoint, on_progress)
                        )
                        after = [serve_report.scrape(s.url) for s in servers]
                        records = _get_json(router.url + "/router/requests")
                        seen_before = len(records)
                        by_id = {r["request_id"]: r for r in records}
                        tagged = [t for rnd in rounds for t in rnd]
                        external = [a["external"] - b["external"] for a, b in zip(after, before, strict=True)]
                        classified = serve_report.classify(tagged, outputs, by_id, external)
                        r = serve_report.row(config, c, classified, duration, before, after)
                        r.update(dataset=dataset_, instances=n, model=served, load_avg_1m=os.getloadavg()[0])
                        rows.append(r)
                        events = serve_report.coalesce_events([s.log for s in servers])
                        per_request[f"{config}/{dataset_}@{c}"] = [
                            {
                                **{k: v for k, v in q.items() if k != "itl_s"},
                                "coalesce_events": events.get(q["request_id"], []),
                            }
                            for q in classified
                        ]
                        r["coalesce_timeline"] = serve_report.timeline(classified, events)
                        finished += len(tagged)
                        progress.update(total, completed=finished)
                        if r["failed"]:
                            first = next(q["error"] for q in classified if not q["success"])
                            con.print(
                                f"  [red]{config}: {dataset_} @ {c}: {r['failed']} requests failed[/red]: {first[:300]}"
                            )
                _cleanup_pool()
    finally:
        signal.signal(signal.SIGTERM, previous)
        _cleanup_pool()
    uptime = _uptime()
    files = []
    for d in datasets if plot else []:
        drows = [r for r in rows if r["dataset"] == d]
        if drows:
            files += serve_report.plot(drows, plot, d, f"{served}, {instances} servers; {uptime}")
    return {
        "datasets": datasets,
        "model": served,
        "instances": instances,
        "cores": {"per_server": shares, "single": union},
        "skipped": skipped,
        "uptime": uptime,
        "rows": rows,
        "per_request": per_request,
        "plots": files,
        "logdir": logdir,
    }


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            one, five, fifteen = f.read().split()[:3]
        return f"load average {one}, {five}, {fifteen}"
    except OSError:
        return ""


def print_result(con, summary: dict) -> None:
    for d in summary["datasets"]:
        serve_report.table(
            con,
            [r for r in summary["rows"] if r["dataset"] == d],
            f"bench serve {d}: {summary['model']}, {summary['instances']} servers",
        )
    con.print(
        f"  {summary['uptime']}; cores per server {' | '.join(summary['cores']['per_server'])}, "
        f"single on {summary['cores']['single']}"
    )
    for r in summary["rows"]:
        co = r.get("coalesce") or {}
        if co.get("waits") or co.get("declined"):
            con.print(
                f"  {r['config']}: {r['dataset']} @ {r['concurrency']}: coalescing: {co['waits']:.0f} waits "
                f"({co.get('declined', 0):.0f} computed instead: not clearly shorter) "
                f"({co['wait_s']:.1f} s in all), {co['timeouts']:.0f} timed out, {co['writer_gone']:.0f} "
                f"writer gone, {co['partial_loads']:.0f} partial loads, {co['saved_tokens']:,.0f} prefill "
                f"tokens saved"
            )
    for r in summary["rows"]:
        if r["external_hit_tokens"] or r["estimated_tier_tokens"]:
            con.print(
                f"  {r['config']}: {r['dataset']} @ {r['concurrency']}: tier tokens estimated per request "
                f"{r['estimated_tier_tokens']:,} vs the servers' external hits {r['external_hit_tokens']:,}"
            )
    for f in summary["plots"]:
        con.print(f"  wrote {f}")
    for c, why in summary["skipped"].items():
        con.print(f"  skipped {c}: {why}")


def json_rows(summary: dict) -> list[dict]:
    """The --json contract: a list of rows (config, concurrency, hit_rate, mean_ttft_ms,
    p99_ttft_ms, requests_per_s, ...), without the per-request TTFT lists."""
    return [{k: v for k, v in r.items() if k != "ttfts_ms"} for r in summary["rows"]]
