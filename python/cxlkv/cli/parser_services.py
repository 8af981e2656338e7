"""``cxlkv events``, ``query``, ``exporter`` and ``top``: the commands of the operator services."""

from __future__ import annotations

from typing import Any

from .commands import (
    cmd_events,
    cmd_exporter,
    cmd_query,
    cmd_top,
)
from .parser_types import (
    _FOREIGN_HELP,
    _pool_path_arg,
    _pos_float,
    _pos_int,
)


def add_services(sub: Any, default_pool: str) -> None:
    """Adds events, query, exporter and top to the subcommands ``sub``; ``default_pool``: the pool a command opens when
    none is named."""
    # events, query (routers: services/events.py, services/query.py) ----------------------------------
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
