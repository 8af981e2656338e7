"""The ``cxlkv`` command line: pool administration, benchmarks and the demo.

    cxlkv pool create PATH --size 4GiB [--chunk-size 8MiB] [--index-slots N] [--max-nodes N]
                           [--pin-slots N] [--backend coherent|flush] [--lease-ms MS]
                           [--force [--ignore-attached]]
    cxlkv pool info    [PATH] [--json]      read-only: needs no write access, takes no node slot;
                                            header, geometry, namespaces, nodes and their liveness
    cxlkv pool stats   [PATH] [--json]
    cxlkv pool check   [PATH] [--json]      exit 1 when an inconsistency is found
    cxlkv pool reap    NODE [PATH] [--force] [--json]   reclaim one dead node (--force: even a live one)
    cxlkv pool destroy PATH [--ignore-attached] [--force]
    (pool commands refuse a pool owned or writable by another user unless --allow-foreign-owner)
    cxlkv bench copy   [--json] [--geometry llama3-8b|smollm2-135m|all] [--iters N]
    cxlkv bench index  [--procs N[,N...]] [--json] [--ops N]
    cxlkv demo         [--procs N] [--seconds S] [--pool PATH]

Exit codes: 0 ok, 1 inconsistency found by ``pool check``, 2 bad input or cannot open.
Every cxlkv error and OS error is reported as one line ``cxlkv: error: <message>`` on stderr
(set ``CXLKV_DEBUG=1`` to get the traceback as well).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from cxlkv import _core
from cxlkv.paths import DEFAULT_POOL_PATH as DEFAULT_POOL
from cxlkv.sizes import format_size, parse_size

__all__ = ["main", "build_parser", "DEFAULT_POOL", "CommandError"]


class CommandError(Exception):
    """A command failed in a way worth one line, not a traceback (a benchmark or demo worker died,
    a pool too small for a benchmark, wrong bytes read back). ``detail`` (e.g. a worker's traceback)
    is printed only with CXLKV_DEBUG=1; ``exit_code`` 1 marks an inconsistency, 2 a failure."""

    def __init__(self, message: str, detail: str = "", exit_code: int = 2):
        super().__init__(message)
        self.detail = detail
        self.exit_code = exit_code


# ---------------------------------------------------------------------------------------------
# output helpers


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout (and nothing else)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o: Any):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, (bytes, bytearray, memoryview)):
        return bytes(o).hex()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


_SIZE_HINTS = ("bytes", "_size")


def _fmt_value(key: str, value: Any) -> str:
    """Render one scalar for a table: byte counts also get a human-readable form, offsets hex,
    timestamps a date."""
    k = key.lower()
    if isinstance(value, bool):
        return "[green]yes[/green]" if value else "[red]no[/red]"
    if isinstance(value, float):
        if "rate" in k or "ratio" in k:
            return f"{value:.4f}"
        return f"{value:.4g}"
    if isinstance(value, int):
        if (k.endswith(_SIZE_HINTS) or k.startswith("bytes_")) and value >= 1024:
            return f"{value} ({format_size(value)})"
        if k.endswith("_off"):
            return f"{value:#x}"
        if k.endswith("_unix_ns") and value > 0:
            import datetime

            ts = datetime.datetime.fromtimestamp(value / 1e9).astimezone()
            return f"{value} ({ts.isoformat(timespec='seconds')})"
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return _escape(", ".join(str(v) for v in value)) if value else "-"
    return _escape(str(value))


def _no_controls(text: str) -> str:
    """F18: strings read from a pool are written by any attached process; a control character
    (ESC sequences, CR, C1 controls) would drive the operator's terminal. Show them as \\xNN."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F else c for c in text)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(_no_controls(text))


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(not isinstance(x, (dict, list, tuple)) for x in v)
    return not isinstance(v, dict)


def render_mapping(console, title: str, data: dict) -> None:
    """Render a (possibly nested) dict: a bold title line, then scalars in a key/value table;
    nested dicts and lists of dicts get their own sections."""
    from rich.table import Table

    scalars = {k: v for k, v in data.items() if _is_scalar(v)}
    if title:
        console.print(f"[bold]{_escape(title)}[/bold]")
    if scalars:
        t = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 2))
        t.add_column(style="cyan", no_wrap=True)
        t.add_column(overflow="fold")
        for k, v in scalars.items():
            t.add_row(str(k), _fmt_value(str(k), v))
        console.print(t)
    for k, v in data.items():
        if k in scalars:
            continue
        sub = f"{title} / {k}" if title else str(k)
        if isinstance(v, dict):
            if v and all(isinstance(x, dict) for x in v.values()):
                render_rows(console, sub, [{"name": name, **x} for name, x in v.items()])
            else:
                render_mapping(console, sub, v)
        elif isinstance(v, (list, tuple)):
            render_rows(console, sub, [x if isinstance(x, dict) else {"value": x} for x in v])


def render_rows(console, title: str, rows: list[dict]) -> None:
    """Render a list of dicts as one table, a row per dict."""
    from rich.table import Table

    if not rows:
        console.print(f"[bold]{_escape(title)}[/bold]: none")
        return
    cols: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in cols and _is_scalar(v):
                cols.append(k)
    console.print(f"[bold]{_escape(title)}[/bold]")
    t = Table()
    for c in cols:
        t.add_column(str(c), justify="right" if _numeric_col(rows, c) else "left")
    for r in rows:
        t.add_row(*[_fmt_value(str(c), r.get(c)) if c in r else "" for c in cols])
    console.print(t)
    for i, r in enumerate(rows):  # nested values inside rows get their own sections
        nested = {k: v for k, v in r.items() if not _is_scalar(v)}
        if nested:
            label = r.get("name") or r.get("id") or i
            render_mapping(console, f"{title} [{label}]", nested)


def render_namespaces(console, namespaces: list[dict]) -> None:
    """A compact namespace table (one line per model layout)."""
    from rich.table import Table

    if not namespaces:
        console.print("[bold]namespaces[/bold]: none")
        return
    from rich import box

    t = Table(title="namespaces", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
              show_edge=False, collapse_padding=True)
    for c in ("id", "name", "model", "layout", "tp", "block", "blocks/chunk", "source"):
        t.add_column(c, justify="right" if c in ("id", "block", "blocks/chunk") else "left",
                     overflow="fold")
    for n in namespaces:
        layout = (f"{n.get('kind', '?')} {n.get('dtype', '?')} L{n.get('num_layers', '?')} "
                  f"H{n.get('num_kv_heads', '?')} D{n.get('head_size', '?')} T{n.get('tokens_per_block', '?')}")
        bb = n.get("block_bytes")
        t.add_row(str(n.get("id", "")), _escape(str(n.get("name", ""))), _escape(str(n.get("model_id", ""))),
                  layout, f"{n.get('tp_rank', 0)}/{n.get('tp_size', 1)}",
                  format_size(bb) if isinstance(bb, int) else "-", str(n.get("blocks_per_chunk", "-")),
                  _escape(str(n.get("source") or "-")))
    console.print(t)


def _numeric_col(rows: list[dict], c: str) -> bool:
    vals = [r.get(c) for r in rows if r.get(c) is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


# ---------------------------------------------------------------------------------------------
# argument types


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


# ---------------------------------------------------------------------------------------------
# pool commands


def _pool_info_dict(pool) -> dict:
    info = dict(pool.info())
    return info


def cmd_pool_create(args) -> int:
    import cxlkv

    kwargs: dict[str, Any] = {"backend": args.backend}
    for name in ("chunk_size", "index_slots", "max_nodes", "pin_slots", "lease_ms"):
        v = getattr(args, name)
        if v is not None:
            kwargs[name] = v
    if args.ignore_attached and not args.force:
        raise CommandError("--ignore-attached only goes with --force")
    if args.force and os.path.lexists(args.path):
        # Replaces a pool, or a bad / half-made pool file; never one that live processes use
        # unless --ignore-attached (they would keep serving the unlinked pool: split brain).
        cxlkv.Pool.destroy(args.path, ignore_attached=args.ignore_attached, remove_invalid=True)
    with cxlkv.Pool.create(args.path, args.size, allow_foreign_owner=args.allow_foreign_owner, **kwargs) as pool:
        info = _pool_info_dict(pool)
    if args.json:
        print_json(info)
    else:
        con = _console()
        con.print(f"[green]created[/green] pool {_escape(args.path)} ({format_size(args.size)})")
        render_mapping(con, "", info)
    return 0


_NODE_COLUMNS = ("node", "state", "verdict", "judged_by", "pid", "evidence")


def _node_rows(nodes: list[dict]) -> list[dict]:
    """The node table as shown to a person (all fields are in --json). The pid is the owner's in
    ITS pid namespace; the last beat's age is by wall clock, shown but never used to judge."""
    import time

    rows = []
    for n in nodes:
        row = {c: n.get(c) for c in _NODE_COLUMNS}
        beat = n.get("last_beat_unix_ns") or 0
        row["last_beat"] = f"{max(0.0, time.time() - beat / 1e9):.1f}s ago" if beat else "-"
        rows.append(row)
    return rows


def _observer(path: str, allow_foreign_owner: bool = False):
    """Opens PATH without taking a node slot: works when the node table is full."""
    import cxlkv

    return cxlkv.Pool.open(path, attach=False, allow_foreign_owner=allow_foreign_owner)


def cmd_pool_info(args) -> int:
    import cxlkv

    with cxlkv.Pool.open(args.path, read_only=True) as pool:
        info = _pool_info_dict(pool)
        namespaces = list(pool.namespaces())
        nodes = list(pool.nodes())
    if args.json:
        out = dict(info)
        out.setdefault("namespaces", namespaces)
        out["nodes"] = nodes
        print_json(out)
    else:
        con = _console()
        info = dict(info)
        info.pop("namespaces", None)
        render_mapping(con, f"pool {args.path}", info)
        render_namespaces(con, namespaces)
        render_rows(con, "nodes", _node_rows(nodes))
    return 0


def cmd_pool_stats(args) -> int:
    with _observer(args.path, args.allow_foreign_owner) as pool:
        stats = dict(pool.stats())
        nodes = list(pool.nodes())
    if args.json:
        stats["nodes"] = nodes
        print_json(stats)
    else:
        con = _console()
        render_mapping(con, f"stats {args.path}", stats)
        render_rows(con, "nodes", _node_rows(nodes))
    return 0


def cmd_pool_reap(args) -> int:
    with _observer(args.path) as pool:
        if args.force:
            print(f"cxlkv: warning: --force reclaims node {args.node} even if its process is alive; that "
                  "process is fenced (its next operation fails) and blocks it was writing are lost",
                  file=sys.stderr)
        res = dict(pool.reap_node(args.node, force=args.force))
    if args.json:
        print_json(res)
    else:
        con = _console()
        if res["state"] == "free":
            con.print(f"node {res['node']}: not attached (free slot); nothing to reclaim")
        else:
            what = "reclaimed" if res["reclaimed"] else "not reclaimed"
            con.print(f"node {res['node']}: {what} ({res['verdict']}: {_escape(str(res['evidence']))})")
    if res["reclaimed"] or res["state"] == "free":
        return 0
    if not args.json:
        print(f"cxlkv: error: node {args.node} is {res['verdict']}; use --force to reclaim it anyway",
              file=sys.stderr)
    return 1


def cmd_pool_check(args) -> int:
    with _observer(args.path, args.allow_foreign_owner) as pool:
        report = dict(pool.check())
    errors = list(report.get("errors") or [])
    ok = bool(report.get("ok", not errors)) and not errors
    if args.json:
        print_json(report)
    else:
        con = _console()
        rest = {k: v for k, v in report.items() if k not in ("ok", "errors", "warnings")}
        render_mapping(con, f"check {args.path}", rest)
        for w in report.get("warnings") or []:
            con.print(f"[yellow]warning:[/yellow] {_escape(str(w))}")
        for e in errors:
            con.print(f"[red]error:[/red] {_escape(str(e))}")
        if ok:
            con.print("[bold green]pool is consistent[/bold green]")
        else:
            con.print(f"[bold red]pool check failed ({len(errors)} errors)[/bold red]")
    return 0 if ok else 1


def cmd_pool_destroy(args) -> int:
    import cxlkv

    cxlkv.Pool.destroy(args.path, ignore_attached=args.ignore_attached or args.force, remove_invalid=args.force)
    _console().print(f"destroyed pool {_escape(args.path)}")
    return 0


# ---------------------------------------------------------------------------------------------
# bench / demo


def cmd_bench_copy(args) -> int:
    from cxlkv import bench

    result = bench.bench_copy(
        geometry=args.geometry,
        iters=args.iters,
        batch_bytes=args.batch_size,
        pool_dir=args.pool_dir,
        quiet=args.json,
        copy_threads=args.copy_threads,
    )
    if args.json:
        print_json(result)
    else:
        bench.print_copy_result(_console(), result)
    return 0


def _require_vllm(command: str) -> None:
    """The vLLM commands start engine processes; without vLLM each would fail only inside them."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CommandError(f"{command} needs vLLM, which is not installed in {sys.prefix} "
                           "(install it with scripts/setup-vllm.sh)")


def cmd_bench_vllm(args) -> int:
    _require_vllm("bench vllm")
    from cxlkv import bench_vllm
    return bench_vllm.run(model=args.model, contexts=args.contexts, turns=args.turns,
                          turn_words=args.turn_words, plot=args.plot, json_out=args.json)


def cmd_bench_index(args) -> int:
    from cxlkv import bench

    result = bench.bench_index(
        procs=args.procs,
        ops=args.ops,
        keys=args.keys,
        samples=args.samples,
        inserts=args.inserts,
        pool_dir=args.pool_dir,
        quiet=args.json,
    )
    if args.json:
        print_json(result)
    else:
        bench.print_index_result(_console(), result)
    return 0


def cmd_demo(args) -> int:
    if args.vllm:
        _require_vllm("demo --vllm")
        from cxlkv import demo_vllm
        return demo_vllm.run()
    from cxlkv import demo

    return demo.run_demo(
        pool_path=args.pool,
        procs=args.procs,
        seconds=args.seconds,
        size=args.size,
        json_out=args.json,
    )


# ---------------------------------------------------------------------------------------------
# parser


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``cxlkv: error:`` style for bad arguments (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


_FOREIGN_HELP = ("accept a pool owned by another user or writable by others "
                 "(that user can read and corrupt every block)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cxlkv",
        description="cxlkv: a KV-cache block store in a shared-memory (CXL) pool.",
        epilog="Exit codes: 0 ok, 1 inconsistency found by 'pool check', 2 bad input or cannot open.",
    )
    try:
        from importlib.metadata import version

        ver = version("cxlkv")
    except Exception:
        ver = "unknown"
    p.add_argument("--version", action="version", version=f"cxlkv {ver}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    # pool -------------------------------------------------------------------------------------
    pool = sub.add_parser("pool", help="create, inspect, check and destroy pools")
    psub = pool.add_subparsers(dest="pool_command", metavar="ACTION", parser_class=_Parser)
    psub.required = True

    c = psub.add_parser("create", help=f"create a pool (a file, default {DEFAULT_POOL}, or a devdax device)")
    c.add_argument("path", nargs="?", default=DEFAULT_POOL, help=f"pool file or /dev/daxX.Y (default {DEFAULT_POOL})")
    c.add_argument("--size", type=_size_arg, required=True, help="pool size, e.g. 4GiB, 512MiB, 1G")
    c.add_argument("--chunk-size", type=_size_arg, default=None, help="allocator chunk size, e.g. 8MiB")
    c.add_argument("--index-slots", type=_pos_int, default=None, help="index entries (rounded to a power of two)")
    c.add_argument("--max-nodes", type=_pos_int, default=None, help="max attached processes (default 64)")
    c.add_argument("--pin-slots", type=_pos_int, default=None, help="pin slots per process (default: derived from the size, at most 4096)")
    c.add_argument("--backend", choices=_core.backends(), default="coherent",
                   help="memory backend: coherent (one host) or flush (non-coherent CXL)")
    c.add_argument("--lease-ms", type=_pos_int, default=None,
                   help="heartbeat lease for nodes of another kernel, ms (default 10000)")
    c.add_argument("--force", action="store_true",
                   help="destroy an existing pool (or a bad, half-made pool file) at PATH first; "
                        "refused while processes are attached")
    c.add_argument("--ignore-attached", action="store_true",
                   help="with --force: replace the pool even while processes are attached to it")
    c.add_argument("--allow-foreign-owner", action="store_true", help=_FOREIGN_HELP)
    c.add_argument("--json", action="store_true", help="print the new pool's info as JSON")
    c.set_defaults(func=cmd_pool_create)

    for name, func, helptext in (
        ("info", cmd_pool_info, "show the pool header, geometry and namespaces"),
        ("stats", cmd_pool_stats, "show usage and hit/miss/eviction counters"),
        ("check", cmd_pool_check, "verify the pool's invariants (exit 1 on any inconsistency)"),
    ):
        s = psub.add_parser(name, help=helptext)
        s.add_argument("path", nargs="?", default=DEFAULT_POOL, help=f"pool path (default {DEFAULT_POOL})")
        s.add_argument("--json", action="store_true", help="print one JSON object")
        s.add_argument("--allow-foreign-owner", action="store_true", help=_FOREIGN_HELP)
        s.set_defaults(func=func)

    r = psub.add_parser("reap", help="reclaim one dead node (what it held: pins, half-written blocks)")
    r.add_argument("node", type=_pos_int, help="node id, as listed by 'pool info'")
    r.add_argument("path", nargs="?", default=DEFAULT_POOL, help=f"pool path (default {DEFAULT_POOL})")
    r.add_argument("--force", action="store_true",
                   help="reclaim even a node judged alive (its process is fenced); exit 1 without it")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_pool_reap)

    d = psub.add_parser("destroy", help="unlink a file pool / wipe a devdax pool header")
    d.add_argument("path", help=f"pool path, e.g. {DEFAULT_POOL}")
    d.add_argument("--ignore-attached", action="store_true",
                   help="destroy even while processes are attached (refused otherwise; they are listed)")
    d.add_argument("--force", action="store_true",
                   help="also remove a bad or half-made pool file (0 bytes, bad magic), and ignore attached processes")
    d.set_defaults(func=cmd_pool_destroy)

    # bench ------------------------------------------------------------------------------------
    bench = sub.add_parser("bench", help="benchmarks: copy bandwidth and index latency")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=_Parser)
    bsub.required = True

    bc = bsub.add_parser("copy", help="store/load bandwidth of vLLM-layout KV blocks vs memcpy")
    bc.add_argument("--json", action="store_true", help="print one JSON object")
    bc.add_argument("--geometry", choices=["llama3-8b", "smollm2-135m", "all"], default="all")
    bc.add_argument("--iters", type=_pos_int, default=7, help="timed iterations per measurement (default 7)")
    bc.add_argument("--batch-size", type=_size_arg, default=parse_size("128MiB"),
                    help="bytes per store/load batch (default 128MiB)")
    bc.add_argument("--copy-threads", type=_pos_int, default=None,
                    help="threads the core may use per large batch (default: the core's choice; "
                         "1 compares like for like with the single-threaded memcpy)")
    bc.add_argument("--pool-dir", default="/dev/shm", help="where the temporary pool lives (default /dev/shm)")
    bc.set_defaults(func=cmd_bench_copy)

    bi = bsub.add_parser("index", help="lookup/insert latency and multi-process lookup throughput")
    bi.add_argument("--procs", type=_procs_arg, default=None,
                    help="process counts, e.g. 4 or 1,2,4 (1 is always run as the baseline; "
                         "default: 1, 2, 4, ... up to the core count)")
    bi.add_argument("--json", action="store_true", help="print one JSON object")
    bi.add_argument("--ops", type=_pos_int, default=300_000, help="timed lookups per process (default 300000)")
    bi.add_argument("--keys", type=_pos_int, default=100_000, help="keys prefilled before timing (default 100000)")
    bi.add_argument("--samples", type=_pos_int, default=20_000,
                    help="individually timed lookups per process for p50/p99 (default 20000)")
    bi.add_argument("--inserts", type=_pos_int, default=20_000,
                    help="individually timed inserts per process (default 20000)")
    bi.add_argument("--pool-dir", default="/dev/shm", help="where the temporary pool lives (default /dev/shm)")
    bi.set_defaults(func=cmd_bench_index)

    bv = bsub.add_parser("vllm", help="multi-turn TTFT on real vLLM engines: off / local prefix "
                                      "cache / cxlkv across two replicas (needs vLLM)")
    bv.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    bv.add_argument("--contexts", type=_pos_int, default=2, help="conversations (default 2)")
    bv.add_argument("--turns", type=_pos_int, default=5, help="turns per conversation (default 5)")
    bv.add_argument("--turn-words", type=_pos_int, default=1100,
                    help="words appended per turn (default 1100: ~7K tokens at turn 5)")
    bv.add_argument("--plot", default=None, help="write a PNG of TTFT per turn here")
    bv.add_argument("--json", action="store_true", help="print one JSON object")
    bv.set_defaults(func=cmd_bench_vllm)

    # demo -------------------------------------------------------------------------------------
    dm = sub.add_parser("demo", help="several processes sharing one pool: hit rates and bandwidth")
    dm.add_argument("--procs", type=_pos_int, default=4, help="worker processes (default 4)")
    dm.add_argument("--seconds", type=_pos_float, default=8.0, help="run time in seconds (default 8)")
    dm.add_argument("--pool", default=DEFAULT_POOL, help=f"pool path, created if missing (default {DEFAULT_POOL})")
    dm.add_argument("--size", type=_size_arg, default=parse_size("1GiB"),
                    help="size if the pool must be created (default 1GiB)")
    dm.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    dm.add_argument("--vllm", action="store_true",
                    help="the real thing: two vLLM servers (SmolLM2) sharing a pool, a multi-turn "
                         "conversation moved from one to the other, TTFT against plain vLLM (needs vLLM)")
    dm.set_defaults(func=cmd_demo)

    from cxlkv import sim as _sim  # `cxlkv sim`: the multi-host proof (python/cxlkv/sim.py)

    _sim.add_parser(sub)
    return p


# ---------------------------------------------------------------------------------------------
# entry point


def format_error(e: BaseException) -> str:
    """One line describing an error: OS errors as 'path: reason', cxlkv errors by their message."""
    if isinstance(e, OSError) and e.strerror:
        msg = e.strerror
        if e.filename is not None:
            msg = f"{os.fsdecode(e.filename)}: {msg}"
            if getattr(e, "filename2", None) is not None:
                msg += f" -> {os.fsdecode(e.filename2)}"
    else:
        msg = str(e)
        if isinstance(e, KeyError) and len(e.args) == 1:
            msg = str(e.args[0])
        if not msg:
            msg = type(e).__name__
    msg = " ".join(line.strip() for line in msg.splitlines() if line.strip())
    return _no_controls(msg)


def _handled_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [OSError, ValueError]
    try:
        import cxlkv

        errs.insert(0, cxlkv.CxlkvError)
    except Exception:  # the package failed to import: report that instead
        pass
    return tuple(errs)


def main(argv: list[str] | None = None) -> int:
    """Run the ``cxlkv`` command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, bad arguments
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("cxlkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cxlkv pool stats | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except CommandError as e:
        print(f"cxlkv: error: {format_error(e)}", file=sys.stderr)
        if e.detail and os.environ.get("CXLKV_DEBUG"):
            print(e.detail.rstrip(), file=sys.stderr)
        return e.exit_code
    except ImportError as e:
        if os.environ.get("CXLKV_DEBUG"):
            raise
        print(f"cxlkv: error: cannot import the cxlkv core: {format_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if not isinstance(e, _handled_errors()) or os.environ.get("CXLKV_DEBUG"):
            raise
        print(f"cxlkv: error: {format_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
