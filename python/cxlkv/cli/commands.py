"""The ``cxlkv`` commands: each takes the parsed arguments, does its work through the public API
or a tool, renders the result (``--json``: one object) and returns an exit code
(:class:`cxlkv.errors.ExitCode`). Errors propagate to :func:`cxlkv.cli.main`, which turns them
into one line and an exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import cxlkv
from cxlkv.errors import CommandError, ExitCode
from cxlkv.paths import device_paths
from cxlkv.services.pool_view import with_usage
from cxlkv.sizes import format_size

from .quota import quota_rows
from .render import (
    escape,
    make_console,
    print_json,
    render_internals,
    render_mapping,
    render_namespaces,
    render_pool_overview,
    render_rows,
)

# ---------------------------------------------------------------------------------------------
# pool commands


def cmd_pool_create(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {"backend": args.backend}
    for name in (
        "chunk_size",
        "index_slots",
        "max_nodes",
        "pin_slots",
        "max_namespaces",
        "lease_ms",
        "stripe_size",
        "lock_hosts",
        "intent_permille",
    ):
        v = getattr(args, name)
        if v is not None:
            kwargs[name] = v
    if args.ignore_attached and not args.force:
        raise CommandError("--ignore-attached only goes with --force")
    # The core refuses these too; checked here first so that --force destroys nothing for them.
    if args.stripe_size is not None and len(device_paths(args.path)) < 2:
        raise CommandError(
            f"--stripe-size is only meaningful for a pool of several devices (A,B,...); {args.path} is one"
        )
    if args.lock_hosts is not None and args.backend != "multihost":
        raise CommandError(
            f"--lock-hosts only goes with --backend multihost (the {args.backend} backend has no lock area)"
        )
    if args.force and any(os.path.lexists(d) for d in device_paths(args.path)):
        # Replaces a pool, or a bad / half-made pool file; never one that live processes use
        # unless --ignore-attached (they would keep serving the unlinked pool: split brain).
        cxlkv.Pool.destroy(args.path, ignore_attached=args.ignore_attached, remove_invalid=True)
    with cxlkv.Pool.create(
        args.path, args.size, allow_foreign_owner=args.allow_foreign_owner, **kwargs
    ) as pool:
        info = dict(pool.info())
        usage = list(pool.device_usage())
    if args.json:
        print_json(info)
    else:
        con = make_console()
        con.print(f"[green]created[/green] pool {escape(args.path)} ({format_size(args.size)})")
        devices = [{**d, **u} for d, u in zip(info["devices"], usage, strict=True)]
        render_pool_overview(con, f"pool {args.path}", info, devices, None)
        if args.verbose:
            render_rows(con, "devices", [_device_row(d) for d in devices])
            render_internals(con, {k: v for k, v in info.items() if k != "devices"})
        config = {
            "kv_connector": "CxlKVConnector",
            "kv_connector_module_path": "cxlkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"pool_path": args.path},
        }
        con.print(f"vLLM: --kv-transfer-config '{escape(json.dumps(config))}'", soft_wrap=True)
    return ExitCode.OK


_NODE_COLUMNS = ("node", "state", "verdict", "judged_by", "pid", "evidence")


def _node_rows(nodes: list[dict]) -> list[dict]:
    """The node table as shown to a person (all fields are in --json). The pid is the owner's in
    ITS pid namespace; the last beat's age is by wall clock, shown but never used to judge."""
    rows = []
    for n in nodes:
        row = {c: n.get(c) for c in _NODE_COLUMNS}
        if n.get("observer"):
            row["state"] = f"{row['state']} (observer)"
        if n.get("host_slot", -1) >= 0:  # multihost: the node's row of the lock area
            row["host slot"] = n["host_slot"]
        if n.get("intents"):  # block-less intents it holds (capped per node: info's intent_cap)
            row["intents"] = n["intents"]
        beat = n.get("last_beat_unix_ns") or 0
        row["last_beat"] = f"{max(0.0, time.time() - beat / 1e9):.1f}s ago" if beat else "-"
        rows.append(row)
    return rows


def _observer(path: str, allow_foreign_owner: bool = False) -> cxlkv.Pool:
    """Opens PATH without taking a node slot: works when the node table is full."""
    return cxlkv.Pool.open(path, attach=False, allow_foreign_owner=allow_foreign_owner)


def cmd_pool_info(args: argparse.Namespace) -> int:
    with cxlkv.Pool.open(args.path, read_only=True) as pool:
        info = dict(pool.info())
        namespaces = list(pool.namespaces())
        nodes = list(pool.nodes())
        usage = list(pool.device_usage())
        stats = None if args.json else dict(pool.stats())
        ns_usage = None if args.json else list(pool.namespace_usage())
        quotas = list(pool.quotas())
    # Devices (one for a single-device pool): identity from the header, use from the descriptors.
    devices = [{**d, **u} for d, u in zip(info.pop("devices"), usage, strict=True)]
    if args.json:
        print_json({**info, "devices": devices, "namespaces": namespaces, "nodes": nodes, "quotas": quotas})
    else:
        # What an operator asks first: capacity and use, backend, namespaces and what they were
        # derived from, nodes and their verdicts. The format's internals: --verbose (and --json).
        con = make_console()
        render_pool_overview(con, f"pool {args.path}", info, devices, stats)
        if args.verbose or len(devices) > 1:
            render_rows(con, "devices", [_device_row(d) for d in devices])
        render_namespaces(con, with_usage(namespaces, ns_usage or []))
        if quotas:  # `cxlkv pool quota` sets them
            render_rows(con, "quotas", quota_rows(quotas))
        render_rows(con, "nodes", _node_rows(nodes))
        if args.verbose:
            render_internals(con, info)
        else:
            con.print("[dim]offsets, inode numbers, checksum position: --verbose (or --json)[/dim]")
    return ExitCode.OK


def _device_row(d: dict) -> dict:
    """One device as shown to a person (identity fields stay in --json)."""
    return {
        "device": d["index"],
        "path": d["path"],
        "pool share": format_size(d["pool_bytes"]),
        "used / carved": f"{format_size(d['used_bytes'])} / {format_size(d['capacity_bytes'])}",
    }


def cmd_pool_stats(args: argparse.Namespace) -> int:
    with _observer(args.path, args.allow_foreign_owner) as pool:
        stats = dict(pool.stats())
        nodes = list(pool.nodes())
    if args.json:
        stats["nodes"] = nodes
        print_json(stats)
    else:
        con = make_console()
        render_mapping(con, f"stats {args.path}", stats)
        render_rows(con, "nodes", _node_rows(nodes))
    return ExitCode.OK


def cmd_pool_reap(args: argparse.Namespace) -> int:
    with _observer(args.path) as pool:
        if args.force:
            print(
                f"cxlkv: warning: --force reclaims node {args.node} even if its process is alive; that "
                "process is fenced (its next operation fails) and blocks it was writing are lost",
                file=sys.stderr,
            )
        wait = 0.0
        if args.wait is not None:  # --wait without SECONDS: three leases
            wait = args.wait or 3 * pool.info()["lease_ms"] / 1000
            if not args.json:
                print(f"cxlkv: watching node {args.node} for up to {wait:.1f} s", file=sys.stderr)
        res = dict(pool.reap_node(args.node, force=args.force, wait=wait))
    if args.json:
        print_json(res)
    else:
        con = make_console()
        if res["state"] == "free":
            con.print(f"node {res['node']}: not attached (free slot); nothing to reclaim")
        else:
            what = "reclaimed" if res["reclaimed"] else "not reclaimed"
            con.print(f"node {res['node']}: {what} ({res['verdict']}: {escape(str(res['evidence']))})")
    if res["reclaimed"] or res["state"] == "free":
        return ExitCode.OK
    if not args.json:
        print(
            f"cxlkv: error: node {args.node} is {res['verdict']}; use --force to reclaim it anyway",
            file=sys.stderr,
        )
    return ExitCode.CHECK_FAILED


CHECK_WATCH_MAX_S = 20.0  # `pool check` watches nodes of other hosts at most this long


def cmd_pool_check(args: argparse.Namespace) -> int:
    with _observer(args.path, args.allow_foreign_owner) as pool:
        # Nodes of other hosts are judged by their lease: watch them for up to a lease and a
        # quarter, but never longer than CHECK_WATCH_MAX_S (the lease comes from the pool header,
        # which may say an hour); what is still undecided then fails the check as undecided.
        lease_s = pool.info()["lease_ms"] / 1000
        wait = 0.0 if args.no_wait else min(1.25 * lease_s + 0.1, CHECK_WATCH_MAX_S)
        report = dict(pool.check(repair=args.repair, wait=wait))
    errors = list(report.get("errors") or [])
    ok = bool(report.get("ok", not errors)) and not errors
    if args.json:
        print_json(report)
    else:
        con = make_console()
        rest = {k: v for k, v in report.items() if k not in ("ok", "errors", "warnings", "repaired")}
        render_mapping(con, f"check {args.path}", rest)
        for w in report.get("repaired") or []:
            con.print(f"[green]repaired:[/green] {escape(str(w))}")
        for w in report.get("warnings") or []:
            con.print(f"[yellow]warning:[/yellow] {escape(str(w))}")
        for e in errors:
            con.print(f"[red]error:[/red] {escape(str(e))}")
        if ok:
            con.print("[bold green]pool is consistent[/bold green]")
        else:
            con.print(f"[bold red]pool check failed ({len(errors)} errors)[/bold red]")
    return ExitCode.OK if ok else ExitCode.CHECK_FAILED


def cmd_pool_destroy(args: argparse.Namespace) -> int:
    cxlkv.Pool.destroy(
        args.path, ignore_attached=args.ignore_attached or args.force, remove_invalid=args.force
    )
    make_console().print(f"destroyed pool {escape(args.path)}")
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------
# bench / demo


def cmd_bench_copy(args: argparse.Namespace) -> int:
    from cxlkv.tools import bench

    kwargs = dict(
        geometry=args.geometry,
        iters=args.iters,
        batch_bytes=args.batch_size,
        pool_dir=args.pool_dir,
        quiet=args.json,
        copy_threads=args.copy_threads,
        devices=args.devices,
    )
    return _bench_on_backends(args, bench.bench_copy, bench.print_copy_result, kwargs)


def _bench_on_backends(args: argparse.Namespace, run, print_one, kwargs: dict[str, Any]) -> int:
    """``bench copy|index``: one run on --backend, or both backends with --compare-backends."""
    from cxlkv.tools import bench

    if args.compare_backends:
        return _print_comparison(args, bench.compare_backends(run, **kwargs), print_one)
    return _print_result(args, run(backend=args.backend, **kwargs), print_one)


def _print_result(args: argparse.Namespace, result: Any, print_one, con: Any = None) -> int:
    """A benchmark's result: one JSON object with --json, else its table (``print_one``) on
    ``con`` (default: stdout)."""
    if args.json:
        print_json(result)
    else:
        print_one(con or make_console(), result)
    return ExitCode.OK


def _print_comparison(args: argparse.Namespace, result: dict[str, Any], print_one) -> int:
    """``bench copy|index --compare-backends``: both runs, then multihost / coherent per field."""
    if args.json:
        print_json(result)
        return ExitCode.OK
    con = make_console()
    base, other = result["compare_backends"]
    for name in (base, other):
        con.print(f"[bold]backend {name}[/bold]")
        print_one(con, result[name])
    con.print(f"[bold]{other} / {base}[/bold] (same run)")
    for field, ratio in result[f"{other}_vs_{base}"].items():
        con.print(
            f"  {field:<24} {result[base][field]:>14,.2f} {result[other][field]:>14,.2f} {ratio:>8.2f}x"
        )
    return ExitCode.OK


def _require_vllm(command: str) -> None:
    """The vLLM commands start engine processes; without vLLM each would fail only inside them."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CommandError(
            f"{command} needs vLLM, which is not installed in {sys.prefix} "
            "(install it with scripts/setup-vllm.sh)"
        )


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    _require_vllm("bench vllm")
    from cxlkv.tools import bench_vllm

    con = make_console(stderr=args.json)
    summary = bench_vllm.run(
        model=args.model,
        contexts=args.contexts,
        turns=args.turns,
        turn_words=args.turn_words,
        plot=args.plot,
        console=con,
    )
    return _print_result(args, summary, bench_vllm.print_result, con)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """bench serve (issue 16): its code is tools/bench_serve.py."""
    _require_vllm("bench serve")
    from cxlkv.tools import bench_serve

    con = make_console(stderr=args.json)
    summary = bench_serve.run(
        model=args.model,
        instances=args.instances,
        concurrency=args.concurrency,
        configs=args.configs,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
        turns=args.turns,
        turn_len=args.turn_len,
        single_cores=args.single_cores,
        pool_gib=args.pool_gib,
        plot=args.plot,
        console=con,
    )
    if args.json:
        print_json(bench_serve.json_rows(summary))
    else:
        bench_serve.print_result(con, summary)
    return ExitCode.OK


def cmd_bench_pods(args: argparse.Namespace) -> int:
    """bench pods (issue 24): its code is tools/bench_pods.py."""
    _require_vllm("bench pods")
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        raise CommandError(
            f"bench pods needs LMCache 0.5.6, not installed in {sys.prefix} (scripts/setup-peers.sh)"
        )
    from cxlkv.tools import bench_pods
    from cxlkv.tools.remote_store import find_server

    find_server()  # before any engine starts: the remote must exist
    con = make_console(stderr=args.json)
    summary = bench_pods.run(
        model=args.model,
        prompts=args.prompts,
        words=args.words,
        pool_size=args.pool_size,
        on_progress=(lambda m: con.print(f"[dim]{m}[/dim]")),
    )
    if args.json:
        print_json({**summary, "problems": bench_pods.check(summary)})
    else:
        bench_pods.print_result(con, summary)
    return ExitCode.OK if not bench_pods.check(summary) else ExitCode.CHECK_FAILED


def cmd_bench_index(args: argparse.Namespace) -> int:
    from cxlkv.tools import bench

    kwargs = dict(
        procs=args.procs,
        ops=args.ops,
        keys=args.keys,
        samples=args.samples,
        inserts=args.inserts,
        pool_dir=args.pool_dir,
        quiet=args.json,
    )
    return _bench_on_backends(args, bench.bench_index, bench.print_index_result, kwargs)


def cmd_bench_sparse(args: argparse.Namespace) -> int:
    from cxlkv.tools import bench_sparse

    unknown = [f for f in args.formats if f not in bench_sparse.FORMATS]
    if unknown:
        raise CommandError(
            f"bench sparse: unknown row format {unknown[0]!r} (one of {', '.join(bench_sparse.FORMATS)})"
        )
    result = bench_sparse.bench_sparse(
        contexts=args.contexts,
        topk=args.topk,
        layers=args.layers,
        formats=args.formats,
        hit_rates=args.hit_rates,
        steps=args.steps,
        pool_dir=args.pool_dir,
        seed=args.seed,
        quiet=args.json,
        copy_threads=args.copy_threads,
    )
    return _print_result(args, result, bench_sparse.print_result)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    """bench tp (issue 22): its code is tools/bench_tp.py."""
    from cxlkv.tools import bench_tp

    if args.state:  # SSM states (tools/bench_tp_state.py): --heads counts Gated DeltaNet key heads
        from cxlkv.tools import bench_tp_state

        state = bench_tp_state.run(
            layers=args.layers or 4,
            key_heads=args.heads or 16,
            value_heads=2 * (args.heads or 16),
            blocks=args.blocks or 8,
            iters=args.iters,
            pool_dir=args.pool_dir,
        )
        return _print_result(args, state, bench_tp_state.print_result)
    result = bench_tp.run(
        layers=args.layers or 32,
        heads=args.heads or 8,
        hs=args.head_size,
        bs=args.block,
        blocks=args.blocks or 64,
        iters=args.iters,
        copy_threads=args.copy_threads,
        pool_dir=args.pool_dir,
    )
    return _print_result(args, result, bench_tp.print_result)


def cmd_bench_failover(args: argparse.Namespace) -> int:
    from cxlkv.tools import failover

    result = failover.bench_failover(
        args.lease_ms, args.trials, pool_dir=args.pool_dir, seed=args.seed, quiet=args.json
    )
    return _print_result(args, result, failover.print_result)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.vllm:
        _require_vllm("demo --vllm")
        from cxlkv.tools import demo_vllm

        demo_vllm.run(make_console(), repeats=args.repeats)
        return ExitCode.OK
    from cxlkv.tools import demo

    con = make_console(stderr=args.json)
    summary = demo.run_demo(
        pool_path=args.pool, procs=args.procs, seconds=args.seconds, size=args.size, console=con
    )
    if args.json:
        print_json(summary)
    else:
        demo.print_demo_result(con, summary)
    return ExitCode.CHECK_FAILED if summary["verify_errors"] else ExitCode.OK


# ---------------------------------------------------------------------------------------------
# shared-memory RPC: pool ping, bench rpc (cxlkv.tools.rpc)


def cmd_pool_ping(args: argparse.Namespace) -> int:
    from cxlkv.tools import rpc

    replies = rpc.ping(args.path, args.node, args.count, args.timeout_ms)  # PingFailed: exit 1
    rtts = [r["rtt_ns"] for r in replies]
    first = replies[0]
    summary = {
        "node": first["node"],
        "pid": first["pid"],
        "host_id": f"{first['host_id']:016x}",
        "epoch": first["epoch"],
        "count": len(rtts),
        "rtt_ns": rtts,
        "rtt_min_ns": min(rtts),
        "rtt_median_ns": int(statistics.median(rtts)),
    }
    if args.json:
        print(json.dumps(summary))
        return ExitCode.OK
    for i, r in enumerate(replies):
        print(
            f"reply from node {r['node']} (pid {r['pid']}, host {r['host_id']:016x}, "
            f"epoch {r['epoch']}): seq={i + 1} rtt={r['rtt_ns'] / 1000:.1f} us"
        )
    print(
        f"{len(rtts)} answered, rtt min/median {min(rtts) / 1000:.1f}/{statistics.median(rtts) / 1000:.1f} us"
    )
    return ExitCode.OK


def cmd_bench_rpc(args: argparse.Namespace) -> int:
    from cxlkv.tools import rpc

    try:
        res = rpc.bench_rpc(
            args.iterations, args.warmup, args.depth, args.batches, args.backend, not args.no_pin, args.dir
        )
    except RuntimeError as e:
        raise CommandError(f"bench rpc: {e}") from None
    if args.json:
        print(json.dumps(res))
        return ExitCode.OK
    print(
        f"rpc round trips, 64-byte messages, depth 1 and {res['depth']} "
        f"(server cpu {res['server_cpu']}, client cpu {res['client_cpu']})"
    )
    print(f"{'transport':<12}{'p50 ns':>10}{'p99 ns':>10}{'msg/s qd1':>14}{'msg/s deep':>14}")
    for t in (*rpc.TRANSPORTS_CPP, "zmq"):
        if res.get(f"{t}_p50_ns") is None:
            print(f"{t:<12}{'n/a':>10}")
            continue
        print(
            f"{t:<12}{res[f'{t}_p50_ns']:>10.0f}{res[f'{t}_p99_ns']:>10.0f}"
            f"{res[f'{t}_msgs_per_s_qd1']:>14,.0f}{res[f'{t}_msgs_per_s_deep']:>14,.0f}"
        )
    print(
        f"best socket ({res['best_socket']}) p50 / rpc p50 = {res['best_socket_p50_over_rpc_p50']:.1f}x; "
        f"rpc p50 / line floor p50 = {res['rpc_p50_over_line_p50']:.2f}x"
    )
    print(f"zmq: {res['zmq_note']}")
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------
# sim: the multi-host proof (cxlkv.tools.sim, the cxlkv-sim emulator)


def cmd_sim(args: argparse.Namespace) -> int:
    from cxlkv.tools import sim

    r = sim.run(
        args.hosts,
        args.seconds,
        args.seed,
        args.brk,
        args.lease_ms,
        args.backend,
        not args.no_crashes,
        not args.no_pauses,
        args.fault,
    )
    expect_clean = args.brk is None and args.backend == "multihost"
    ok = (r["violations"] == 0) if expect_clean else (r["violations"] > 0)
    if args.json:
        print(json.dumps(r))
    else:
        kinds = ", ".join(f"{k} {v}" for k, v in r["violation_kinds"].items() if v) or "none"
        print(
            f"{r['hosts']} hosts, {r['seconds']} s, seed {r['seed']}, backend {r['backend']}, "
            f"break {r['break'] or '-'}"
        )
        print(
            f"ops {r['ops']}  verified reads {r['verified_reads']}  crashes {r['crashes']}  "
            f"pauses {r['pauses']}  fenced {r['fenced']}  lock skips {r['lock_skips']}"
        )
        print(f"violations {r['violations']} ({kinds})")
        for n in r.get("notes", [])[:6]:
            print(f"  {n}")
    if not ok:
        what = "violations found" if expect_clean else "the negative control was NOT caught"
        raise CommandError(f"sim: {what}", exit_code=ExitCode.CHECK_FAILED)
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------
# roi


def _roi_inputs(args: argparse.Namespace, notes: list[str]):
    from cxlkv.tools import roi

    cfg = roi.load_config(args.model_config) if args.model_config else None
    if cfg is not None and args.context_tokens is None:
        raise CommandError("--model-config needs --context-tokens (the average prompt length)")
    r, h, gbps = args.new_prompt_ratio, args.multi_round_ratio, args.load_gbps
    if args.from_bench:
        b = roi.from_bench(args.from_bench, config=args.bench_config, dataset=args.bench_dataset)
        notes.append(
            f"from {args.from_bench}: {args.bench_config} at concurrency {b['concurrency']}"
            + (f" on {b['dataset']}" if b["dataset"] else "")
            + f" had a "
            f"prefix hit rate of {b['hit_rate']:.1%}; read as h = 1, r = 1 - hit rate (every "
            "request loads its cached share; a full miss paying no load is not modelled)"
        )
        r = 1.0 - b["hit_rate"] if r is None else r
        h = 1.0 if h is None else h
        gbps = b["load_gbps"] if gbps is None else gbps
    if args.prefill_tflop is not None:
        c0 = args.prefill_tflop * roi.TERA
    elif cfg is not None:
        params = roi.model_params(cfg)
        c0 = 2.0 * params * args.context_tokens
        notes.append(
            f"C0 = 2 x {params / 1e9:.3g} G parameters x {args.context_tokens} tokens = {c0 / roi.TERA:.3g} TFLOP"
        )
    else:
        raise CommandError("give --prefill-tflop, or --model-config with --context-tokens")
    missing = [n for n, v in (("--new-prompt-ratio", r), ("--multi-round-ratio", h)) if v is None]
    if missing:
        raise CommandError(f"give {' and '.join(missing)} (or --from-bench)")
    load_s = args.load_s
    if load_s is None:
        if cfg is None or gbps is None:
            raise CommandError(
                "give --load-s, or --model-config with --context-tokens and a load bandwidth "
                "(--load-gbps, or a --from-bench file that recorded one)"
            )
        kv = roi.kv_bytes_per_token(cfg, args.kv_dtype) * (1.0 - r) * args.context_tokens
        load_s = kv / (gbps * 1e9)
        notes.append(f"T_load = {kv / 1e6:.3g} MB of KV at {gbps:g} GB/s = {load_s * 1e3:.3g} ms")
    return roi.RoiInputs(
        gpu_flops=args.gpu_tflops * roi.TERA,
        prefill_flop=c0,
        new_prompt_ratio=r,
        slo_s=args.slo_s,
        load_s=load_s,
        multi_round_ratio=h,
        rps=args.rps,
    )


def cmd_roi(args: argparse.Namespace) -> int:
    from cxlkv.tools import roi

    notes: list[str] = []
    result = roi.compute(_roi_inputs(args, notes))
    result["notes"] = notes
    if args.json:
        print_json(result)
    else:
        roi.print_result(make_console(), result)
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------
# events, query: what routers read (services/events.py, services/query.py)


def cmd_events(args: argparse.Namespace) -> int:
    from cxlkv.services import events

    pool = cxlkv.Pool.open(args.path)  # a missing or bad pool: an error now, exit 2; then run() owns it
    try:
        publisher = events.ReplayPublisher(args.endpoint, args.replay_endpoint or None, buffer=args.buffer)
    except BaseException:
        pool.close()
        raise
    try:
        print(
            f"cxlkv events: pool {pool.path} ({events.pool_medium(pool)}): PUB {publisher.endpoint}, "
            f"replay {publisher.replay_endpoint or '-'}, every {args.interval} s",
            file=sys.stderr,
            flush=True,
        )

        def show(seq: int, topic: str, batch: list) -> None:
            kinds = ", ".join(f"{e['type']} x{len(e.get('block_hashes', ()))}" for e in batch)
            print(f"{seq} {topic}: {kinds}", flush=True)

        r = events.run(
            pool,
            publisher,
            interval_s=args.interval,
            topic=args.topic,
            namespace=args.namespace,
            record_wait_s=args.record_wait,
            duration_s=args.duration,
            on_batch=show if args.verbose else None,
            reopen=lambda: cxlkv.Pool.open(args.path),
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    finally:
        publisher.close()
    print(json.dumps(r), flush=True)
    return ExitCode.OK


def cmd_query(args: argparse.Namespace) -> int:
    from cxlkv.services import query

    with cxlkv.Pool.open(args.path) as pool:
        if args.serve is not None:
            server = query.make_server(pool, args.host, args.serve)
            print(
                f"cxlkv query: POST http://{args.host}:{server.server_port}/query (pool {pool.path})",
                file=sys.stderr,
                flush=True,
            )
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
            finally:
                server.server_close()
            return ExitCode.OK
        tokens = list(args.tokens)
        if args.tokens_json is not None:
            text = sys.stdin.read() if args.tokens_json == "-" else args.tokens_json
            try:
                tokens += json.loads(text)
            except ValueError as e:
                raise CommandError(f"--tokens-json: not JSON: {e}") from None
        r = query.query(pool, tokens, model=args.namespace, lora_id=args.lora_id, cache_salt=args.cache_salt)
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['matched_tokens']} of {r['total_tokens']} tokens ({r['matched_blocks']} blocks of "
            f"{r['block_size']}) in namespace {r['namespace']}"
        )
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------
# observe: exporter, top (cxlkv.services.exporter, cxlkv.services.top)


def cmd_exporter(args: argparse.Namespace) -> int:
    from cxlkv.services import exporter

    try:
        exporter.serve(args.path, args.port, args.addr, args.allow_foreign_owner)
    except ImportError as e:
        raise CommandError(
            f"exporter needs prometheus_client ({e}); install it with: pip install 'cxlkv[metrics]'"
        ) from None
    return ExitCode.OK


def cmd_top(args: argparse.Namespace) -> int:
    from cxlkv.services import top

    con = make_console()
    if args.once:
        snap = top.once(args.path, con, args.interval)
        return ExitCode.OK if snap.up else ExitCode.ERROR
    top.live(args.path, con, args.interval)
    return ExitCode.OK
