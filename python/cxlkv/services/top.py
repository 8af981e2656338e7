"""``cxlkv top``: a live terminal view of a pool (rich): use, hit rate, traffic per second,
namespaces, quotas, nodes and their leases. ``q`` quits; ``--once`` prints one frame and exits.

Each refresh is one observer read (pool_view.read_pool). Rates are the difference of two reads
over the time between them; a pool recreated at the same path (another uuid) starts the rates
afresh, and an absent pool is shown as such until it comes back.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator

from cxlkv.services.pool_view import PoolSnapshot, lease_missed, printable, quota_subject, read_pool
from cxlkv.sizes import format_size

# (stats key, column title, is bytes): the traffic shown per second.
RATES = (
    ("hits", "hits", False),
    ("misses", "misses", False),
    ("puts", "puts", False),
    ("evictions", "evicted", False),
    ("bytes_loaded", "loaded", True),
    ("bytes_stored", "stored", True),
)


def _esc(text: object) -> str:
    """Pool strings are written by any attached process: no control characters, no markup."""
    from rich.markup import escape

    return escape(printable(str(text)))


def rates(prev: PoolSnapshot | None, cur: PoolSnapshot) -> dict[str, float] | None:
    """Per-second deltas of the counters between two reads of the same pool; None when there is
    no earlier read of this pool (first frame, or the pool was recreated: another uuid)."""
    if prev is None or not prev.up or not cur.up or prev.info.get("uuid") != cur.info.get("uuid"):
        return None
    dt = cur.taken - prev.taken
    if dt <= 0:
        return None
    out = {k: max(0, cur.stats.get(k, 0) - prev.stats.get(k, 0)) / dt for k, _, _ in RATES}
    lookups = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / lookups if lookups else float("nan")
    return out


def _bar(frac: float, width: int = 20) -> str:
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    return "[green]" + "█" * full + "[/green]" + "[dim]" + "░" * (width - full) + "[/dim]"


def render(prev: PoolSnapshot | None, cur: PoolSnapshot):
    """One frame: a rich renderable."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S")
    if not cur.up:
        return Group(
            Text.from_markup(f"[bold]cxlkv top[/bold]  {_esc(cur.path)}  {stamp}"),
            Text.from_markup(f"[red]pool not readable[/red]: {_esc(cur.error)}"),
            Text.from_markup("[dim]retrying every refresh; q quits[/dim]"),
        )
    i, s = cur.info, cur.stats
    r = rates(prev, cur)
    head = Text.from_markup(
        f"[bold]cxlkv top[/bold]  {_esc(cur.path)}  {format_size(int(i.get('pool_bytes', 0)))}  "
        f"backend {_esc(i.get('backend', '?'))}  uuid {_esc(str(i.get('uuid', ''))[:8])}  {stamp}"
    )
    cap, used = int(s.get("capacity_blocks", 0)), int(s.get("used_blocks", 0))
    chunks = int(s.get("free_chunks", 0)) + int(s.get("active_chunks", 0))
    use = Table.grid(padding=(0, 2))
    use.add_row(
        "blocks",
        _bar(used / cap if cap else 0.0),
        f"{used:,} of {cap:,} used",
        f"chunks {s.get('active_chunks', 0)}/{chunks} active",
    )
    for d in cur.devices:
        dcap, dused = int(d.get("capacity_bytes", 0)), int(d.get("used_bytes", 0))
        use.add_row(
            f"device {d.get('index', 0)}",
            _bar(dused / dcap if dcap else 0.0),
            f"{format_size(dused)} of {format_size(dcap)}",
            _esc(d.get("path", "")),
        )
    traffic = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title_style="bold")
    traffic.add_column("hit rate", justify="right")
    for _, title, _ in RATES:
        traffic.add_column(title, justify="right")
    if r is None:
        row = ["-"] + ["-"] * len(RATES)
    else:
        hr = r["hit_rate"]
        row = ["-" if hr != hr else f"{hr:.1%}"]
        row += [format_size(int(r[k])) if is_bytes else f"{r[k]:,.0f}" for k, _, is_bytes in RATES]
    traffic.add_row(*row)
    traffic.caption = f"per second over the last {cur.taken - prev.taken:.1f} s" if r and prev else ""
    traffic.title = f"traffic (hit rate since creation {s.get('hit_rate', 0.0):.1%})"
    parts = [head, use, traffic, _namespaces(cur)]
    if cur.quotas:
        parts.append(_quotas(cur))
    return Group(*parts, _nodes(cur), Text.from_markup("[dim]q quits[/dim]"))


def _namespaces(cur: PoolSnapshot):
    from rich import box
    from rich.table import Table

    t = Table(
        box=box.SIMPLE_HEAD, show_edge=False, title="namespaces", title_justify="left", title_style="bold"
    )
    for c in ("id", "name", "used / carved", "layout", "block", "derived from"):
        t.add_column(c, overflow="fold")
    for n in cur.namespaces:
        layout = (
            f"{n.get('kind')} {n.get('dtype')} L{n.get('num_layers')} H{n.get('num_kv_heads')} "
            f"D{n.get('head_size')} T{n.get('tokens_per_block')} h/e{n.get('heads_per_entry') or 'all'}"
        )
        t.add_row(
            str(n.get("id")),
            _esc(n.get("name", "")),
            f"{format_size(int(n.get('used_bytes', 0)))} / {format_size(int(n.get('capacity_bytes', 0)))}",
            _esc(layout),
            format_size(int(n.get("block_bytes") or 0)),
            _esc(n.get("source") or "-"),
        )
    if not cur.namespaces:
        t.add_row("-", "none", "", "", "", "")
    return t


def _quotas(cur: PoolSnapshot):
    from rich import box
    from rich.table import Table

    s = cur.stats
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, title="quotas", title_justify="left", title_style="bold")
    for c in ("kind", "subject", "used / limit", ""):
        t.add_column(c, overflow="fold")
    for q in cur.quotas:
        kind, subject = quota_subject(q)
        limit, used = int(q.get("limit_bytes") or 0), int(q.get("usage_bytes") or 0)
        frac = used / limit if limit else 0.0
        t.add_row(
            kind,
            _esc(subject),
            f"{format_size(used)} / {format_size(limit) if limit else 'none'}",
            _bar(min(frac, 1.0)) if limit else "",
        )
    t.caption = f"quota evictions {s.get('quota_evictions', 0):,}, puts refused over quota {s.get('puts_over_quota', 0):,}"
    return t


def _nodes(cur: PoolSnapshot):
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, title="nodes", title_justify="left", title_style="bold")
    for c in ("node", "pid", "verdict", "judged by", "silent / lease", "evidence"):
        t.add_column(c, overflow="fold")
    colour = {"alive": "green", "dead": "red"}
    for n in cur.nodes:
        verdict = str(n.get("verdict", "?"))
        lease = f"{int(n.get('silent_ms') or 0) / 1000:.1f}s / {int(n.get('lease_ms') or 0) / 1000:.0f}s"
        if lease_missed(n):
            lease = f"[red]{lease} missed[/red]"
        t.add_row(
            str(n.get("node")),
            str(n.get("pid")),
            f"[{colour.get(verdict, 'yellow')}]{_esc(verdict)}[/]",
            _esc(n.get("judged_by", "")),
            lease,
            _esc(n.get("evidence", "")),
        )
    if not cur.nodes:
        t.add_row("-", "", "none attached", "", "", "")
    return t


def once(path: str, console, interval: float = 1.0) -> PoolSnapshot:
    """One frame with rates over ``interval`` seconds (two reads)."""
    first = read_pool(path)
    time.sleep(interval)
    cur = read_pool(path)
    console.print(render(first, cur))
    return cur


@contextlib.contextmanager
def _keys() -> Iterator:
    """Keys typed on the terminal, one at a time, without echo (nothing when stdin is no tty)."""
    if not sys.stdin.isatty():
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def live(path: str, console, interval: float = 1.0) -> None:
    """Refresh every ``interval`` seconds until ``q`` (or Ctrl-C)."""
    from rich.live import Live

    prev = read_pool(path)
    with _keys() as key, Live(render(None, prev), console=console, screen=False, auto_refresh=False) as view:
        while True:
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                if key(left).lower() == "q":
                    return
            cur = read_pool(path)
            view.update(render(prev, cur), refresh=True)
            prev = cur
