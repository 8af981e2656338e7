"""KVLayout.source: provenance text stored beside a namespace's identity, shown by
``pool.namespaces()`` and ``cxlkv pool info``, and never part of the fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import cxlkv
from conftest import small_layout

SOURCE = "weights sha256-sampled of /models/x (3 files, 269 MB)"


def _listed(pool: cxlkv.Pool, name: str) -> dict:
    [entry] = [n for n in pool.namespaces() if n["name"] == name]
    return entry


def test_source_is_stored_and_listed(make_pool):
    pool = make_pool()
    pool.namespace(small_layout(source=SOURCE), name="with-source")
    pool.namespace(small_layout(model_id="test/other"), name="without-source")
    assert _listed(pool, "with-source")["source"] == SOURCE
    assert _listed(pool, "without-source")["source"] == ""


def test_source_is_not_part_of_the_identity(make_pool, pool_path):
    """Another route to the same identity opens the same namespace; the creator's source stays."""
    pool = make_pool()
    first = pool.namespace(small_layout(source=SOURCE), name="m")
    again = pool.namespace(small_layout(source="model_id override by the operator"), name="m")
    bare = pool.namespace(small_layout(), name="m")
    assert first.id == again.id == bare.id
    assert small_layout(source="a") == small_layout(source="b")
    with cxlkv.Pool.open(pool_path) as other:
        assert other.namespace(small_layout(source="x"), name="m").id == first.id
        assert _listed(other, "m")["source"] == SOURCE


def test_source_longest_accepted_and_too_long_rejected(make_pool):
    pool = make_pool()
    longest = "s" * 255
    pool.namespace(small_layout(source=longest), name="long")
    assert _listed(pool, "long")["source"] == longest
    with pytest.raises(ValueError, match="source must be at most 255 bytes"):
        pool.namespace(small_layout(source="s" * 256), name="too-long")
    assert [n["name"] for n in pool.namespaces()] == ["long"]


@pytest.mark.parametrize("bad", ["nul\x00inside", "esc\x1b[2J", "new\nline", "del\x7f"])
def test_source_rejects_nul_and_control_characters(make_pool, bad):
    pool = make_pool()
    with pytest.raises(ValueError, match="source must not contain NUL or control characters"):
        pool.namespace(small_layout(source=bad), name="bad")
    assert pool.namespaces() == []


def test_pool_info_shows_source(make_pool, pool_path):
    pool = make_pool()
    pool.namespace(small_layout(source=SOURCE), name="m")
    r = subprocess.run(
        [sys.executable, "-m", "cxlkv", "pool", "info", "--json", pool_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    [ns] = json.loads(r.stdout)["namespaces"]
    assert ns["source"] == SOURCE
    r = subprocess.run(
        [sys.executable, "-m", "cxlkv", "pool", "info", pool_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "400", "PATH": ""},
    )
    assert r.returncode == 0, r.stderr
    assert SOURCE in r.stdout
