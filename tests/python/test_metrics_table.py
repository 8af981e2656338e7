"""One counter table: the core's list (format.h's CXLKV_COUNTERS, bound as _core.counter_info())
is what Pool.stats() counts, what the exporter exports (series and help) and what
docs/METRICS.md's table says, in the same order and words."""

from __future__ import annotations

import os
import re

import pytest

import cxlkv
from cxlkv import _core
from cxlkv.services import exporter

METRICS_MD = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "METRICS.md")


def _doc_counter_rows() -> list[tuple[str, str]]:
    text = open(METRICS_MD).read()
    pool_section = text.split("## Pool exporter", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(cxlkv_\w+)_total` \| counter \| (.*) \|$", pool_section, re.M)


def test_metrics_md_counter_rows_are_the_core_table():
    table = exporter.counter_table()
    assert len(table) == len(_core.counter_info()) >= 16
    rows = _doc_counter_rows()
    assert [r[0] for r in rows] == [series for _, series, _ in table], "docs/METRICS.md counter rows"
    for (series, cell), (_, _, help_text) in zip(rows, table, strict=True):
        assert cell == help_text or cell.startswith(help_text + " "), f"{series}: {cell!r} != {help_text!r}"


def test_stats_count_exactly_the_table(make_pool):
    stats = make_pool().stats()
    names = [n for n, _ in _core.counter_info()]
    assert all(isinstance(stats[n], int) for n in names)
    assert len(set(names)) == len(names)


def test_exporter_exports_every_counter_with_its_meaning(make_pool, pool_path):
    pytest.importorskip("prometheus_client")
    pool = make_pool()
    ns = pool.namespace(
        cxlkv.KVLayout("m/metrics", num_layers=1, num_kv_heads=1, head_size=8, tokens_per_block=4)
    )
    ns.put(b"k" * 32, b"v" * 64)
    families = {f.name: f for f in exporter.PoolCollector(pool_path).collect() if f.type == "counter"}
    for key, series, help_text in exporter.counter_table():
        f = families.get(series)
        assert f is not None, f"{series} not exported"
        assert f.documentation.startswith(help_text)
        assert f.samples[0].value == pool.stats()[key] or key in ("hits", "misses")
    assert families["cxlkv_puts"].samples[0].value >= 1
