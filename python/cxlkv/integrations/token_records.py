"""Token records: the token ids of a KV block, kept in the pool beside it for event consumers.

The pool's index holds 32-byte keys, which routers cannot recompute (they hash token ids their own
way: llm-d, Dynamo). So for each block it confirms in the pool, the connector's scheduler side
(which holds the token ids) puts a small record into a namespace of its own, keyed by
``sha256(RECORD_KEY_PREFIX | block key)``: the block's tokens, the key it was chained on, and the
LoRA it was computed with. ``cxlkv events`` reads it when the block appears in the index and
publishes the tokens with the event.

The pool is untrusted input, so a record is believed only if it proves itself:
``sha256(prev | token ids as int32 LE) == key`` (how keys.py chains a block with no multimodal or
embedding input; only such blocks get records; a first block's prev is the chain's root, and the
root of an unseeded chain, ``keys.UNSEEDED``, stands for no prefix: ``sha256(token ids)``). Anything else (a bad magic, version, size, name
or a hash that does not match) is ``None``: the event then goes out without tokens.

Format (little-endian), RECORD_HEADER bytes then 4 * block_size:
    magic "CXTR" | version u16 | flags u16 (bit 0: first block of its chain) | block_size u32 |
    reserved u32 | lora_id i64 (-1: none) | lora_name_len u16 | 6 zero bytes |
    key[32] | prev[32] (the chain's root for a first block, else the parent key) |
    lora_name[64] (UTF-8, zero padded) | token ids int32 LE x block_size
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import cxlkv
from cxlkv.integrations.keys import chain_step

MAGIC = b"CXTR"
VERSION = 1
RECORD_KEY_PREFIX = b"cxlkv/token-records/v1"
MODEL_ID_PREFIX = "cxlkv/token-records/v1"  # the record namespaces' model_id (and how to spot them)
_HEAD = struct.Struct("<4sHHIIqH6x")
LORA_NAME_BYTES = 64
RECORD_HEADER = _HEAD.size + 32 + 32 + LORA_NAME_BYTES
FIRST = 1


def record_key(block_key: bytes) -> bytes:
    return hashlib.sha256(RECORD_KEY_PREFIX + block_key).digest()


def layout(block_size: int) -> cxlkv.KVLayout:
    """The namespace of records for blocks of ``block_size`` tokens (one per block size)."""
    return cxlkv.KVLayout(
        model_id=f"{MODEL_ID_PREFIX}/bs{block_size}",
        dtype="bytes",
        num_layers=1,
        num_kv_heads=1,
        head_size=1,
        tokens_per_block=block_size,
        block_bytes=RECORD_HEADER + 4 * block_size,
        source="token ids of KV blocks, for cxlkv events (integrations/token_records.py)",
    )


def namespace_name(block_size: int) -> str:
    return f"cxlkv-token-records-v1-bs{block_size}"


def is_record_namespace(info: dict) -> bool:
    return str(info.get("model_id", "")).startswith(MODEL_ID_PREFIX)


@dataclass(frozen=True)
class TokenRecord:
    key: bytes
    prev: bytes
    first: bool
    token_ids: list
    lora_id: int | None
    lora_name: str | None


def chains(prev: bytes, token_ids: Sequence[int], key: bytes) -> bool:
    """Whether ``key`` is the key of a plain block of ``token_ids`` chained on ``prev``."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        return False
    return chain_step(prev, arr.astype("<i4").tobytes()) == key


def encode(rec: TokenRecord, block_size: int) -> bytes:
    name = (rec.lora_name or "").encode()[:LORA_NAME_BYTES]
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        FIRST if rec.first else 0,
        block_size,
        0,
        -1 if rec.lora_id is None else int(rec.lora_id),
        len(name),
    )
    tokens = np.asarray(rec.token_ids, dtype=np.int64).astype("<i4").tobytes()
    return head + rec.key + rec.prev + name.ljust(LORA_NAME_BYTES, b"\0") + tokens


def decode(data: bytes | None, key: bytes, block_size: int) -> TokenRecord | None:
    """The record of block ``key`` if ``data`` is one that proves itself, else None."""
    if data is None or len(data) != RECORD_HEADER + 4 * block_size:
        return None
    magic, version, flags, bs, _reserved, lora_id, name_len = _HEAD.unpack_from(data)
    if (
        magic != MAGIC
        or version != VERSION
        or bs != block_size
        or flags & ~FIRST
        or name_len > LORA_NAME_BYTES
    ):
        return None
    o = _HEAD.size
    rkey, prev = data[o : o + 32], data[o + 32 : o + 64]
    name = data[o + 64 : o + 64 + name_len]
    try:
        lora_name = name.decode() if name_len else None
    except UnicodeDecodeError:
        return None
    tokens = np.frombuffer(data, "<i4", block_size, RECORD_HEADER).tolist()
    if rkey != key or not chains(prev, tokens, key):
        return None
    return TokenRecord(key, prev, bool(flags & FIRST), tokens, None if lora_id < 0 else lora_id, lora_name)


class TokenRecordWriter:
    """Puts records of confirmed blocks into ``pool`` (never raises: a record is a hint)."""

    def __init__(self, pool: cxlkv.Pool, block_size: int):
        self.block_size = block_size
        self._ns = pool.namespace(layout(block_size), name=namespace_name(block_size))
        self.failed = 0

    def put(self, rec: TokenRecord) -> bool:
        if len(rec.token_ids) != self.block_size or not chains(rec.prev, rec.token_ids, rec.key):
            return False  # not a plain block (multimodal, embeddings): no record proves it
        try:
            ok = bool(self._ns.put(record_key(rec.key), encode(rec, self.block_size)))
        except cxlkv.CxlkvError:
            ok = False
        self.failed += not ok
        return ok
