"""How the CLI shows results: one JSON object (``--json``) or rich tables for a person.

Every string read from a pool is shown through :func:`escape`, which neutralizes terminal control
characters (a co-tenant writes those strings).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from cxlkv.services.pool_view import printable
from cxlkv.sizes import format_size

__all__ = [
    "escape",
    "make_console",
    "no_controls",
    "print_json",
    "render_internals",
    "render_mapping",
    "render_namespaces",
    "render_pool_overview",
    "render_rows",
]


def make_console(stderr: bool = False):
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
        return escape(", ".join(str(v) for v in value)) if value else "-"
    return escape(str(value))


def no_controls(text: str) -> str:
    """Strings read from a pool are written by any attached process; a control character
    (ESC sequences, CR, C1 controls) would drive the operator's terminal. Show them as \\xNN."""
    return printable(text)


def escape(text: str) -> str:
    """``text`` safe to print as rich markup: control characters shown as \\xNN, markup escaped."""
    from rich.markup import escape as markup_escape

    return markup_escape(no_controls(text))


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
        console.print(f"[bold]{escape(title)}[/bold]")
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
        console.print(f"[bold]{escape(title)}[/bold]: none")
        return
    cols: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in cols and _is_scalar(v):
                cols.append(k)
    console.print(f"[bold]{escape(title)}[/bold]")
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

    t = Table(
        title="namespaces",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for c in (
        "id",
        "name",
        "model",
        "used / carved",
        "layout",
        "heads/entry",
        "block",
        "blocks/chunk",
        "derived from",
    ):
        t.add_column(c, justify="right" if c in ("id", "block", "blocks/chunk") else "left", overflow="fold")
    for n in namespaces:
        layout = (
            f"{n.get('kind', '?')} {n.get('dtype', '?')} L{n.get('num_layers', '?')} "
            f"H{n.get('num_kv_heads', '?')} D{n.get('head_size', '?')} T{n.get('tokens_per_block', '?')}"
        )
        bb = n.get("block_bytes")
        t.add_row(
            str(n.get("id", "")),
            escape(str(n.get("name", ""))),
            escape(str(n.get("model_id", ""))),
            _ns_use(n),
            layout,
            str(n.get("heads_per_entry", 0) or "all"),
            format_size(bb) if isinstance(bb, int) else "-",
            str(n.get("blocks_per_chunk", "-")),
            escape(str(n.get("source") or "-")),
        )
    console.print(t)


def _ns_use(n: dict) -> str:
    if "used_bytes" not in n:
        return "-"
    return f"{format_size(int(n['used_bytes']))} / {format_size(int(n['capacity_bytes']))}"


def _numeric_col(rows: list[dict], c: str) -> bool:
    vals = [r.get(c) for r in rows if r.get(c) is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


# ---------------------------------------------------------------------------------------------
# `pool create` / `pool info`: what an operator asks first; the format's internals with --verbose

# Header fields shown by default (in this order, by the overview); every other field of info()
# (offsets, inode numbers, checksum position, feature words, ...) is shown with --verbose only.
OVERVIEW_KEYS = (
    "path",
    "uuid",
    "format_version",
    "created_unix_ns",
    "pool_bytes",
    "backend",
    "chunk_bytes",
    "chunk_count",
    "stripe_bytes",
    "max_nodes",
    "max_namespaces",
    "index_slots",
    "pin_slots",
    "lease_ms",
    "lock_hosts",
    "intent_cap",
)


def render_pool_overview(console, title: str, info: dict, devices: list[dict], stats: dict | None) -> None:
    """Capacity and use, backend, limits: one line each (``pool info`` / ``pool create``)."""
    import datetime

    from rich.table import Table

    created = info.get("created_unix_ns") or 0
    when = datetime.datetime.fromtimestamp(created / 1e9).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    console.print(
        f"[bold]{escape(title)}[/bold]  {format_size(int(info.get('pool_bytes', 0)))}, "
        f"backend [cyan]{escape(str(info.get('backend', '?')))}[/cyan], format "
        f"{escape(str(info.get('format_version', '?')))}, created {when}"
    )
    t = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 2))
    t.add_column(style="cyan", no_wrap=True)
    t.add_column(overflow="fold")
    carved = sum(int(d.get("capacity_bytes", 0)) for d in devices)
    used = sum(int(d.get("used_bytes", 0)) for d in devices)
    chunks, chunk = int(info.get("chunk_count", 0)), int(info.get("chunk_bytes", 0))
    line = f"{format_size(chunks * chunk)} for KV in {chunks:,} chunks of {format_size(chunk)}"
    if stats is not None:
        active, cap = int(stats.get("active_chunks", 0)), int(stats.get("capacity_blocks", 0))
        line += f"; {active:,} carved into {cap:,} blocks"
    t.add_row("capacity", line)
    use = f"{format_size(used)} in use of {format_size(carved)} carved"
    if stats is not None:
        use += f", blocks: {int(stats.get('used_blocks', 0)):,}"
        if chunks:
            use += f"; {int(stats.get('free_chunks', 0)):,} chunks never used"
    t.add_row("use", use)
    if stats is not None and (stats.get("hits") or stats.get("misses")):
        t.add_row(
            "traffic",
            f"hit rate {float(stats.get('hit_rate', 0.0)):.1%} ({int(stats['hits']):,} hits, "
            f"{int(stats['misses']):,} misses), {int(stats.get('puts', 0)):,} puts, "
            f"{int(stats.get('evictions', 0)):,} evictions",
        )
    if int(info.get("stripe_bytes") or 0):
        t.add_row("striping", f"{len(devices)} devices, {format_size(int(info['stripe_bytes']))} stripes")
    limits = (
        f"{info.get('max_nodes')} nodes, {info.get('max_namespaces')} namespaces, "
        f"{int(info.get('index_slots', 0)):,} index slots, {int(info.get('pin_slots', 0)):,} pins per node, "
        f"lease {int(info.get('lease_ms', 0)) / 1000:g} s, "
        f"{int(info.get('intent_cap', 0)):,} intents per node"
    )
    if int(info.get("lock_hosts") or 0):
        limits += f", {info['lock_hosts']} hosts (lock area)"
    t.add_row("limits", limits)
    t.add_row("uuid", escape(str(info.get("uuid", ""))))
    console.print(t)


def render_internals(console, info: dict) -> None:
    """The header fields the overview leaves out: offsets, inode numbers, checksum position."""
    render_mapping(console, "internals", {k: v for k, v in info.items() if k not in OVERVIEW_KEYS})
