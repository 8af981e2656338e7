"""Block keys that are the same in every process, and in every engine.

vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is set (the most common
reason for zero cross-instance hits in shared KV caches). cxlkv keys are chained SHA-256 digests
with a fixed recipe, so any process computing the keys of the same tokens gets the same 32 bytes:

    key[i] = sha256(key[i-1] | token ids of block i (u32 LE) | ids of multimodal inputs in
                    block i | extra(i))          (block 0: key[-1] = the seed; none: no prefix)

For a block of plain token ids this is SGLang's HiCache page hash (its ``get_hash_str``: sha256
of the previous page's digest and the page's ids as u32 little-endian), so SGLang's HiCache
backend, which sees SGLang's page hashes and never the tokens, uses them as the keys as they
are, and a prefix either engine stored is found by the other (docs/IDENTITY.md, "Across
engines"). The seed is SGLang's request namespace (:func:`sglang_seed`: none for a request
without cache_salt, a digest of the salt otherwise), so a salted vLLM request and an SGLang
request with the same cache_salt chain alike. A LoRA request is seeded by the adapter's content
digest under a tag no SGLang seed has (SGLang seeds by its adapter id, not by content: an SGLang
LoRA page never matches a vLLM one, nor a base-model one).

The namespace is not in the key: the pool's index is per namespace (a key is found only in the
namespace it was stored in; src/core/format/key_hash.h seeds its hash with the namespace id),
and the namespace is derived from what determines the KV bytes (identity.py). Everything else
that changes the KV of a block is in its key: the LoRA adapter by content (its digest, never its
name), the tenant's cache_salt (tenants never share blocks), the tokens of the whole prefix
(chaining), the multimodal inputs placed in the block, and ``extra(i)``: per-block bytes the
token ids do not show (the digest of a block's prompt embeddings, whose token ids are
placeholders). Multimodal inputs and embeddings make a key SGLang never computes: such blocks
are vLLM's alone. heads.py derives a key per KV head entry from a block's key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

LORA_SEED_TAG = b"cxlkv/keys/lora-seed/v1"
SGLANG_SEED_TAG = b"sglang-cache-namespace-v1"  # SGLang's storage_namespace_seed recipe
UNSEEDED = bytes(32)  # the root of a chain without a seed (token records name it as block 0's prev)


def sglang_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a request's page-hash chain with (None: unseeded): presence and
    UTF-8 length of each part, so absent, empty and joined parts differ."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(SGLANG_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        data = part.encode("utf-8")
        h.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return h.digest()


def chain_step(prev: bytes, data: bytes) -> bytes:
    """One link of the chain: ``prev`` is the previous key, or the root (UNSEEDED: no prefix)."""
    h = hashlib.sha256() if prev == UNSEEDED else hashlib.sha256(prev)
    h.update(data)
    return h.digest()


def root_key(namespace: str = "", lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """A request's chain root (32 bytes): its seed, or UNSEEDED. ``namespace`` is not part of it
    (the pool's index is per namespace); kept so that callers name what the keys are for."""
    del namespace
    if lora:
        h = hashlib.sha256(LORA_SEED_TAG)
        for part in (lora, cache_salt or ""):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little") + data)
        return h.digest()
    return sglang_seed(None, cache_salt) or UNSEEDED


@dataclass
class MMSpan:
    """A multimodal input occupying tokens [offset, offset + length) of the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass
class ChainedKeys:
    """Incrementally computed keys of one token sequence (a request's prompt and output)."""

    root: bytes
    block_size: int
    mm: Sequence[MMSpan] = ()
    keys: list = field(default_factory=list)
    extra: Callable[[int], bytes] | None = None  # block index -> bytes hashed into its key

    def extend(self, token_ids: Sequence[int], upto_blocks: int | None = None) -> list:
        """Computes keys of every full block of token_ids (or of the first upto_blocks)."""
        full = len(token_ids) // self.block_size
        if upto_blocks is not None:
            full = min(full, upto_blocks)
        if full <= len(self.keys):
            return self.keys[:full] if upto_blocks is not None else self.keys
        bs = self.block_size
        start = len(self.keys)
        arr = np.asarray(token_ids[start * bs : full * bs], dtype=np.int64).astype("<i4", copy=False)
        prev = self.keys[-1] if self.keys else self.root
        for i in range(full - start):
            b = start + i
            data = arr[i * bs : (i + 1) * bs].tobytes()  # u32 LE for every valid token id
            for span in self.mm:
                if span.offset < (b + 1) * bs and span.offset + span.length > b * bs:
                    data += span.identifier.encode()
            if self.extra is not None:
                data += self.extra(b)
            prev = chain_step(prev, data)
            self.keys.append(prev)
        return self.keys


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    *,
    lora: str | None = None,
    cache_salt: str | None = None,
    mm: Iterable[MMSpan] = (),
) -> list:
    """Keys of every full block of token_ids (convenience for one-shot use and tests)."""
    return ChainedKeys(root_key(namespace, lora, cache_salt), block_size, list(mm)).extend(token_ids)


def page_key(page_hash: str) -> bytes:
    """The key of an SGLang page hash (64 hex digits: the key above, as SGLang passes it); any
    other key string is hashed under a tag of its own, and matches no key computed from tokens."""
    try:
        if len(page_hash) == 64:
            return bytes.fromhex(page_hash)
    except ValueError:
        pass
    return hashlib.sha256(b"cxlkv/keys/sglang-other/v1|" + page_hash.encode()).digest()
