"""One dtype table, in the core: every alias of a dtype names the same bytes, so it opens the same
namespace; an unknown name is a ValueError listing the allowed ones. Also the other name tables
(backend, layout kind) and the layout field list, which the binding reads from the core."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cxlkv
import cxlkv_testutil as tu
from cxlkv import _core

# Each group is one dtype (issue 7: "every alias of a type gives the same fingerprint").
ALIAS_GROUPS = {
    "bf16": ["bf16", "bfloat16", "torch.bfloat16", "BF16"],
    "fp16": ["fp16", "float16", "half", "torch.float16", "torch.half"],
    "fp32": ["fp32", "float32", "float", "torch.float32", "torch.float"],
    "fp8_e4m3": ["fp8", "fp8_e4m3", "float8_e4m3fn", "torch.float8_e4m3fn", "fp8_inc"],
    "fp8_e5m2": ["fp8_e5m2", "float8_e5m2", "torch.float8_e5m2"],
    "int8": ["int8", "torch.int8"],
    "uint8": ["uint8", "torch.uint8"],
}


def layout(dtype, **kw) -> cxlkv.KVLayout:
    args = dict(model_id="test/dtypes", num_layers=2, num_kv_heads=2, head_size=16, tokens_per_block=4)
    args.update(kw)
    return cxlkv.KVLayout(dtype=dtype, **args)


def test_table_comes_from_the_core():
    table = cxlkv.dtypes()
    assert list(table) == [d["name"] for d in _core.dtypes()]
    for canonical, aliases in ALIAS_GROUPS.items():
        assert canonical in table
        listed = {canonical, *table[canonical]["aliases"]}
        assert {a.lower() for a in aliases} <= listed
    assert table["bf16"]["bytes"] == 2 and table["fp32"]["bytes"] == 4 and table["fp8_e4m3"]["bytes"] == 1
    assert "DTYPE_BYTES" not in vars(cxlkv)  # no second table in Python


@pytest.mark.parametrize("canonical", sorted(ALIAS_GROUPS))
def test_every_alias_opens_the_same_namespace(make_pool, pool_path, canonical):
    pool = make_pool()
    aliases = ALIAS_GROUPS[canonical]
    first = pool.namespace(layout(aliases[0]), name="ns")
    for alias in aliases:
        lay = layout(alias)
        assert lay.dtype == canonical
        assert lay == layout(canonical)
        assert pool.namespace(lay, name="ns").id == first.id
    # in another process too (a fresh attachment, no Python-side cache)
    with cxlkv.Pool.open(pool_path) as other:
        for alias in aliases:
            assert other.namespace(layout(alias), name="ns").id == first.id
    [listed] = pool.namespaces()
    assert listed["dtype"] == canonical


def test_aliases_of_different_dtypes_are_different_namespaces(make_pool):
    pool = make_pool()
    pool.namespace(layout("bf16", block_bytes=4096), name="ns")
    with pytest.raises(cxlkv.LayoutMismatchError, match="dtype fp16 != bf16"):
        pool.namespace(layout("half", block_bytes=4096), name="ns")
    with pytest.raises(cxlkv.LayoutMismatchError, match="dtype fp8_e5m2 != bf16"):
        pool.namespace(layout("float8_e5m2", block_bytes=4096), name="ns")
    e4m3 = pool.namespace(layout("fp8", block_bytes=4096), name="e4m3")
    assert pool.namespace(layout("float8_e5m2", block_bytes=4096), name="e5m2").id != e4m3.id


def test_dtype_objects_resolve_through_their_str():
    assert cxlkv.resolve_dtype(np.dtype("float16")) == "fp16"
    assert cxlkv.resolve_dtype(np.dtype("uint8")) == "uint8"
    assert layout(np.dtype("float32")).dtype == "fp32"
    assert cxlkv.dtype_bytes("torch.bfloat16") == 2


def test_torch_dtypes_resolve():
    torch = pytest.importorskip("torch")
    assert cxlkv.resolve_dtype(torch.bfloat16) == "bf16"
    assert cxlkv.resolve_dtype(torch.float8_e4m3fn) == "fp8_e4m3"
    assert cxlkv.resolve_dtype(torch.float8_e5m2) == "fp8_e5m2"
    assert cxlkv.resolve_dtype(torch.float16) == "fp16"


@pytest.mark.parametrize(
    "bad", ["bfloat", "float64", "", "fp8_e4m3 ", "bf16\x00", "torch.complex64", "x" * 300]
)
def test_unknown_dtype_is_a_value_error_naming_the_allowed_ones(bad):
    with pytest.raises(ValueError) as ei:
        layout(bad)
    msg = str(ei.value)
    assert msg.startswith("unknown dtype '")
    assert "\x00" not in msg and len(msg) < 1000
    for canonical in ALIAS_GROUPS:
        assert canonical in msg
    with pytest.raises(ValueError, match="unknown dtype"):
        cxlkv.resolve_dtype(bad)


def test_kind_and_backend_names_come_from_the_core(make_pool):
    assert _core.layout_kinds() == ["dense", "mla", "opaque"]
    assert _core.backends() == ["coherent", "flush", "multihost"]  # the emulator is not one: test-only
    assert layout("bf16", kind="MLA").kind == "mla"
    with pytest.raises(ValueError, match="unknown layout kind 'sparse'; allowed: dense, mla, opaque"):
        layout("bf16", kind="sparse")
    with pytest.raises(ValueError, match="unknown backend 'cxl'; allowed: coherent, flush, multihost"):
        make_pool(backend="cxl")


def test_kvlayout_fields_are_the_core_field_list():
    """The core's field list (format.h) is the one list: every KVLayout attribute but model_id and
    source is one of its fields (nothing Python-only stays outside the fingerprint). A core field
    KVLayout lacks takes its default until the dataclass exposes it."""
    core = [f["name"] for f in _core.layout_fields()]
    py = {f.name for f in dataclasses.fields(cxlkv.KVLayout)}
    assert py - set(core) == {"model_id", "source"}
    assert core[:8] == [
        "block_bytes",
        "dtype",
        "kind",
        "num_layers",
        "num_kv_heads",
        "head_size",
        "tokens_per_block",
        "heads_per_entry",
    ]


def test_layout_field_checks_come_from_the_core():
    with pytest.raises(ValueError, match=r"num_layers must be in 1\.\.4294967295, got 0"):
        layout("bf16", num_layers=0)
    with pytest.raises(ValueError, match=r"head_size must be in 1\.\.4294967295, got -3"):
        layout("bf16", head_size=-3)
    with pytest.raises(ValueError, match="heads_per_entry must divide num_kv_heads"):
        layout("bf16", num_kv_heads=4, heads_per_entry=3)
    with pytest.raises(ValueError, match="dense layouts only"):
        layout("bf16", kind="mla", heads_per_entry=1)
    with pytest.raises(TypeError, match="num_layers must be an integer, not float"):
        layout("bf16", num_layers=2.0)
    with pytest.raises(TypeError, match="tokens_per_block must be an integer, not bool"):
        layout("bf16", tokens_per_block=True)
    with pytest.raises(ValueError, match="blocks would hold more than 4294967295 bytes"):
        layout("fp32", num_layers=1 << 20, head_size=1 << 12)
    assert layout("bf16", num_layers=np.int64(3)).num_layers == 3


NS_DTYPE_OFF = 24  # NamespaceEntry.layout.dtype (format.h: state, fingerprint, block_bytes, dtype)
NS_KIND_OFF = 28


@pytest.mark.parametrize("off, field", [(NS_DTYPE_OFF, "dtype"), (NS_KIND_OFF, "kind")])
def test_unknown_code_in_the_pool_is_shown_not_trusted(pool_path, off, field):
    """A dtype or kind code this build does not know (a newer writer, or a scribble) is listed as
    unknown(N) and never matches a caller's layout."""
    with cxlkv.Pool.create(pool_path, 16 * 1024 * 1024, chunk_size="1MiB") as pool:
        pool.namespace(layout("bf16"), name="ns")
    h = tu.read_header(pool_path)
    tu.patch_file(pool_path, h["ns_table_off"] + off, (4242).to_bytes(4, "little"))
    with cxlkv.Pool.open(pool_path) as pool:
        [listed] = pool.namespaces()
        assert listed[field] == "unknown(4242)"
        with pytest.raises(cxlkv.LayoutMismatchError, match=rf"{field} \w+ != unknown\(4242\)"):
            pool.namespace(layout("bf16"), name="ns")
