"""The ``cxlkv`` argument parser: the command tree, each command's options and their help.

Defaults that are facts of the library are read from it, never written here: the default pool
path (:func:`cxlkv.default_pool_path`, so ``$CXLKV_POOL`` names the pool of every command), pool
creation's defaults and limits (:func:`cxlkv.create_options`), the backends, the exit codes
(:mod:`cxlkv.errors`) and the benchmark geometries.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import cxlkv
from cxlkv.errors import exit_codes_text
from cxlkv.paths import default_pool_path
from cxlkv.sizes import parse_size
from cxlkv.tools._common import GEOMETRIES
from cxlkv.tools.sim import BREAKS, FAULTS

from .commands import (
    cmd_bench_copy,
    cmd_bench_failover,
    cmd_bench_index,
    cmd_bench_rpc,
    cmd_bench_serve,
    cmd_bench_vllm,
    cmd_demo,
    cmd_events,
    cmd_exporter,
    cmd_pool_check,
    cmd_pool_create,
    cmd_pool_destroy,
    cmd_pool_info,
    cmd_pool_ping,
    cmd_pool_reap,
    cmd_pool_stats,
    cmd_query,
    cmd_roi,
    cmd_sim,
    cmd_top,
)

__all__ = ["build_parser"]

_POOL_ENV_HELP = "Every command's default pool is $CXLKV_POOL if set, else /dev/shm/cxlkv-<uid>/pool."

# ---------------------------------------------------------------------------------------------
# argument types


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _stripe_size_arg(text: str) -> int:
    v = _size_arg(text)
    if v == 0:
        raise argparse.ArgumentTypeError("0 is not a stripe size (leave --stripe-size out for the default)")
    return v


def _ranged_int(option: dict[str, Any]):
    """An int type bounded by one row of :func:`cxlkv.create_options` (or of a pool's limits)."""

    def parse(text: str) -> int:
        v = _pos_int(text)
        hi = option["max"]
        if v < option["min"] or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range {option['min']}..{hi}")
        return v

    return parse


def _pos_int(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _procs_arg(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(_pos_int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"invalid process count {text!r}")
    return out


def _backend_args(p: argparse.ArgumentParser) -> None:
    """--backend / --compare-backends of bench copy and bench index."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--backend",
        choices=cxlkv._core.backends(),
        default="coherent",
        help="coherence backend of the benchmark's pool (default %(default)s)",
    )
    g.add_argument(
        "--compare-backends",
        action="store_true",
        help="run on coherent, then on multihost, and print multihost / coherent (same run)",
    )


def _leases_arg(text: str) -> list[int]:
    out = [_pos_int(part.strip()) for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"invalid lease list {text!r}")
    return out


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _range(option: dict[str, Any]) -> str:
    """``1..254 (default 64)`` from one row of :func:`cxlkv.create_options`."""
    hi = option["max"]
    return f"{option['min']}..{hi if hi is not None else ''} (default {option['default']})"


# One line per backend for `pool create --backend` (coherence.h, docs/ARCHITECTURE.md §2, §11).
# The contract test holds this to cxlkv._core.backends(): a new backend needs its line here.
BACKEND_HELP = {
    "coherent": "one host, hardware-coherent memory (DRAM, /dev/shm, a coherent CXL device)",
    "flush": "one host, non-coherent CXL memory: metadata written back and re-read explicitly "
    "(clwb/clflushopt), payloads by streaming stores",
    "multihost": "several hosts on one CXL 2.0 pool without coherence between them: the flush "
    "discipline plus a cross-host lock (bakery) for claims and lease fencing; see --lock-hosts",
}


def _backend_help() -> str:
    return "; ".join(f"{name}: {BACKEND_HELP[name]}" for name in cxlkv._core.backends())


_PATH_HELP = (
    "pool file or /dev/daxX.Y, or several joined by commas (A,B,...: one pool striped over them, "
    "first device first)"
)


def _pool_path_arg(p: argparse.ArgumentParser, default_pool: str) -> None:
    p.add_argument("path", nargs="?", default=default_pool, help=f"{_PATH_HELP} (default {default_pool})")


# ---------------------------------------------------------------------------------------------
# parser


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``cxlkv: error:`` style for bad arguments (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


_NODE_HELP = "node id, as listed by 'pool info' (1..the pool's max_nodes)"

_FOREIGN_HELP = (
    "accept a pool owned by another user or writable by others (that user can read and corrupt every block)"
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cxlkv",
        description="cxlkv: a KV-cache block store in a shared-memory (CXL) pool.",
        epilog=exit_codes_text() + " " + _POOL_ENV_HELP,
    )
    try:
        ver = version("cxlkv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ver = "unknown"
    p.add_argument("--version", action="version", version=f"cxlkv {ver}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    default_pool = default_pool_path()  # $CXLKV_POOL, read now: the pool the library would open
    create = cxlkv.create_options()

    # pool -------------------------------------------------------------------------------------
    pool = sub.add_parser("pool", help="create, inspect, check and destroy pools")
    psub = pool.add_subparsers(dest="pool_command", metavar="ACTION", parser_class=_Parser)
    psub.required = True

    c = psub.add_parser("create", help=f"create a pool (a file, default {default_pool}, or a devdax device)")
    c.add_argument("path", nargs="?", default=default_pool, help=f"{_PATH_HELP} (default {default_pool})")
    c.add_argument("--size", type=_size_arg, required=True, help="pool size, e.g. 4GiB, 512MiB, 1G")
    c.add_argument("--chunk-size", type=_size_arg, default=None, help="allocator chunk size, e.g. 8MiB")
    c.add_argument(
        "--stripe-size",
        type=_stripe_size_arg,
        default=None,
        help="only for a PATH of several devices (A,B,...; an error otherwise): bytes per stripe, "
        f"a power of two, {_range(create['stripe_bytes'])}",
    )
    c.add_argument(
        "--index-slots", type=_pos_int, default=None, help="index entries (rounded to a power of two)"
    )
    c.add_argument(
        "--max-nodes",
        type=_pos_int,
        default=None,
        help=f"max attached processes, {_range(create['max_nodes'])}",
    )
    c.add_argument(
        "--max-namespaces",
        type=_pos_int,
        default=None,
        help=f"max model layouts in the pool, {_range(create['max_namespaces'])}",
    )
    c.add_argument(
        "--pin-slots",
        type=_pos_int,
        default=None,
        help="pin slots per process (default: derived from the size)",
    )
    c.add_argument(
        "--backend",
        choices=cxlkv._core.backends(),
        default=create["backend"]["default"],
        help=f"memory backend (default %(default)s). {_backend_help()}",
    )
    c.add_argument(
        "--lock-hosts",
        type=_ranged_int(create["lock_hosts"]),
        default=None,
        help="only with --backend multihost (an error otherwise): rows of the lock area, the most "
        f"hosts that can attach, {_range(create['lock_hosts'])}",
    )
    c.add_argument(
        "--lease-ms",
        type=_pos_int,
        default=None,
        help=f"heartbeat lease for nodes of another kernel, ms, {_range(create['lease_ms'])}",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="destroy an existing pool (or a bad, half-made pool file) at PATH first; "
        "refused while processes are attached",
    )
    c.add_argument(
        "--ignore-attached",
        action="store_true",
        help="with --force: replace the pool even while processes are attached to it",
    )
    c.add_argument("--allow-foreign-owner", action="store_true", help=_FOREIGN_HELP)
    c.add_argument("--json", action="store_true", help="print the new pool's info as JSON")
    c.add_argument("--verbose", action="store_true", help="also show the format's internals (offsets, ...)")
    c.set_defaults(func=cmd_pool_create)

    for name, func, helptext in (
        ("info", cmd_pool_info, "show the pool header, geometry and namespaces"),
        ("stats", cmd_pool_stats, "show usage and hit/miss/eviction counters"),
        ("check", cmd_pool_check, "verify the pool's invariants (exit 1 on any inconsistency left)"),
    ):
        s = psub.add_parser(name, help=helptext)
        _pool_path_arg(s, default_pool)
        s.add_argument("--json", action="store_true", help="print one JSON object")
        s.add_argument("--allow-foreign-owner", action="store_true", help=_FOREIGN_HELP)
        if name == "info":
            s.add_argument(
                "--verbose",
                action="store_true",
                help="also show the format's internals (offsets, inodes, ...)",
            )
        if name == "check":
            s.add_argument(
                "--repair",
                action="store_true",
                help="also release what nobody else ever will (entries whose writer is gone, "
                "condemned or leaked blocks no one holds, lock rows no host owns) and list each repair",
            )
            s.add_argument(
                "--no-wait",
                action="store_true",
                help="do not watch nodes of other hosts before judging them (by default: up to a "
                "lease and a quarter, at most 20 s); any not judged yet fail the check as undecided",
            )
        s.set_defaults(func=func)

    # Node ids are 1..max_nodes of the pool: the format's bound here, the pool's own in the core.
    node_id = _ranged_int({**create["max_nodes"], "min": 1})
    r = psub.add_parser("reap", help="reclaim one dead node (what it held: pins, half-written blocks)")
    r.add_argument("node", type=node_id, help=_NODE_HELP)
    _pool_path_arg(r, default_pool)
    r.add_argument(
        "--force",
        action="store_true",
        help="reclaim even a node judged alive (its process is fenced); exit 1 without it",
    )
    r.add_argument(
        "--wait",
        type=_pos_float,
        nargs="?",
        const=0.0,
        default=None,
        metavar="SECONDS",
        help="keep watching a node judged alive or undecided until it is dead, then reclaim it "
        "(default: three leases; a node of another host is judged by its heartbeat lease). Without "
        "it, a node of another host is watched for one lease at most",
    )
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_pool_reap)

    pg = psub.add_parser("ping", help="round trip through a node's admin mailbox (shared-memory RPC)")
    pg.add_argument("node", type=node_id, help=_NODE_HELP)
    _pool_path_arg(pg, default_pool)
    pg.add_argument(
        "--count", type=_pos_int, default=3, help="round trips (default 3; the first wakes an idle responder)"
    )
    pg.add_argument(
        "--timeout-ms", type=_pos_int, default=1000, help="wait per round trip, ms (default 1000)"
    )
    pg.add_argument("--json", action="store_true", help="print one JSON object")
    pg.set_defaults(func=cmd_pool_ping)

    d = psub.add_parser("destroy", help="unlink a file pool / wipe a devdax pool header")
    _pool_path_arg(d, default_pool)
    d.add_argument(
        "--ignore-attached",
        action="store_true",
        help="destroy even while processes are attached (refused otherwise; they are listed)",
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="also remove a bad or half-made pool file (0 bytes, bad magic), and ignore attached processes",
    )
    d.set_defaults(func=cmd_pool_destroy)

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
        help="of single,plain,cxlkv,lmcache, run in this order, each on fresh servers (default all; "
        "lmcache is skipped with the reason when it is not installed: scripts/setup-peers.sh)",
    )
    bs.add_argument(
        "--dataset",
        default="prefix_repetition",
        help="prefix_repetition, multiturn, or both comma-separated (run on the same servers of "
        "each configuration, one after the other; default prefix_repetition)",
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

    # demo -------------------------------------------------------------------------------------
    dm = sub.add_parser("demo", help="several processes sharing one pool: hit rates and bandwidth")
    dm.add_argument("--procs", type=_pos_int, default=4, help="worker processes (default 4)")
    dm.add_argument("--seconds", type=_pos_float, default=8.0, help="run time in seconds (default 8)")
    dm.add_argument(
        "--pool", default=default_pool, help=f"pool path, created if missing (default {default_pool})"
    )
    dm.add_argument(
        "--size",
        type=_size_arg,
        default=parse_size(cxlkv.DEFAULT_POOL_SIZE),
        help=f"size if the pool must be created (default {cxlkv.DEFAULT_POOL_SIZE})",
    )
    dm.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    dm.add_argument(
        "--vllm",
        action="store_true",
        help="the real thing: two vLLM servers (SmolLM2) sharing a pool, a multi-turn "
        "conversation moved from one to the other, TTFT against plain vLLM (needs vLLM)",
    )
    dm.add_argument(
        "--repeats",
        type=_pos_int,
        default=3,
        help="with --vllm: conversations run; each TTFT cell is their median (default 3)",
    )
    dm.set_defaults(func=cmd_demo)
    # sim ----------------------------------------------------------------------------------------
    sm = sub.add_parser("sim", help="multi-host proof: simulated hosts without coherence, checked")
    sm.add_argument("--hosts", type=_pos_int, default=3, help="simulated hosts (default 3, at most 59)")
    sm.add_argument(
        "--seconds",
        type=_pos_float,
        default=4.0,
        help="bound of the whole run (default 4): the workload gets what is left after stopping the "
        "hosts and the final check (two leases and under a second); a --lease-ms that leaves too "
        "little is refused, naming the shortest --seconds that fits",
    )
    sm.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    sm.add_argument(
        "--break",
        dest="brk",
        choices=BREAKS,
        default=None,
        help="negative control: flushes as no-ops, invalidations skipped, or the lock's ticket "
        "write-backs dropped; the run must then find violations (exit 1 if it does not)",
    )
    sm.add_argument(
        "--backend",
        choices=("multihost", "flush"),
        default="multihost",
        help="pool backend under test (flush: the one-host discipline, not multi-host safe)",
    )
    sm.add_argument("--lease-ms", type=_pos_int, default=500, help="heartbeat lease (default 500)")
    sm.add_argument("--no-crashes", action="store_true", help="no random host crashes")
    sm.add_argument("--no-pauses", action="store_true", help="no pauses past the lease")
    sm.add_argument(
        "--fault", choices=FAULTS, default=None, help="crash hosts at this named fault point instead"
    )
    sm.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sm.set_defaults(func=cmd_sim)
    # roi ----------------------------------------------------------------------------------------
    ro = sub.add_parser(
        "roi",
        help="GPUs needed with and without the pool (the ByteDance cost model, seed 003 Table 1)",
    )
    ro.add_argument("--gpu-tflops", type=_pos_float, required=True, help="P: one GPU's TFLOP/s")
    ro.add_argument("--prefill-tflop", type=_pos_float, help="C0: TFLOP of an initial request's prefill")
    ro.add_argument(
        "--model-config", help="a Hugging Face config.json: C0 = 2 x parameters x --context-tokens"
    )
    ro.add_argument(
        "--context-tokens", type=_pos_int, help="average prompt length in tokens (with --model-config)"
    )
    ro.add_argument(
        "--kv-dtype", default=None, help="KV dtype for the bytes a hit loads (default: the config's)"
    )
    ro.add_argument(
        "--new-prompt-ratio", type=float, help="r: share of a follow-up's prompt that is new (0..1)"
    )
    ro.add_argument("--slo-s", type=_pos_float, required=True, help="T_slo: the TTFT SLO in seconds")
    ro.add_argument("--load-s", type=float, help="T_load: seconds to load a prefix's KV from the pool")
    ro.add_argument(
        "--load-gbps", type=_pos_float, help="pool load bandwidth, GB/s (T_load from the KV bytes)"
    )
    ro.add_argument("--multi-round-ratio", type=float, help="h: share of requests that are follow-ups (0..1)")
    ro.add_argument("--rps", type=_pos_float, required=True, help="R: prefill requests/s to serve")
    ro.add_argument(
        "--from-bench", help="a `cxlkv bench serve --json` file: measured hit rate (and bandwidth)"
    )
    ro.add_argument(
        "--bench-config", default="cxlkv", help="which configuration of --from-bench (default cxlkv)"
    )
    ro.add_argument(
        "--bench-dataset", default=None, help="which dataset of --from-bench, when it has several"
    )
    ro.add_argument("--json", action="store_true", help="print one JSON object")
    ro.set_defaults(func=cmd_roi)
    # events, query (routers: tools/events.py, tools/query.py) ----------------------------------
    ev = sub.add_parser("events", help="publish the pool's KV events (vLLM's ZMQ format) for routers")
    ev.add_argument(
        "path", nargs="?", default=default_pool, metavar="POOL", help=f"pool (default {default_pool})"
    )
    ev.add_argument(
        "--endpoint", default="tcp://*:5557", help="ZMQ PUB address to bind (default %(default)s)"
    )
    ev.add_argument(
        "--replay-endpoint",
        default="tcp://*:5558",
        help="ZMQ ROUTER address answering replays of missed sequence numbers (default %(default)s; "
        "'' for none)",
    )
    ev.add_argument(
        "--interval", type=_pos_float, default=0.1, help="seconds between index scans (default 0.1)"
    )
    ev.add_argument(
        "--buffer", type=_pos_int, default=10_000, help="messages kept for replay (default 10000)"
    )
    ev.add_argument(
        "--topic",
        default="kv@cxlkv-{pool}@{namespace}",
        help="topic template, llm-d's kv@<pod>@<model> ({pool}, {namespace}, {model}; default %(default)s)",
    )
    ev.add_argument("--namespace", default=None, help="only this namespace (pool name)")
    ev.add_argument(
        "--record-wait",
        type=float,
        default=1.0,
        help="seconds a new block waits for its token record (default 1)",
    )
    ev.add_argument("--duration", type=_pos_float, default=None, help="stop after this many seconds")
    ev.add_argument("--verbose", action="store_true", help="one line per published message on stdout")
    ev.set_defaults(func=cmd_events)
    qy = sub.add_parser("query", help="longest prefix of token ids whose KV is in the pool (CLI or HTTP)")
    qy.add_argument("tokens", nargs="*", type=int, metavar="TOKEN", help="token ids (or --tokens-json)")
    qy.add_argument("--pool", dest="path", default=default_pool, help=f"pool (default {default_pool})")
    qy.add_argument("--tokens-json", default=None, help="a JSON list of token ids ('-': stdin)")
    qy.add_argument(
        "--namespace",
        default=None,
        help="KV namespace: its pool name (kv2-...) or weights identity (model_id)",
    )
    qy.add_argument(
        "--lora-id", default=None, help="the adapter's content id, 'lora:<digest>' (not its name)"
    )
    qy.add_argument("--cache-salt", default=None, help="the tenant's cache_salt")
    qy.add_argument(
        "--serve", type=_pos_int, default=None, metavar="PORT", help="answer POST /query over HTTP"
    )
    qy.add_argument("--host", default="127.0.0.1", help="address --serve listens on (default %(default)s)")
    qy.add_argument("--json", action="store_true", help="print the result as one JSON object")
    qy.set_defaults(func=cmd_query)
    # observe: exporter, top ------------------------------------------------------------------
    ex = sub.add_parser(
        "exporter", help="serve a Prometheus /metrics of the whole pool (read at each scrape)"
    )
    _pool_path_arg(ex, default_pool)
    ex.add_argument("--port", type=_pos_int, required=True, help="TCP port of /metrics")
    ex.add_argument("--addr", default="0.0.0.0", help="address to listen on (default %(default)s)")
    ex.add_argument("--allow-foreign-owner", action="store_true", help=_FOREIGN_HELP)
    ex.set_defaults(func=cmd_exporter)
    tp = sub.add_parser(
        "top", help="live view of a pool: use, hit rate, traffic, namespaces, nodes (q quits)"
    )
    _pool_path_arg(tp, default_pool)
    tp.add_argument("--once", action="store_true", help="print one frame (rates over --interval) and exit")
    tp.add_argument("--interval", type=_pos_float, default=1.0, help="seconds between refreshes (default 1)")
    tp.set_defaults(func=cmd_top)
    return p
