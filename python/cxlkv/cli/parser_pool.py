"""``cxlkv pool ...``: create, info, stats, check, quota, reap, ping, destroy."""

from __future__ import annotations

from typing import Any

import cxlkv

from .commands import (
    cmd_pool_check,
    cmd_pool_create,
    cmd_pool_destroy,
    cmd_pool_info,
    cmd_pool_ping,
    cmd_pool_reap,
    cmd_pool_stats,
)
from .parser_types import (
    _FOREIGN_HELP,
    _NODE_HELP,
    _PATH_HELP,
    _backend_help,
    _Parser,
    _pool_path_arg,
    _pos_float,
    _pos_int,
    _range,
    _ranged_int,
    _size_arg,
    _stripe_size_arg,
)
from .quota import cmd_pool_quota, fraction_arg


def add_pool(sub: Any, default_pool: str, create: dict) -> None:
    """Adds the ``pool`` command group to the subcommands ``sub``; ``default_pool``: the pool a command opens when
    none is named."""
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
        "--intent-permille",
        type=_ranged_int(create["intent_permille"]),
        default=None,
        help="block-less intents (coalescing markers) one node may hold at once, in thousandths of "
        f"the index slots, {_range(create['intent_permille'])} (default "
        f"{create['intent_permille']['default']})",
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

    q = psub.add_parser(
        "quota",
        help="show, set or clear the pool bytes a tenant or a namespace (a model) may hold",
        description="Without a limit: show the quotas (and each subject's usage). With --max-bytes or "
        "--max-fraction (the stricter applies), or --clear: set that limit of one tenant or namespace. "
        "A put over its quota evicts the subject's own oldest blocks, else fails (puts_over_quota).",
    )
    _pool_path_arg(q, default_pool)
    who = q.add_mutually_exclusive_group()
    who.add_argument("--namespace", metavar="N", help="a namespace (model), by name or id")
    who.add_argument("--tenant", metavar="T", help="a tenant: the label engines are configured with")
    q.add_argument("--max-bytes", type=_size_arg, metavar="SIZE", help="limit in bytes (e.g. 2GiB)")
    q.add_argument("--max-fraction", type=fraction_arg, metavar="F", help="limit as a fraction of the pool")
    q.add_argument("--clear", action="store_true", help="remove the limit (usage is still counted)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_pool_quota)

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
