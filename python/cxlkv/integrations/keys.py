"""Block keys that are the same in every process.

vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is set (the most common
reason for zero cross-instance hits in shared KV caches). cxlkv keys are chained SHA-256 digests
with a fixed root, so any process computing the keys of the same tokens gets the same 32 bytes:

    root   = sha256("cxlkv/keys/v1" | namespace | lora | cache_salt)
    key[i] = sha256(key[i-1] | token ids of block i (int32 LE) | ids of multimodal inputs in block i
                    | extra(i))

Everything that changes the KV of a block is in its key: the namespace (the weights' content,
dtype, layout: see identity.py; heads.py derives a key per KV head entry from it), the LoRA
adapter by content (its digest, never its name), the tenant's cache_salt (tenants never share
blocks), the tokens of the whole prefix (chaining), the multimodal inputs placed in the block,
and ``extra(i)``: per-block bytes the token ids do not show (the digest of a block's prompt
embeddings, whose token ids are placeholders).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

KEY_VERSION = b"cxlkv/keys/v1"


def root_key(namespace: str, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    h = hashlib.sha256(KEY_VERSION)
    for part in (namespace, lora or "", cache_salt or ""):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


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
            h = hashlib.sha256(prev)
            h.update(arr[i * bs : (i + 1) * bs].tobytes())
            for span in self.mm:
                if span.offset < (b + 1) * bs and span.offset + span.length > b * bs:
                    h.update(span.identifier.encode())
            if self.extra is not None:
                h.update(self.extra(b))
            prev = h.digest()
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
