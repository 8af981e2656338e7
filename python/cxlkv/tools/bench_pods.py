"""`cxlkv bench pods`: two pods, a real remote store behind them (docs/INTEGRATIONS.md, LMCache).

A pod is one cxlkv pool (a file under /dev/shm here, a CXL device in a rack); a host of a pod is
one LMCache multiprocess server whose L2 adapters are, in order, cxlkv on the pod's pool and one
real Redis/Valkey server shared by every pod (`RedisServer`), plus one vLLM OpenAI server on
cxlkv's `CxlKVLMCacheMPConnector`. Hosts run one after another (each host's LMCache L1 and vLLM's
own prefix cache start cold, so a hit can only come from the pool or the remote):

  1a  pod 1  computes the prompts                            -> TTFT "recompute"
  1b  pod 1  the same prompts: LMCache loads them from the pool -> "pool_hit"
  2a  pod 2  the same prompts: its pool is empty, the remote has them -> "remote_hit"
  1c  pod 1, its pool destroyed and created again: the prompts -> "remote_hit_after_recreate";
      then the remote is killed (SIGKILL) while 1c serves: fresh prompts -> "remote_down"
      (computed, answered); the remote restarts empty on the same port: fresh prompts again ->
      "after_remote_restart", and whether LMCache writes to it again (up to RESTART_ROUNDS more
      fresh requests, 5 s apart).

Per path: TTFT (latency of a max_tokens=1 completion: prefill + one token), the tokens vLLM
reports cached, the pool's hit delta, the values read from the remote (its GET count, from the
remote's INFO commandstats; LMCache asks every tier EXISTS on each lookup, so keyspace hits also
count lookups that loaded from the pool); the first generated token must equal the one host 1a computed. The remote's version and
key count are read from the remote itself. Needs vLLM, LMCache 0.5.6 (scripts/setup-peers.sh)
and valkey-server or redis-server on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import cxlkv
from cxlkv.errors import CommandError
from cxlkv.tools.remote_store import RedisServer
from cxlkv.tools.serve_fleet import Fleet, Server, cpu_sets, free_port, wait_port, wait_ready

__all__ = ["check", "print_result", "run"]

CHUNK = 256  # LMCache's chunk: only whole chunks are stored and loaded
L2_WAIT_S = 120  # LMCache writes its L2 adapters behind the request
RESTART_ROUNDS = 4  # fresh requests after the remote's restart, until LMCache writes to it again
PATHS = (
    "recompute",
    "pool_hit",
    "remote_hit",
    "remote_hit_after_recreate",
    "remote_down",
    "after_remote_restart",
)


def _lmcache_argv(pool: str, pool_size: str | int, redis_port: int, ports: tuple[int, int, int]) -> list[str]:
    cxl = {
        "type": "native_plugin",
        "module_path": "cxlkv.integrations.lmcache",
        "class_name": "CxlKVL2Connector",
        "adapter_params": {"pool_path": pool, "pool_size": pool_size},
    }
    remote = {"type": "resp", "host": "127.0.0.1", "port": redis_port, "num_workers": 2}
    port, http_port, prom_port = ports
    return [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
            "--l1-size-gb", "1", "--eviction-policy", "LRU", "--chunk-size", str(CHUNK),
            "--supported-transfer-mode", "auto", "--http-port", str(http_port),
            "--prometheus-port", str(prom_port),
            "--l2-adapter", json.dumps(cxl), "--l2-adapter", json.dumps(remote)]  # fmt: skip


def _kv_config(lmcache_port: int) -> dict:
    return {
        "kv_connector": "CxlKVLMCacheMPConnector",
        "kv_connector_module_path": "cxlkv.integrations.lmcache_vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
            "lmcache.mp.mq_timeout": 60,
        },
    }


def _host(
    fleet: Fleet, name: str, pool: str, pool_size: str | int, redis_port: int, model: str, served: str
) -> Server:
    """One host of a pod: its LMCache server (cxlkv first, the remote second), then its vLLM server."""
    ports = (free_port(), free_port(), free_port())
    proc, log = fleet.spawn(f"lmcache-{name}", _lmcache_argv(pool, pool_size, redis_port, ports))
    lm = Server(f"lmcache-{name}", f"http://127.0.0.1:{ports[1]}", proc, log)
    wait_port(lm, ports[0])
    _, cores = cpu_sets(1)
    server = fleet.vllm_server(f"vllm-{name}", model, served, 4096, cores, _kv_config(ports[0]))
    server.extra["lmcache_log"] = log
    wait_ready([server])
    return server


def complete(url: str, served: str, prompt: str) -> dict:
    """One max_tokens=1 greedy completion: seconds, prompt and cached tokens, the token."""
    body = json.dumps({"model": served, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    dt = time.perf_counter() - t0
    usage = out.get("usage") or {}
    return {
        "ttft_ms": round(dt * 1e3, 1),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "text": out["choices"][0]["text"],
    }


def _pool_stats(path: str) -> dict:
    with cxlkv.Pool.open(path, attach=False) as p:
        return p.stats()


def _wait_stored(pool: str, redis: RedisServer | None, puts: int, keys: int) -> None:
    """Until the pool holds `puts` puts and the remote `keys` keys (LMCache stores behind the
    request); a shortfall after L2_WAIT_S is reported by the caller's numbers, not hidden."""
    deadline = time.monotonic() + L2_WAIT_S
    while time.monotonic() < deadline:
        if _pool_stats(pool)["puts"] >= puts and (redis is None or redis.snapshot()["keys"] >= keys):
            return
        time.sleep(0.5)


def _path(
    name: str,
    host: str,
    url: str,
    served: str,
    prompts: list[str],
    pool: str,
    redis: RedisServer | None,
    stores: bool = False,
) -> dict:
    """Sends `prompts` and counts what they did. stores: the prompts are new, so the pool should
    take chunks of them; LMCache stores behind the request (and, with its remote dead or just
    restarted, may first wait out a failed connection), so the pool's count is read once it has
    moved, at most L2_WAIT_S later (a shortfall stays in the numbers), not the instant the answers
    return."""
    pool0 = _pool_stats(pool)
    remote0 = redis.snapshot() if redis else None
    reqs = [complete(url, served, p) for p in prompts]
    if stores:
        _wait_stored(pool, None, pool0["puts"] + 1, 0)
    pool1 = _pool_stats(pool)
    remote1 = redis.snapshot() if redis else None
    ttfts = [r["ttft_ms"] for r in reqs]
    return {
        "path": name,
        "host": host,
        "requests": len(reqs),
        "ttft_ms": ttfts,
        "median_ttft_ms": round(statistics.median(ttfts), 1),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "cached_tokens": sum(r["cached_tokens"] for r in reqs),
        "pool_hits": pool1["hits"] - pool0["hits"],
        "pool_puts": pool1["puts"] - pool0["puts"],
        # values read from the remote (GETs); its lookups (EXISTS) are counted apart
        "remote_reads": (remote1["reads"] - remote0["reads"]) if remote0 and remote1 else None,
        "remote_keyspace_hits": (remote1["keyspace_hits"] - remote0["keyspace_hits"])
        if remote0 and remote1
        else None,
        "texts": [r["text"] for r in reqs],
    }


def _remote_log_lines(log: str, since: int) -> list[str]:
    """The LMCache server's log lines after byte `since` that name the remote's failure."""
    with open(log, errors="replace") as f:
        f.seek(since)
        text = f.read()
    words = ("redis", "resp", "connect", "adapter 1", "error", "failed")
    return [line for line in text.splitlines() if any(w in line.lower() for w in words)]


def run(
    model: str = "smollm2",
    prompts: int = 2,
    words: int = 900,
    pool_size: str | int = "1GiB",
    on_progress: Callable[[str], None] | None = None,
    logdir: str | None = None,
) -> dict[str, Any]:
    from cxlkv.testing.prompts import seeded_words
    from cxlkv.tools.bench_serve import _uptime, resolve_model

    say = on_progress or (lambda _m: None)
    model_dir, served = resolve_model(model)
    logdir = logdir or tempfile.mkdtemp(prefix="cxlkv-bench-pods-")
    tag = f"{os.getpid()}-{int(time.time() * 1e3) % 10**8}"
    pools = {1: f"/dev/shm/cxlkv-pods-{tag}-1", 2: f"/dev/shm/cxlkv-pods-{tag}-2"}
    shared = [seeded_words(7000 + i, words) for i in range(prompts)]
    fresh_down = [seeded_words(8000 + i, words) for i in range(prompts)]
    fresh_back = [seeded_words(9000 + i, words) for i in range(prompts)]
    warm = "a short warm-up request"  # under one chunk: stored nowhere
    paths: dict[str, dict] = {}
    hosts: dict[str, str] = {}
    remote: dict[str, Any] = {}
    try:
        with RedisServer(logdir) as redis:
            for n in (1, 2):
                cxlkv.Pool.create(pools[n], pool_size).close()

            def host(name: str, pod: int) -> tuple[Fleet, Server]:
                say(f"host {name} (pod {pod}): starting LMCache + vLLM")
                fleet = Fleet(logdir)
                t0 = time.monotonic()
                try:
                    s = _host(fleet, name, pools[pod], pool_size, redis.port, model_dir, served)
                except BaseException:
                    fleet.stop()
                    raise
                hosts[name] = f"pod {pod}, up in {time.monotonic() - t0:.0f} s"
                complete(s.url, served, warm)
                return fleet, s

            fleet, s = host("1a", 1)
            with fleet:
                paths["recompute"] = _path("recompute", "1a", s.url, served, shared, pools[1], redis)
                chunks = paths["recompute"]["prompt_tokens"] // CHUNK - prompts  # lower bound
                _wait_stored(pools[1], redis, max(1, chunks), max(1, chunks))
            remote["after_pod1"] = redis.snapshot()
            remote["pool1_after_pod1"] = _pool_stats(pools[1])["used_blocks"]

            fleet, s = host("1b", 1)
            with fleet:
                paths["pool_hit"] = _path("pool_hit", "1b", s.url, served, shared, pools[1], redis)

            fleet, s = host("2a", 2)
            with fleet:
                paths["remote_hit"] = _path("remote_hit", "2a", s.url, served, shared, pools[2], redis)

            say("pod 1's pool destroyed and created again")
            cxlkv.Pool.destroy(pools[1], ignore_attached=True)
            cxlkv.Pool.create(pools[1], pool_size).close()
            fleet, s = host("1c", 1)
            with fleet:
                p = _path("remote_hit_after_recreate", "1c", s.url, served, shared, pools[1], redis)
                paths["remote_hit_after_recreate"] = p
                time.sleep(2)  # anything LMCache would write back into the new pool
                p["pool1_blocks_after"] = _pool_stats(pools[1])["used_blocks"]

                say("remote killed (SIGKILL) while host 1c serves")
                log = s.extra["lmcache_log"]
                since = os.path.getsize(log)
                redis.kill()
                down = _path("remote_down", "1c", s.url, served, fresh_down, pools[1], None, stores=True)
                time.sleep(3)  # LMCache's store behind the requests meets the dead remote
                lines = _remote_log_lines(log, since)
                down["lmcache_log_lines_about_remote"] = len(lines)
                down["lmcache_log_sample"] = lines[:3]
                paths["remote_down"] = down

                say("remote restarted (empty) on the same port")
                redis.start()
                since = os.path.getsize(log)
                back = _path(
                    "after_remote_restart", "1c", s.url, served, fresh_back, pools[1], redis, stores=True
                )
                # Does LMCache write to the restarted remote again? More fresh requests, a few
                # seconds apart, until it holds a key (its RESP client may need a failed call per
                # connection before it reconnects).
                back["rounds_until_remote_written"] = None
                for extra in range(RESTART_ROUNDS):
                    deadline = time.monotonic() + 5
                    while redis.snapshot()["keys"] == 0 and time.monotonic() < deadline:
                        time.sleep(0.5)
                    if redis.snapshot()["keys"]:
                        back["rounds_until_remote_written"] = extra + 1
                        break
                    complete(s.url, served, seeded_words(9500 + extra, words))
                back["remote_keys_after"] = redis.snapshot()["keys"]
                back["lmcache_log_lines_about_remote"] = len(_remote_log_lines(log, since))
                paths["after_remote_restart"] = back
            remote["end"] = redis.snapshot()
            remote["port"] = redis.port
            remote["binary"] = redis.binary
    except CommandError:
        raise
    except OSError as e:
        raise CommandError(f"bench pods: {e} (logs in {logdir})") from e
    finally:
        for path in pools.values():
            with contextlib.suppress(FileNotFoundError):
                cxlkv.Pool.destroy(path, ignore_attached=True)

    ref = paths["recompute"]["texts"]
    for name in ("pool_hit", "remote_hit", "remote_hit_after_recreate"):
        paths[name]["same_tokens_as_recompute"] = paths[name]["texts"] == ref
    return {
        "model": served,
        "prompts": prompts,
        "prompt_tokens_each": paths["recompute"]["prompt_tokens"] // max(1, prompts),
        "paths": paths,
        "remote": remote,
        "hosts": hosts,
        "pools": list(pools.values()),
        "uptime": _uptime(),
        "logdir": logdir,
    }


def check(summary: dict) -> list[str]:
    """What went wrong, as sentences (empty: every path did what the design says)."""
    p = summary["paths"]
    bad = []
    if not p["pool_hit"]["cached_tokens"] or not p["pool_hit"]["pool_hits"]:
        bad.append("pod 1's second host got no prefix from the pool")
    if p["pool_hit"]["remote_reads"]:
        bad.append("pod 1's second host read the remote although the pool had the prefix")
    if not p["remote_hit"]["cached_tokens"] or not p["remote_hit"]["remote_reads"]:
        bad.append("pod 2 got no prefix from the remote")
    if p["remote_hit"]["pool_hits"]:
        bad.append("pod 2's pool hit although it was empty")
    if not p["remote_hit_after_recreate"]["cached_tokens"]:
        bad.append("pod 1 after its pool was recreated got no prefix from the remote")
    bad += [
        f"{name}: another token than the recompute"
        for name in ("pool_hit", "remote_hit", "remote_hit_after_recreate")
        if not p[name]["same_tokens_as_recompute"]
    ]
    return bad


def print_result(con: Any, summary: dict) -> None:
    con.print(
        f"bench pods: {summary['model']}, {summary['prompts']} prompts of ~{summary['prompt_tokens_each']} tokens"
    )
    for name in PATHS:
        r = summary["paths"].get(name)
        if r:
            con.print(
                f"  {name:<26} host {r['host']}: TTFT median {r['median_ttft_ms']:>8.1f} ms, cached "
                f"{r['cached_tokens']:>5}/{r['prompt_tokens']} tokens, pool hits {r['pool_hits']}, remote reads "
                f"{r['remote_reads'] if r['remote_reads'] is not None else '(down)'}"
            )
    end = summary["remote"]["end"]
    con.print(
        f"  remote: {end['server']} {end['version']}, {end['keys']} keys at the end; {summary['uptime']}"
    )
    for sentence in check(summary):
        con.print(f"  [red]{sentence}[/red]")
    con.print(f"  logs: {summary['logdir']}")
