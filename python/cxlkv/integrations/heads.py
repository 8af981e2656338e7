"""One block layout for every tensor-parallel size (docs/ARCHITECTURE.md, "One block layout for
every TP size").

A dense KV block is stored as one pool entry per KV head of the model: the entry of head ``g``
holds that head's K and V of every layer for the block's tokens, under the key
``head_key(block key, g)`` (the block key itself for head 0), in a namespace whose layout says ``heads_per_entry=1`` and whose
``num_kv_heads`` is the model's total. A TP rank then reads and writes exactly its heads, whatever
TP size wrote them, and verifies what it reads (each entry has its own checksum: a corrupt head
is a miss for the ranks that read it, never wrong bytes). Two TP=2 ranks write disjoint entries
of one logical block, so they never contend. An MLA latent is replicated on every rank: it stays
one entry per block under the block key itself, written by rank 0 and read by all.

vLLM gives each rank ``total // tp_size`` consecutive heads, or, when ``tp_size`` exceeds the
model's KV heads, one head replicated on ``tp_size // total`` consecutive ranks
(``QKVParallelLinear``): then only the first replica writes it, every replica reads it.

:class:`HeadNamespace` wraps a namespace so that its callers keep using block keys: lookups
(``match_prefix``, ``acquire``, ``contains``, ``delete``) ask for EVERY head of the model, so
a scheduler's hit means each head any reader of any TP size needs is present; ``store`` and
``load`` move this rank's heads. ``head(g)`` is the plain key API of one head's entries, for the
device path (transfer_cuda.py reserves and pins per head: :class:`PerHeadTransfer`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

HEAD_KEY_TAG = b"cxlkv/head/v1"


@functools.lru_cache(maxsize=1 << 16)  # a waiting request's keys are looked up every step
def head_key(key: bytes, head: int) -> bytes:
    """The key of KV head ``head``'s entry of the block of ``key``: head 0 under the block key
    itself (what pool-wide readers such as ``cxlkv events`` and token records know a block by),
    every other head under a hash (the entries of one block spread over the index like any
    keys)."""
    if head == 0:
        return bytes(key)
    return hashlib.sha256(bytes(key) + HEAD_KEY_TAG + head.to_bytes(4, "little")).digest()


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Which entries of a block a TP rank holds (``local``: global head index of its local head
    j) and which of them it writes (``writes``: local indices). ``split`` False: one replicated
    entry per block under the block key (MLA), ``total`` is then 1."""

    total: int
    tp_size: int = 1
    tp_rank: int = 0
    split: bool = True

    def __post_init__(self) -> None:
        if self.total < 1 or self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad head plan: {self.total} heads, rank {self.tp_rank} of {self.tp_size}")
        if self.split:
            big, small = max(self.total, self.tp_size), min(self.total, self.tp_size)
            if big % small:
                raise ValueError(
                    f"{self.total} KV heads cannot be split over {self.tp_size} tensor-parallel ranks"
                )

    @classmethod
    def replicated(cls, tp_size: int = 1, tp_rank: int = 0) -> HeadPlan:
        return cls(1, tp_size, tp_rank, split=False)

    @property
    def replicas(self) -> int:
        """Ranks holding each head (1 unless heads are replicated)."""
        return self.tp_size if not self.split else max(1, self.tp_size // self.total)

    @property
    def local(self) -> list[int]:
        if not self.split:
            return [0]
        if self.tp_size >= self.total:
            return [self.tp_rank // self.replicas]
        n = self.total // self.tp_size
        return list(range(self.tp_rank * n, (self.tp_rank + 1) * n))

    @property
    def writes(self) -> list[int]:
        return list(range(len(self.local))) if self.tp_rank % self.replicas == 0 else []

    def keys(self, keys: Sequence[bytes], head: int) -> list[bytes]:
        return [head_key(k, head) for k in keys] if self.split else list(keys)

    def every_key(self, keys: Sequence[bytes]) -> list[bytes]:
        """Every head's key, block by block: a leading count over it, divided by ``total``, is
        the number of leading blocks whose every head is there."""
        if not self.split:
            return list(keys)
        return [head_key(k, g) for k in keys for g in range(self.total)]


def head_dim_of(array: Any, block_dim: int, local_heads: int) -> int:
    """The dim of a per-layer KV array that indexes KV heads: the one dim after ``block_dim``
    (not the last: that is the head size) of size ``local_heads``. vLLM CPU's
    ``[num_blocks, heads, block_size, 2 * head_size]`` gives 1; flash attention's
    ``[2, num_blocks, block_size, heads, head_size]`` gives 3. Ambiguous or absent: ValueError
    (set ``kv_head_dim`` in kv_connector_extra_config)."""
    shape = tuple(array.shape)
    found = [d for d in range(block_dim + 1, len(shape) - 1) if shape[d] == local_heads]
    if len(found) != 1:
        raise ValueError(
            f"cxlkv: cannot tell the KV head dim of a KV array of shape {shape} ({local_heads} heads "
            f"per rank, blocks in dim {block_dim}); set kv_connector_extra_config.kv_head_dim"
        )
    return found[0]


def _strides(a: Any) -> tuple[int, ...]:
    """Strides in elements (numpy's are in bytes)."""
    s = a.stride() if callable(getattr(a, "stride", None)) else a.strides
    item = 1 if callable(getattr(a, "stride", None)) else a.itemsize
    return tuple(int(x) // item for x in s)


def head_views(arrays: Sequence[Any], block_dim: int, head_dim: int, j: int) -> tuple[list, int]:
    """Views of local head ``j`` of every array, with the block dim moved just before the
    longest contiguous tail, and that block dim: what ``ns.store``/``ns.load`` (and the CUDA
    plan) take. The entry's bytes are then, per array, the head's contiguous runs of one block
    (vLLM CPU: one run of block_size x 2 x head_size per layer; flash attention: one per token,
    K then V)."""
    if head_dim <= block_dim:
        raise ValueError(f"the KV head dim ({head_dim}) must follow the block dim ({block_dim})")
    return block_before_tail([a[(slice(None),) * head_dim + (j,)] for a in arrays], block_dim)


def block_before_tail(arrays: Sequence[Any], block_dim: int) -> tuple[list, int]:
    """``arrays`` with the block dim moved just before each one's longest contiguous tail, and
    that block dim (the same for all, else ValueError): the core copies, per block, the pieces
    that the dims before it index, in order, so a block's entry is its elements in the order of
    the dims after ``block_dim``, however they are strided."""
    out: list = []
    new_dim = None
    for v in arrays:
        shape, strides = tuple(v.shape), _strides(v)
        tail = len(shape)
        inner = 1
        for d in range(len(shape) - 1, block_dim, -1):
            if shape[d] != 1 and strides[d] != inner:
                break
            inner *= shape[d]
            tail = d
        order = [*range(block_dim), *range(block_dim + 1, tail), block_dim, *range(tail, len(shape))]
        v = v.permute(*order) if hasattr(v, "permute") else v.transpose(order)
        if new_dim not in (None, tail - 1):
            raise ValueError("the KV arrays of one transfer must share their layout")
        new_dim = tail - 1
        out.append(v)
    return out, int(new_dim if new_dim is not None else block_dim)


def merged_heads(arrays: Sequence[Any], block_dim: int, head_dim: int) -> list | None:
    """Views of ``arrays`` with the block and head dims merged into one (``block * heads +
    head``), when the head dim directly follows the block dim and the two merge without a copy
    (vLLM CPU's ``[blocks, heads, ...]``): then one core call moves every head of every block,
    split over the copy threads as one batch. None otherwise (flash attention's layout)."""
    if head_dim != block_dim + 1:
        return None
    out = []
    for a in arrays:
        shape, strides = tuple(a.shape), _strides(a)
        if strides[block_dim] != shape[head_dim] * strides[head_dim]:
            return None
        inner = 1  # the core moves each block's tail as one run: it must be C-contiguous
        for d in range(len(shape) - 1, head_dim, -1):
            if shape[d] != 1 and strides[d] != inner:
                return None  # (SGLang's page_head view: the per-head path gathers it)
            inner *= shape[d]
        merged = (*shape[:block_dim], shape[block_dim] * shape[head_dim], *shape[head_dim + 1 :])
        v = a.view(merged) if hasattr(a, "data_ptr") else a.reshape(merged)  # torch: never a copy
        if not hasattr(a, "data_ptr") and not np_shares(v, a):
            return None
        out.append(v)
    return out


def np_shares(v: Any, a: Any) -> bool:
    import numpy as np

    return bool(np.shares_memory(v, a))


class HeadLease:
    """A lease on every head of the leading complete blocks; ``len`` counts blocks."""

    def __init__(self, lease: Any, total: int) -> None:
        self._lease, self._total = lease, total

    def __len__(self) -> int:
        return len(self._lease) // self._total

    def release(self) -> None:
        self._lease.release()

    def __enter__(self) -> HeadLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class OneHead:
    """The plain key API of head ``g``'s entries (block keys in, that head's keys to the pool)."""

    def __init__(self, ns: Any, plan: HeadPlan, g: int) -> None:
        self._ns, self._plan, self._g = ns, plan, g

    def reserve(self, keys: Sequence[bytes], **kw: Any) -> Any:
        return self._ns.reserve(self._plan.keys(keys, self._g), **kw)

    def pin_verified(self, keys: Sequence[bytes]) -> Any:
        return self._ns.pin_verified(self._plan.keys(keys, self._g))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ns, name)


class HeadNamespace:
    """A namespace of per-head entries used with block keys (see the module docstring).
    ``head_dim``: the KV head dim of the arrays ``store``/``load`` get (None: the arrays hold no
    head dim, an MLA latent)."""

    def __init__(self, ns: Any, plan: HeadPlan, head_dim: int | None = None) -> None:
        self._ns, self.plan, self.head_dim = ns, plan, head_dim

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ns, name)

    @property
    def raw(self) -> Any:
        return self._ns

    def head(self, g: int) -> OneHead:
        return OneHead(self._ns, self.plan, g)

    # lookups: every head of the model -----------------------------------------------------
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self._ns.match_prefix(self.plan.every_key(keys))) // self.plan.total

    def contains(self, key: bytes) -> bool:
        return self.match_prefix([key]) == 1

    def acquire(self, keys: Sequence[bytes]) -> HeadLease:
        return HeadLease(self._ns.acquire(self.plan.every_key(keys)), self.plan.total)

    def delete(self, key: bytes) -> bool:
        gone = [bool(self._ns.delete(k)) for k in self.plan.every_key([key])]
        return any(gone)

    # data: this rank's heads --------------------------------------------------------------
    def _views(self, arrays: Sequence[Any], block_dim: int, j: int) -> tuple[list, int]:
        if self.head_dim is None:
            return list(arrays), block_dim
        return head_views(arrays, block_dim, self.head_dim, j)

    def _merged(self, arrays: Sequence[Any], block_dim: int) -> list | None:
        if self.head_dim is None or len(self.plan.local) == 1:
            return None  # one head (or a latent): the per-head path is one call already
        return merged_heads(arrays, block_dim, self.head_dim)

    def _flat(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[list, list]:
        """Block-major (every local head of block 0, then of block 1...): a leading count over it,
        divided by the local heads, is the leading complete blocks."""
        local = self.plan.local
        hk = [head_key(k, g) for k in keys for g in local]
        ids = [int(b) * len(local) + j for b in block_ids for j in range(len(local))]
        return hk, ids

    def store(
        self,
        keys: Sequence[bytes],
        arrays: Sequence[Any],
        block_ids: Sequence[int],
        *,
        block_dim: int = 0,
        start_depth: int = 0,
    ) -> int:
        """Writes the heads this rank writes; returns the leading blocks whose local heads are
        all present afterwards (a replica that writes nothing reports what it finds)."""
        n = len(keys)
        local = self.plan.local
        merged = self._merged(arrays, block_dim)
        if merged is not None and self.plan.writes:  # every local head of every block, one call
            hk, ids = self._flat(keys, block_ids)
            got = int(self._ns.store(hk, merged, ids, block_dim=block_dim, start_depth=start_depth))
            return got // len(local)
        for j in self.plan.writes:
            views, bd = self._views(arrays, block_dim, j)
            hk = self.plan.keys(keys, local[j])
            n = min(n, int(self._ns.store(hk, views, list(block_ids), block_dim=bd, start_depth=start_depth)))
        if not self.plan.writes:
            for g in local:
                n = min(n, int(self._ns.match_prefix(self.plan.keys(keys, g))))
        return n

    def load(
        self, keys: Sequence[bytes], arrays: Sequence[Any], block_ids: Sequence[int], *, block_dim: int = 0
    ) -> int:
        """Reads this rank's heads into ``arrays``; the leading blocks whose every local head
        loaded and verified (the rest are misses: the caller recomputes them)."""
        n = len(keys)
        merged = self._merged(arrays, block_dim)
        if merged is not None:
            hk, ids = self._flat(keys, block_ids)
            return int(self._ns.load(hk, merged, ids, block_dim=block_dim)) // len(self.plan.local)
        for j, g in enumerate(self.plan.local):
            if n == 0:
                break
            views, bd = self._views(arrays, block_dim, j)
            n = min(
                n, int(self._ns.load(self.plan.keys(keys[:n], g), views, list(block_ids[:n]), block_dim=bd))
            )
        return n


class _HeadSession:
    """A PoolSession whose namespace is one head's plain key API (for a per-head transfer)."""

    def __init__(self, session: Any, g: int) -> None:
        self._session, self._g = session, g

    def call(self, name: str, fn: Callable[[Any], Any], retry: bool = True) -> Any:
        return self._session.call(name, lambda ns: fn(ns.head(self._g)), retry=retry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _AllHandle:
    """The save handles of a block's heads as one: done when all are; the leading count of all."""

    def __init__(self, handles: list, n: int) -> None:
        self._handles, self._n = handles, n

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def result(self) -> int:
        return min([self._n, *(h.result() for h in self._handles)])


class PerHeadTransfer:
    """A Transfer (integrations/transfer.py) made of one device transfer per local head, each over
    that head's views and entries: the CUDA path, whose kernels, reservations and pins work on
    one entry layout at a time. ``make(session, arrays, block_dim, block_bytes)`` builds one."""

    def __init__(
        self,
        session: Any,
        kv_arrays: list,
        block_dim: int,
        entry_bytes: int,
        head_dim: int,
        plan: HeadPlan,
        make: Callable[..., Any],
        views: Callable[[list, int], tuple[list, int]] | None = None,
    ) -> None:
        # ``views(arrays, j)``: local entry j's views and block dim (default: head j's, head_views)
        self._plan = plan
        self._parts = []
        for j, g in enumerate(plan.local):
            if views is not None:
                part_views, bd = views(kv_arrays, j)
            else:
                part_views, bd = head_views(kv_arrays, block_dim, head_dim, j)
            self._parts.append(make(_HeadSession(session, g), part_views, bd, entry_bytes))

    def load(self, op: Any) -> int:
        n = len(op.keys)
        for t in self._parts:
            if n == 0:
                break
            part = copy.copy(op)  # a BlockOp (transfer.py): its first n blocks
            part.keys, part.block_ids = op.keys[:n], op.block_ids[:n]
            n = min(n, int(t.load(part)))
        return n

    def submit_save(self, op: Any) -> _AllHandle:
        return _AllHandle([self._parts[j].submit_save(op) for j in self._plan.writes], len(op.keys))

    def close(self) -> None:
        for t in self._parts:
            t.close()
