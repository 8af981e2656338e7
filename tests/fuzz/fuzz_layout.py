"""Where things are in a pool file, for the fuzzers (tests/fuzz) only.

The header field table and the index-entry offsets are those of tests/python/cxlkv_testutil.py (the
test suite's one mirror of src/core/format/format.h). This module adds the few other structs the fuzzers
write into (node slots, node areas, namespace entries) and `assert_matches(info)`, which checks the
mirror against the geometry the core itself reports through `Pool.info()`: a format change that
moves a header field fails the fuzz tests at once instead of silently fuzzing the wrong bytes.
"""

from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import cxlkv_testutil as tu

HEADER_FIELDS = tu.HEADER_FIELDS
HEADER_STRUCT_BYTES = tu.HEADER_STRUCT_BYTES
CHECKSUM_OFF = tu.CHECKSUM_OFF
SHARED_INIT_OFF = tu.SHARED_WORDS_OFF
SHARED_NSLOCK_OFF = tu.SHARED_WORDS_OFF + 64  # SharedWords.ns_lock, the next cache line

ENTRY_BYTES = tu.ENTRY_BYTES
ENTRY_FIELDS = {
    "state": (tu.ENTRY_STATE_OFF, "<Q"),
    "key": (tu.ENTRY_KEY_OFF, "32s"),
    "ns_id": (tu.ENTRY_NS_OFF, "<H"),  # format 3: 16 bits, then the entry's quota rows
    "tenant_row": (tu.ENTRY_NS_OFF + 2, "<B"),
    "ns_row": (tu.ENTRY_NS_OFF + 3, "<B"),
    "chunk": (tu.ENTRY_CHUNK_OFF, "<I"),
    "block": (tu.ENTRY_BLOCK_OFF, "<H"),
    "depth": (tu.ENTRY_DEPTH_OFF, "<H"),
    "length": (tu.ENTRY_LENGTH_OFF, "<I"),
    "checksum": (tu.ENTRY_CHECKSUM_OFF, "<Q"),
}
ENTRY_READY = tu.ENTRY_READY

NODE_SLOT_BYTES = 64  # format.h NodeSlot
NODE_SLOT_FIELDS = {
    "state": (0, "<Q"),
    "pid": (8, "<Q"),
    "start_time": (16, "<Q"),
    "host_id": (24, "<Q"),
    "heartbeat_ns": (32, "<Q"),
    "attach_unix_ns": (40, "<Q"),
}
NODE_PIN_HW_OFF = 0  # NodeAreaFixed.pin_hw
NODE_COUNTERS_OFF = 64  # NodeAreaFixed.counters[24]
NODE_QUOTA_CHARGED_OFF = 256  # NodeAreaFixed.quota_charged[48] (format/quota.h)
NODE_QUOTA_RELEASED_OFF = 640  # NodeAreaFixed.quota_released[48]
NODE_PINS_OFF = 1024  # sizeof(NodeAreaFixed): pins follow
QUOTA_TABLE_OFF = 4096 + 1024  # format/quota.h kQuotaTableOff: QuotaRow[48], 64 bytes each
QUOTA_ROWS = 48
QUOTA_ROW_FIELDS = {
    "kind": (0, "<I"),
    "ns_id": (4, "<I"),
    "max_bytes": (8, "<Q"),
    "max_ppm": (16, "<I"),
    "name": (24, "32s"),
    "checksum": (56, "<Q"),
}
NS_BYTES = 256  # format.h NamespaceEntry
NS_FIELDS = {
    "state": (0, "<Q"),
    "fingerprint": (8, "<Q"),
    "block_bytes": (16, "<Q"),
    "dtype_bytes": (24, "<I"),
    "kind": (28, "<I"),
    "num_layers": (32, "<I"),
    "num_kv_heads": (36, "<I"),
    "head_size": (40, "<I"),
    "tokens_per_block": (44, "<I"),
    "heads_per_entry": (48, "<I"),
    "dtype": (56, "8s"),
    "model_id": (64, "96s"),
    "name": (160, "96s"),
}
NS_READY = 2
CHUNK_ACTIVE = 2
DESC_GRANULE = 1024  # format.h kDescGranule

# Header fields that Pool.info() reports under the same name: the mirror is checked against them.
_GEOMETRY = (
    "pool_bytes",
    "max_nodes",
    "pin_slots",
    "max_namespaces",
    "index_slots",
    "chunk_bytes",
    "chunk_count",
    "node_table_off",
    "node_area_off",
    "node_area_bytes",
    "ns_table_off",
    "index_off",
    "access_off",
    "chunk_map_off",
    "arena_off",
)


def round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def chunk_desc_bytes(chunk_bytes: int) -> int:
    """format.h chunk_desc_bytes(): one uint64 per granule of payload, rounded to 4 KiB."""
    return round_up(chunk_bytes // DESC_GRANULE * 8, 4096)


def read_header(buf) -> dict:
    return {k: struct.unpack_from(f, buf, o)[0] for k, (o, f) in HEADER_FIELDS.items()}


def reseal_header(buf: bytearray) -> None:
    struct.pack_into("<Q", buf, CHECKSUM_OFF, tu.header_checksum(bytes(buf[:HEADER_STRUCT_BYTES])))


def assert_matches(info: dict, buf) -> None:
    """Raises AssertionError if the mirror disagrees with what the core reports for this pool."""
    h = read_header(buf)
    bad = {k: (h[k], info[k]) for k in _GEOMETRY if h[k] != info[k]}
    if info.get("header_checksum_off", CHECKSUM_OFF) != CHECKSUM_OFF:
        bad["checksum_off"] = (CHECKSUM_OFF, info["header_checksum_off"])
    assert not bad, f"tests/fuzz layout mirror disagrees with Pool.info(): {bad}"
