"""``cxlkv pool quota``: show, set or clear the pool-byte limit of a tenant or a namespace."""

from __future__ import annotations

import argparse

import cxlkv
from cxlkv.errors import CommandError, ExitCode
from cxlkv.sizes import format_size

from .render import make_console, print_json, render_rows


def fraction_arg(text: str) -> float:
    """A fraction of the pool in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not in (0, 1]")
    return v


def quota_rows(quotas: list[dict]) -> list[dict]:
    """The quota table as shown to a person (``pool quota``, ``pool info``)."""
    rows = []
    for q in quotas:
        if not q["readable"]:
            rows.append({"row": q["row"], "subject": "(unreadable: `pool check`)", "limit": "-", "used": "-"})
            continue
        subject = (
            f"tenant {q['tenant']}" if q["kind"] == "tenant" else f"namespace {q['namespace'] or q['ns_id']}"
        )
        limit = format_size(q["limit_bytes"]) if q["limit_bytes"] else "none"
        if q["max_fraction"]:
            limit += f" ({q['max_fraction']:.1%} of the pool)"
        used = format_size(q["usage_bytes"])
        if q["limit_bytes"]:
            used += f" ({q['usage_bytes'] / q['limit_bytes']:.0%})"
        rows.append({"row": q["row"], "subject": subject, "limit": limit, "used": used})
    return rows


def cmd_pool_quota(args: argparse.Namespace) -> int:
    changing = args.max_bytes is not None or args.max_fraction is not None or args.clear
    if changing and (args.namespace is None) == (args.tenant is None):
        raise CommandError("name exactly one of --namespace and --tenant")
    if changing:
        with cxlkv.Pool.open(args.path) as pool:
            pool.set_quota(
                namespace=args.namespace,
                tenant=args.tenant,
                max_bytes=0 if args.clear else args.max_bytes or 0,
                max_fraction=0.0 if args.clear else args.max_fraction or 0.0,
            )
            quotas = pool.quotas()
    else:
        with cxlkv.Pool.open(args.path, read_only=True) as pool:
            quotas = pool.quotas()
    if args.namespace is not None or args.tenant is not None:
        quotas = [
            q
            for q in quotas
            if (args.tenant is not None and q["tenant"] == args.tenant)
            or (args.namespace is not None and args.namespace in (q.get("namespace"), str(q["ns_id"])))
        ]
    if args.json:
        print_json({"quotas": quotas})
    else:
        render_rows(make_console(), "quotas", quota_rows(quotas))
    return ExitCode.OK
