"""cxlkv: a KV-cache tier for LLM serving that lives in a (CXL) shared-memory pool.

Everything is in the pool: KV blocks, the prefix index, the allocator and the node table. Any
process attaches with :meth:`Pool.open` and reads or publishes KV blocks with plain loads and
stores; there is no server on the path. See docs/API.md for the contract.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from . import _core
from ._core import (  # noqa: F401  (re-exported)
    CxlkvError,
    LayoutMismatchError,
    NamespaceTableFullError,
    NodeTableFullError,
    PoolCorruptError,
    PoolFormatError,
    PoolNotReadyError,
    PoolTruncatedError,
    PoolVersionError,
    Lease,
    Namespace,
)
from .paths import DEFAULT_POOL_PATH, ensure_private_dir
from .sizes import format_size, parse_size  # noqa: F401

__all__ = [
    "Pool", "KVLayout", "Namespace", "Lease", "CxlkvError", "PoolFormatError", "PoolVersionError",
    "PoolTruncatedError", "PoolNotReadyError", "PoolCorruptError", "LayoutMismatchError",
    "NodeTableFullError", "NamespaceTableFullError", "DEFAULT_POOL_PATH", "parse_size", "format_size",
]

DTYPE_BYTES = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1, "bytes": 1,
}


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What a namespace's blocks hold. Two layouts that differ in any field never share blocks.

    dense: per layer, K and V of ``num_kv_heads x head_size`` per token.
    mla:   per layer, one latent vector of ``head_size`` per token (DeepSeek MLA).
    ``block_bytes`` overrides the computed size (for layouts with padding or extra scales).
    """

    model_id: str
    dtype: str = "bf16"
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    tokens_per_block: int = 16
    kind: str = "dense"
    tp_rank: int = 0
    tp_size: int = 1
    block_bytes: Optional[int] = None

    def __post_init__(self):
        _check_text("model_id", self.model_id)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        if self.kind not in ("dense", "mla", "opaque"):
            raise ValueError(f"layout kind must be 'dense', 'mla' or 'opaque', not {self.kind!r}")
        for f in ("num_layers", "num_kv_heads", "head_size", "tokens_per_block", "tp_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("tp_rank must be in [0, tp_size)")
        if self.block_bytes is None:
            per_token = self.num_layers * self.head_size * DTYPE_BYTES[self.dtype]
            if self.kind == "dense":
                per_token *= 2 * self.num_kv_heads
            object.__setattr__(self, "block_bytes", per_token * self.tokens_per_block)
        if self.block_bytes < 1:
            raise ValueError("block_bytes must be >= 1")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def default_name(self) -> str:
        return f"{self.model_id}#tp{self.tp_rank}/{self.tp_size}"


SizeLike = Union[int, str]


def _check_text(what: str, text: str) -> None:
    """F12: NUL would be cut when stored (every open then creates another namespace) and control
    characters reach operators' terminals. The core checks the bytes too; this names the field."""
    bad = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"{what} must not contain NUL or control characters (found {bad!r} in {text!r})")


class Pool:
    """One process's attachment to a pool. Use as a context manager, or call :meth:`close`."""

    def __init__(self, core: "_core.Pool"):
        self._core = core
        self._namespaces: dict = {}

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str = DEFAULT_POOL_PATH, size: SizeLike = "1GiB", *, chunk_size: Optional[SizeLike] = None,
               index_slots: Optional[int] = None, max_nodes: int = 64, pin_slots: int = 256,
               max_namespaces: int = 64, backend: str = "coherent", exist_ok: bool = False,
               allow_foreign_owner: bool = False, allow_group: bool = False) -> "Pool":
        """Create a pool (mode 0600). With exist_ok, an existing pool is opened instead, under
        the same owner checks as :meth:`open`."""
        path = os.fspath(path)
        ensure_private_dir(path)
        core = _core.Pool.create(
            path, parse_size(size), chunk_bytes=parse_size(chunk_size) if chunk_size else 0,
            index_slots=index_slots or 0, max_nodes=max_nodes, pin_slots=pin_slots,
            max_namespaces=max_namespaces, backend=backend, exist_ok=exist_ok,
            allow_foreign_owner=allow_foreign_owner, allow_group=allow_group)
        return cls(core)

    @classmethod
    def open(cls, path: str = DEFAULT_POOL_PATH, *, populate: bool = False, read_only: bool = False,
             allow_foreign_owner: bool = False, allow_group: bool = False) -> "Pool":
        """Attach to an existing pool. populate=True maps every page now (long-lived servers),
        instead of faulting pages in during the first copies.

        The pool must be owned by this user (or root; with allow_group, by one of our groups) and
        not writable by others: another user who can write it can read and corrupt every block.
        allow_foreign_owner=True accepts such a pool anyway. A symlink is never followed.
        read_only=True inspects without attaching (info, namespaces(), stats()): works without
        write access, no node slot is taken, namespaces cannot be opened."""
        path = os.fspath(path)
        if not read_only:
            ensure_private_dir(path)
        return cls(_core.Pool.open(path, populate=populate, read_only=read_only,
                                   allow_foreign_owner=allow_foreign_owner, allow_group=allow_group))

    @classmethod
    def open_or_create(cls, path: str = DEFAULT_POOL_PATH, size: SizeLike = "1GiB", **kwargs) -> "Pool":
        return cls.create(path, size, exist_ok=True, **kwargs)

    @staticmethod
    def destroy(path: str = DEFAULT_POOL_PATH, *, ignore_attached: bool = False, remove_invalid: bool = False) -> None:
        """Delete a file pool (wipe a devdax pool's header). Refuses while live processes are
        attached (the error lists them) unless ignore_attached. remove_invalid=True also removes a
        regular file that is not a complete pool (0 bytes, bad magic, half-initialized)."""
        _core.Pool.destroy(os.fspath(path), ignore_attached=ignore_attached, remove_invalid=remove_invalid)

    def close(self) -> None:
        self._namespaces.clear()
        self._core.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- identity -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._core.path

    @property
    def size(self) -> int:
        return self._core.size

    @property
    def node_id(self) -> int:
        return self._core.node_id

    @property
    def backend(self) -> str:
        return self._core.backend

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def uuid(self) -> str:
        return self._core.info()["uuid"]

    def info(self) -> dict:
        """Header fields, plus file_dev/file_ino: the identity of the mapped file."""
        return self._core.info()

    def file_replaced(self) -> bool:
        """True when the pool's path no longer names the mapped file (deleted or replaced)."""
        return self._core.file_replaced()

    # -- namespaces -----------------------------------------------------------------------
    def namespace(self, layout: KVLayout, name: Optional[str] = None) -> Namespace:
        name = name or layout.default_name()
        _check_text("namespace name", name)
        ns = self._namespaces.get((name, layout))
        if ns is None:
            ns = self._core.open_namespace(
                name=name, model_id=layout.model_id, dtype=layout.dtype, dtype_bytes=layout.dtype_bytes,
                kind=layout.kind, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                head_size=layout.head_size, tokens_per_block=layout.tokens_per_block, tp_rank=layout.tp_rank,
                tp_size=layout.tp_size, block_bytes=layout.block_bytes)
            self._namespaces[(name, layout)] = ns
        return ns

    def namespaces(self) -> list:
        return self._core.namespaces()

    # -- observability --------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters summed over attached processes, plus block occupancy of the whole pool."""
        s = self._core.counters()
        lookups = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / lookups if lookups else 0.0
        s["namespaces"] = len(self.namespaces())
        return s

    def check(self) -> dict:
        """Reclaims what dead processes left, then verifies every invariant of the format."""
        return self._core.check()

    def reap_dead_nodes(self) -> int:
        return self._core.reap_dead_nodes()

    def __repr__(self) -> str:
        if self.closed:
            return "<cxlkv.Pool closed>"
        return f"<cxlkv.Pool {self.path} {format_size(self.size)} node={self.node_id} backend={self.backend}>"
