"""``cxlkv bench ...``: copy, index, rpc, failover, vllm, sparse, tp, serve, pods."""

from __future__ import annotations

import argparse
from typing import Any

from cxlkv.sizes import parse_size
from cxlkv.tools._common import GEOMETRIES

from .commands import (
    cmd_bench_copy,
    cmd_bench_failover,
    cmd_bench_index,
    cmd_bench_rpc,
    cmd_bench_serve,
    cmd_bench_vllm,
)
from .parser_types import (
    _backend_args,
    _leases_arg,
    _Parser,
    _pos_int,
    _procs_arg,
    _size_arg,
)


def add_bench(sub: Any, default_pool: str) -> None:
    """Adds the ``bench`` command group to the subcommands ``sub``; ``default_pool``: the pool a command opens when
    none is named."""
    # bench ------------------------------------------------------------------------------------
    bench = sub.add_parser("bench", help="benchmarks: copy bandwidth and index latency")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=_Parser)
    bsub.required = True

    bc = bsub.add_parser("copy", help="store/load bandwidth of vLLM-layout KV blocks vs memcpy")
    bc.add_argument("--json", action="store_true", help="print one JSON object")
    bc.add_argument(
        "--geometry",
        choices=[*GEOMETRIES, "all"],
        default="all",
        help="model KV geometry (default %(default)s)",
    )
    bc.add_argument("--iters", type=_pos_int, default=7, help="timed iterations per measurement (default 7)")
    bc.add_argument(
        "--batch-size",
        type=_size_arg,
        default=parse_size("128MiB"),
        help="bytes per store/load batch (default 128MiB)",
    )
    bc.add_argument(
        "--copy-threads",
        type=_pos_int,
        default=None,
        help="threads the core may use per large batch (default: the core's choice; "
        "1 compares like for like with the single-threaded memcpy)",
    )
    bc.add_argument(
        "--dir",
        "--pool-dir",
        dest="pool_dir",
        default="/dev/shm",
        help="where the temporary pool lives (default /dev/shm); a hugetlbfs or a tmpfs mounted "
        "huge=always puts it on 2 MiB pages (page_bytes in the result says what it got)",
    )
    bc.add_argument(
        "--devices",
        type=_pos_int,
        default=1,
        help="also run each geometry on a pool striped over this many files, same run "
        "(ratio to the single file; default 1: single file only)",
    )
    _backend_args(bc)
    bc.set_defaults(func=cmd_bench_copy)

    bi = bsub.add_parser("index", help="lookup/insert latency and multi-process lookup throughput")
    bi.add_argument(
        "--procs",
        type=_procs_arg,
        default=None,
        help="process counts, e.g. 4 or 1,2,4 (1 is always run as the baseline; "
        "default: 1, 2, 4, ... up to the core count)",
    )
    bi.add_argument("--json", action="store_true", help="print one JSON object")
    bi.add_argument(
        "--ops", type=_pos_int, default=300_000, help="timed lookups per process (default 300000)"
    )
    bi.add_argument(
        "--keys", type=_pos_int, default=100_000, help="keys prefilled before timing (default 100000)"
    )
    bi.add_argument(
        "--samples",
        type=_pos_int,
        default=20_000,
        help="individually timed lookups per process for p50/p99 (default 20000)",
    )
    bi.add_argument(
        "--inserts",
        type=_pos_int,
        default=20_000,
        help="individually timed inserts per process (default 20000)",
    )
    bi.add_argument(
        "--pool-dir", default="/dev/shm", help="where the temporary pool lives (default /dev/shm)"
    )
    _backend_args(bi)
    bi.set_defaults(func=cmd_bench_index)

    br = bsub.add_parser(
        "rpc", help="shared-memory RPC round trips vs TCP, Unix socket and ZeroMQ (same run)"
    )
    br.add_argument("--json", action="store_true", help="print one JSON object")
    br.add_argument(
        "--iterations", type=_pos_int, default=20000, help="timed depth-1 round trips (default 20000)"
    )
    br.add_argument("--warmup", type=_pos_int, default=2000, help="untimed round trips first (default 2000)")
    br.add_argument("--depth", type=_pos_int, default=128, help="deep queue depth (default 128)")
    br.add_argument("--batches", type=_pos_int, default=1000, help="timed batches at --depth (default 1000)")
    br.add_argument(
        "--backend",
        choices=["coherent", "flush"],
        default="coherent",
        help="discipline of the rpc channel (default coherent)",
    )
    br.add_argument("--no-pin", action="store_true", help="do not pin server and client to two CPUs")
    br.add_argument("--dir", default="/dev/shm", help="where the channel file lives (default /dev/shm)")
    br.set_defaults(func=cmd_bench_rpc)

    bf = bsub.add_parser(
        "failover",
        help="multihost: time from kill -9 of a host's process to its node reclaimed by a survivor",
    )
    bf.add_argument(
        "--lease-ms",
        type=_leases_arg,
        default=[200, 1000],
        help="heartbeat leases to measure, e.g. 200,1000 (one pool each; default 200,1000)",
    )
    bf.add_argument("--trials", type=_pos_int, default=20, help="kills per lease (default 20)")
    bf.add_argument("--seed", type=int, default=None, help="seed of the kill phases (default: random)")
    bf.add_argument("--json", action="store_true", help="print one JSON object")
    bf.add_argument(
        "--pool-dir", default="/dev/shm", help="where the temporary pools live (default /dev/shm)"
    )
    bf.set_defaults(func=cmd_bench_failover)

    bv = bsub.add_parser(
        "vllm",
        help="multi-turn TTFT on real vLLM engines: off / local prefix "
        "cache / cxlkv across two replicas (needs vLLM)",
    )
    bv.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    bv.add_argument("--contexts", type=_pos_int, default=2, help="conversations (default 2)")
    bv.add_argument("--turns", type=_pos_int, default=5, help="turns per conversation (default 5)")
    bv.add_argument(
        "--turn-words",
        type=_pos_int,
        default=1100,
        help="words appended per turn (default 1100: ~7K tokens at turn 5)",
    )
    bv.add_argument("--plot", default=None, help="write a PNG of TTFT per turn here")
    bv.add_argument("--json", action="store_true", help="print one JSON object")
    bv.set_defaults(func=cmd_bench_vllm)

    # bench sparse (issue 15): top-k token rows from the pool vs the whole context
    from .commands import cmd_bench_sparse

    def _tokens_list(text: str) -> list[int]:
        out = [
            _pos_int(p.strip()[:-1]) * 1024 if p.strip()[-1:] in "kK" else _pos_int(p.strip())
            for p in text.split(",")
            if p.strip()
        ]
        if not out:
            raise argparse.ArgumentTypeError(f"invalid context list {text!r}")
        return out

    def _rates(text: str) -> list[float]:
        out = [float(p) for p in text.split(",") if p.strip()]
        if not out or not all(0 <= r <= 1 for r in out):
            raise argparse.ArgumentTypeError(f"hit rates are numbers in [0, 1], got {text!r}")
        return out

    bs = bsub.add_parser(
        "sparse",
        help="DeepSeek-V3.2 sparse attention: top-k token rows per layer from the pool vs the "
        "whole context, with and without the hot buffer (same run)",
    )
    bs.add_argument(
        "--contexts",
        type=_tokens_list,
        default=[16384, 32768, 65536, 131072],
        help="context lengths in tokens, e.g. 16K,128K (default 16K,32K,64K,128K)",
    )
    bs.add_argument("--topk", type=_pos_int, default=2048, help="tokens per layer per step (default 2048)")
    bs.add_argument(
        "--layers",
        type=_pos_int,
        default=4,
        help="layers stored and measured (of 61; bytes and times scale linearly; default 4)",
    )
    bs.add_argument(
        "--formats",
        type=lambda t: [f for f in t.split(",") if f],
        default=["fp8_ds_mla", "bf16"],
        help="row formats: fp8_ds_mla (656 B), bf16 (1,152 B)",
    )
    bs.add_argument(
        "--hit-rates",
        type=_rates,
        default=[0.5, 0.8, 0.95],
        help="hot-buffer hit rates to simulate (default 0.5,0.8,0.95)",
    )
    bs.add_argument("--steps", type=_pos_int, default=8, help="decode steps timed per hit rate (default 8)")
    bs.add_argument("--seed", type=int, default=None, help="seed of rows and indices (default: random)")
    bs.add_argument(
        "--pool-dir", default="/dev/shm", help="where the temporary pools live (default /dev/shm)"
    )
    bs.add_argument(
        "--copy-threads",
        type=_pos_int,
        default=None,
        help="threads one gather may use (default: the core's choice; 1 compares like for like "
        "with the single-threaded memcpy)",
    )
    bs.add_argument("--json", action="store_true", help="print one JSON object")
    bs.set_defaults(func=cmd_bench_sparse)
    # bench tp (issue 22): loads across tensor-parallel sizes, per-head entries vs whole blocks
    from .commands import cmd_bench_tp

    bt = bsub.add_parser(
        "tp",
        help="a TP=2 rank loading its KV heads of blocks a TP=1 engine wrote, and a TP=1 load of "
        "per-head entries, each vs the whole-block layout at the same TP size (same run, one pool)",
    )
    bt.add_argument(
        "--layers", type=_pos_int, default=None, help="layers (default 32: Llama-3-8B; --state: 4)"
    )
    bt.add_argument(
        "--heads",
        type=_pos_int,
        default=None,
        help="KV heads at TP=1 (default 8; TP=2 splits them); --state: key heads (default 16: Qwen3-Next)",
    )
    bt.add_argument("--head-size", type=_pos_int, default=128, help="head size (default 128)")
    bt.add_argument("--block", type=_pos_int, default=16, help="tokens per block (default 16)")
    bt.add_argument(
        "--blocks", type=_pos_int, default=None, help="blocks per load call (default 64; --state: 8)"
    )
    bt.add_argument(
        "--state",
        action="store_true",
        help="Gated DeltaNet state blocks instead of KV: a TP=2 rank loading its key heads' state "
        "entries a TP=1 engine wrote, and TP=1 from those entries, each vs one whole-state entry",
    )
    bt.add_argument("--iters", type=_pos_int, default=7, help="timed loads per case, median (default 7)")
    bt.add_argument(
        "--copy-threads",
        type=_pos_int,
        default=None,
        help="threads one load may use (default: the core's choice)",
    )
    bt.add_argument(
        "--pool-dir", default="/dev/shm", help="where the temporary pool lives (default /dev/shm)"
    )
    bt.add_argument("--json", action="store_true", help="print one JSON object")
    bt.set_defaults(func=cmd_bench_tp)
    # bench serve (issue 16): N vLLM servers behind a round-robin router, vLLM's own client
    bs = bsub.add_parser(
        "serve",
        help="N vLLM OpenAI servers behind a cache-unaware router, driven by vLLM's own benchmark "
        "client: single / plain / cxlkv / lmcache in one run (needs vLLM)",
    )
    bs.add_argument("--model", default="smollm2", help="tiny, smollm2 or a model directory (default smollm2)")
    bs.add_argument("--instances", type=_pos_int, default=2, help="servers behind the router (default 2)")
    bs.add_argument(
        "--concurrency", type=_procs_arg, default=[1, 4, 8], help="client concurrency levels (default 1,4,8)"
    )
    bs.add_argument(
        "--configs",
        type=lambda t: [c.strip() for c in t.split(",") if c.strip()],
        default=["single", "plain", "cxlkv", "lmcache"],
        help="of single,plain,cxlkv,nocoalesce,lmcache, run in this order, each on fresh servers "
        "(default single,plain,cxlkv,lmcache; nocoalesce: cxlkv with coalescing off; lmcache is "
        "skipped with the reason when it is not installed: scripts/setup-peers.sh)",
    )
    bs.add_argument(
        "--dataset",
        default="prefix_repetition",
        help="prefix_repetition, multiturn, multiturn_overlap (every turn in one round: a turn "
        "arrives while the previous one is in flight), or several comma-separated (run on the "
        "same servers of each configuration, one after the other; default prefix_repetition)",
    )
    bs.add_argument(
        "--num-prompts", type=_pos_int, default=32, help="requests per concurrency level (default 32)"
    )
    bs.add_argument(
        "--num-prefixes", type=_pos_int, default=8, help="prefix_repetition: prefixes (default 8)"
    )
    bs.add_argument(
        "--prefix-len",
        type=_pos_int,
        default=2048,
        help="tokens of each shared prefix / of a conversation's opening context (default 2048)",
    )
    bs.add_argument(
        "--suffix-len",
        type=_pos_int,
        default=64,
        help="prefix_repetition: tokens after the prefix (default 64)",
    )
    bs.add_argument(
        "--output-len", type=_pos_int, default=16, help="tokens generated per request (default 16)"
    )
    bs.add_argument("--turns", type=_pos_int, default=4, help="multiturn: turns per conversation (default 4)")
    bs.add_argument(
        "--turn-len",
        type=_pos_int,
        default=512,
        help="multiturn: tokens of each new question (default 512; with N servers, what the tier "
        "must supply beyond a server's own history)",
    )
    bs.add_argument(
        "--pool-gib",
        type=_pos_int,
        default=2,
        help="the cxlkv pool's and LMCache's L1 size in GiB, the same for both (default 2)",
    )
    bs.add_argument(
        "--single-cores",
        choices=["share", "all"],
        default="share",
        help="cores of `single`: one server's share (default: like with like per server) or all "
        "N shares (like with like in total)",
    )
    bs.add_argument(
        "--plot", default=None, help="write PNGs here: TTFT CDF, hit rate and TTFT vs concurrency"
    )
    bs.add_argument("--json", action="store_true", help="print a JSON list of rows")
    bs.set_defaults(func=cmd_bench_serve)

    # bench pods (issue 24): two pods, LMCache with cxlkv first and a real Redis/Valkey behind it
    from .commands import cmd_bench_pods

    bp = bsub.add_parser(
        "pods",
        help="two pods (two pools), LMCache servers with cxlkv as the first L2 and one real "
        "Redis/Valkey as the second: TTFT of pool hit / remote hit / recompute, remote death and "
        "restart (needs vLLM, LMCache, redis-server; a long benchmark: four engine starts, one after another)",
    )
    bp.add_argument("--model", default="smollm2", help="tiny, smollm2 or a model directory (default smollm2)")
    bp.add_argument("--prompts", type=_pos_int, default=2, help="prompts per path (default 2)")
    bp.add_argument(
        "--words",
        type=_pos_int,
        default=900,
        help="words per prompt (default 900: ~3K tokens with smollm2, ~1.5K with tiny)",
    )
    bp.add_argument(
        "--pool-size", type=_size_arg, default=parse_size("1GiB"), help="each pod's pool (default 1GiB)"
    )
    bp.add_argument("--json", action="store_true", help="print one JSON object")
    bp.set_defaults(func=cmd_bench_pods)
