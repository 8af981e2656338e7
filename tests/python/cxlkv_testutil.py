"""Helpers shared by the Python tests and by the worker scripts they start.

Everything here is deterministic: a block's payload is derived from its key alone, so any process
(a stress worker, a chaos worker that was restarted after kill -9, the final verifier) can check the
bytes it reads without talking to the writer.

Payload rules (used by every test that shares a pool between processes):

* ``payload_len(key, block_bytes)``: a length in ``[block_bytes // 2, block_bytes]`` derived from the
  key (a quarter of the keys use the full block).
* ``payload(key, n)``: ``shake_256(key)`` stretched to ``n`` bytes.
* A key written with ``put`` stores ``payload(key, payload_len(key))``; a key written with
  ``store`` (gather) stores a whole block: the same payload zero-padded to ``block_bytes``
  (``padded_payload``). A reader accepts either form (``verify_bytes``), and a ``get`` into a zeroed
  buffer must produce exactly ``padded_payload`` in both cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys

import numpy as np

# ------------------------------------------------------------------------------------------------
# On-memory header layout (src/core/format/format.h, struct PoolHeader). Offsets in bytes.
HEADER_FIELDS = {
    # name: (offset, struct format)
    "magic": (0, "8s"),
    "major": (8, "<H"),
    "minor": (10, "<H"),
    "header_bytes": (12, "<I"),
    "compat": (16, "<Q"),
    "incompat": (24, "<Q"),
    "ro_compat": (32, "<Q"),
    "uuid": (40, "16s"),
    "created_unix_ns": (56, "<Q"),
    "pool_bytes": (64, "<Q"),
    "backend": (72, "<I"),
    "lease_ms": (76, "<I"),
    "node_table_off": (80, "<Q"),
    "node_area_off": (88, "<Q"),
    "node_area_bytes": (96, "<Q"),
    "max_nodes": (104, "<I"),
    "pin_slots": (108, "<I"),
    "ns_table_off": (112, "<Q"),
    "max_namespaces": (120, "<I"),
    "lock_hosts": (124, "<I"),
    "index_off": (128, "<Q"),
    "index_slots": (136, "<Q"),
    "access_off": (144, "<Q"),
    "chunk_map_off": (152, "<Q"),
    "chunk_count": (160, "<Q"),
    "chunk_bytes": (168, "<Q"),
    "arena_off": (176, "<Q"),
    "stamp_cache_line": (184, "<I"),
    "stamp_header": (188, "<I"),
    "stamp_node_slot": (192, "<I"),
    "stamp_node_area_fixed": (196, "<I"),
    "stamp_namespace": (200, "<I"),
    "stamp_index_entry": (204, "<I"),
    "checksum": (208, "<Q"),
}
HEADER_STRUCT_BYTES = 216
CHECKSUM_OFF = HEADER_FIELDS["checksum"][0]
MAGIC = b"CXLKVPL\0"
SHARED_WORDS_OFF = 4096  # SharedWords.init.word
INIT_BUSY = 0x5953554254494E49
INIT_READY = 0x5944414552544E49

# IndexEntry: one 64-byte line.
ENTRY_BYTES = 64
ENTRY_STATE_OFF = 0
ENTRY_KEY_OFF = 8
ENTRY_NS_OFF = 40
ENTRY_CHUNK_OFF = 44
ENTRY_BLOCK_OFF = 48
ENTRY_DEPTH_OFF = 50
ENTRY_LENGTH_OFF = 52
ENTRY_CHECKSUM_OFF = 56
ENTRY_EMPTY, ENTRY_WRITING, ENTRY_READY, ENTRY_EVICTING, ENTRY_TOMBSTONE = 0, 1, 2, 3, 4


def read_header_field(buf: bytes, name: str):
    off, fmt = HEADER_FIELDS[name]
    return struct.unpack_from(fmt, buf, off)[0]


def header_checksum(buf: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(bytes(buf[:CHECKSUM_OFF]))


def patch_file(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def patch_header_field(path: str, name: str, value, *, fix_checksum: bool = True) -> None:
    """Overwrite one PoolHeader field in the file; by default re-seal the header checksum so that
    the check under test is the one that fires (not the checksum check)."""
    off, fmt = HEADER_FIELDS[name]
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))
        if fix_checksum:
            f.seek(0)
            hdr = f.read(HEADER_STRUCT_BYTES)
            f.seek(CHECKSUM_OFF)
            f.write(struct.pack("<Q", header_checksum(hdr)))


def reseal_header(path: str) -> None:
    with open(path, "r+b") as f:
        hdr = f.read(HEADER_STRUCT_BYTES)
        f.seek(CHECKSUM_OFF)
        f.write(struct.pack("<Q", header_checksum(hdr)))


def read_header(path: str) -> dict:
    with open(path, "rb") as f:
        buf = f.read(HEADER_STRUCT_BYTES)
    return {name: read_header_field(buf, name) for name in HEADER_FIELDS}


# ------------------------------------------------------------------------------------------------
# Keys and payloads.
def make_key(*parts) -> bytes:
    """A 32-byte key (like vLLM's block hashes) from any printable parts."""
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def chain_keys(chain_id, length: int, salt: str = "chain") -> list[bytes]:
    return [make_key(salt, chain_id, j) for j in range(length)]


def payload_len(key: bytes, block_bytes: int) -> int:
    if key[0] % 4 == 0:
        return block_bytes
    half = block_bytes // 2
    return block_bytes - (int.from_bytes(key[1:5], "little") % (half + 1))


def payload(key: bytes, n: int, salt: bytes = b"") -> bytes:
    return hashlib.shake_256(salt + key).digest(n)


def key_payload(key: bytes, block_bytes: int, salt: bytes = b"") -> bytes:
    return payload(key, payload_len(key, block_bytes), salt)


def padded_payload(key: bytes, block_bytes: int, salt: bytes = b"") -> bytes:
    p = key_payload(key, block_bytes, salt)
    return p + bytes(block_bytes - len(p))


def verify_bytes(key: bytes, data, block_bytes: int, salt: bytes = b"") -> bool:
    """True if ``data`` (from get_bytes) is what put() or store() of ``key`` writes."""
    data = bytes(data)
    p = key_payload(key, block_bytes, salt)
    n = len(p)
    if len(data) == n:
        return data == p
    if len(data) == block_bytes:
        return data[:n] == p and not any(data[n:])
    return False


# ------------------------------------------------------------------------------------------------
# vLLM-style paged KV layouts, as numpy arrays (uint16 stands in for bf16: only bytes matter).
class CudaKV:
    """vLLM CUDA layout: per layer ``[2, num_blocks, block_size, heads, head]``, ``block_dim=1``.
    A pool block is, per layer in order, K[block] then V[block]."""

    block_dim = 1

    def __init__(self, num_layers, block_size, heads, head, num_blocks, dtype=np.uint16, fill=0):
        self.num_layers, self.block_size, self.heads, self.head = num_layers, block_size, heads, head
        self.num_blocks = num_blocks
        self.dtype = np.dtype(dtype)
        self.arrays = [
            np.full((2, num_blocks, block_size, heads, head), fill, dtype=self.dtype)
            for _ in range(num_layers)
        ]
        self.frag_bytes = block_size * heads * head * self.dtype.itemsize
        self.block_bytes = num_layers * 2 * self.frag_bytes

    def fragments(self, b):
        for arr in self.arrays:
            for kv in range(2):
                yield arr[kv, b]

    def write_block(self, b: int, data: bytes) -> None:
        assert len(data) == self.block_bytes
        mv = np.frombuffer(data, dtype=self.dtype)
        per = self.frag_bytes // self.dtype.itemsize
        for i, frag in enumerate(self.fragments(b)):
            frag[...] = mv[i * per : (i + 1) * per].reshape(frag.shape)

    def read_block(self, b: int) -> bytes:
        return b"".join(np.ascontiguousarray(f).tobytes() for f in self.fragments(b))

    def zero(self):
        for a in self.arrays:
            a[...] = 0


class CpuKV:
    """vLLM CPU layout: per layer ``[num_blocks, heads, block_size, 2*head]``, ``block_dim=0``.
    A pool block is the concatenation of every layer's ``[block]`` sub-array."""

    block_dim = 0

    def __init__(self, num_layers, block_size, heads, head, num_blocks, dtype=np.uint16, fill=0):
        self.num_layers, self.block_size, self.heads, self.head = num_layers, block_size, heads, head
        self.num_blocks = num_blocks
        self.dtype = np.dtype(dtype)
        self.arrays = [
            np.full((num_blocks, heads, block_size, 2 * head), fill, dtype=self.dtype)
            for _ in range(num_layers)
        ]
        self.frag_bytes = heads * block_size * 2 * head * self.dtype.itemsize
        self.block_bytes = num_layers * self.frag_bytes

    def fragments(self, b):
        for arr in self.arrays:
            yield arr[b]

    write_block = CudaKV.write_block
    read_block = CudaKV.read_block
    zero = CudaKV.zero


# ------------------------------------------------------------------------------------------------
# The layout shared by the multi-process tests: 2 layers, 2 KV heads, head 32, 8 tokens, bf16:
# 2 * 2 * 2 * 32 * 8 * 2 = 4096-byte blocks, 4 fragments of 1 KiB each in the CUDA layout.
SHARED_LAYOUT = dict(
    model_id="test/shared-model", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=32, tokens_per_block=8
)


def shared_layout():
    import cxlkv

    return cxlkv.KVLayout(**SHARED_LAYOUT)


def shared_kv(num_blocks: int) -> CudaKV:
    L = SHARED_LAYOUT
    return CudaKV(L["num_layers"], L["tokens_per_block"], L["num_kv_heads"], L["head_size"], num_blocks)


def assert_kv_intact_and_refillable(
    ns, chains: int, singles: int, refill: int, after: str, refill_tag: str = "refill"
) -> None:
    """After processes died and were reclaimed: every block of the workers' chains (8 deep) and
    singles still in the pool holds its own bytes (and some are still there), and `refill` fresh
    puts all succeed (no capacity leaked, no pin orphaned)."""
    keys = [k for c in range(chains) for k in chain_keys(c, 8)]
    keys += [make_key("single", i) for i in range(singles)]
    resident = 0
    for k in keys:
        d = ns.get_bytes(k)
        if d is not None:
            resident += 1
            assert verify_bytes(k, d, ns.block_bytes), f"{k.hex()}: wrong bytes after {after}"
    assert resident > 0
    fresh = [make_key(refill_tag, i) for i in range(refill)]
    failed = sum(1 for k in fresh if not ns.put(k, key_payload(k, ns.block_bytes)))
    assert failed == 0, f"{failed} puts failed after {after}: capacity leaked or pins orphaned"


def pool_check_problems(report: dict) -> list[str]:
    """Everything in a pool.check() report that means 'not clean'."""
    problems = []
    if not report.get("ok", False):
        problems.append("ok is False")
    problems += [f"error: {e}" for e in report.get("errors", [])]
    blocks = report.get("blocks", {}) or {}
    for field in (
        "leaked",
        "leaked_blocks",
        "stuck",
        "stuck_entries",
        "orphan_pins",
        "duplicate_keys",
        "inflight",
        "inflight_blocks",
        "in_flight",
    ):
        v = blocks.get(field, report.get(field))
        if v:
            problems.append(f"{field} = {v}")
    return problems


def here() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def python_exe() -> str:
    return sys.executable


# ------------------------------------------------------------------------------------------------
# Seeds of the random tests: every one prints its seed and takes a fixed one from the environment.
SEED_ENV = "CXLKV_TEST_SEED"


def random_test_seed(what: str) -> int:
    """The seed of one random test: ``$CXLKV_TEST_SEED`` when set (to replay a failure), else a
    fresh one. Printed, so pytest shows it with a failing test's captured output."""
    text = os.environ.get(SEED_ENV, "").strip()
    seed = int(text, 0) if text else int.from_bytes(os.urandom(4), "little")
    print(f"{what}: seed {seed} (replay with {SEED_ENV}={seed})", flush=True)
    return seed


# ------------------------------------------------------------------------------------------------
# Model directories for the identity and connector tests (no vLLM needed to make them)
def write_safetensors(path, tensors: dict) -> None:
    """A minimal safetensors file (header JSON + raw bytes) of uint8 tensors."""
    header, blobs, off = {}, [], 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_model(d, seed=0, size=200_000) -> str:
    """A model directory the connector's identity reads: config.json and a safetensors file of
    random bytes (``seed`` picks them; not loadable weights)."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(
        os.path.join(d, "model.safetensors"),
        {"a.weight": rng.bytes(size), "b.weight": rng.bytes(size // 3), "norm": rng.bytes(64)},
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["Tiny"], "hidden_size": 8}, f)
    return d
