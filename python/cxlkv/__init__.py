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
from .sizes import format_size, parse_size  # noqa: F401

__all__ = [
    "Pool", "KVLayout", "Namespace", "Lease", "CxlkvError", "PoolFormatError", "PoolVersionError",
    "PoolTruncatedError", "PoolNotReadyError", "PoolCorruptError", "LayoutMismatchError",
    "NodeTableFullError", "NamespaceTableFullError", "DEFAULT_POOL_PATH", "parse_size", "format_size",
    "dtypes", "resolve_dtype", "dtype_bytes",
]

DEFAULT_POOL_PATH = os.environ.get("CXLKV_POOL", "/dev/shm/cxlkv")



def dtypes() -> dict:
    """Every KV dtype the core knows: ``{canonical name: {"name", "code", "bytes", "aliases"}}``.
    The table lives in the core (src/core/dtype.h); every alias opens the same namespace."""
    return {d["name"]: d for d in _core.dtypes()}


def resolve_dtype(dtype: object) -> str:
    """The canonical name of ``dtype``: any alias (``"bfloat16"``, ``"fp8"``...) or an object whose
    ``str()`` is one (``torch.bfloat16``, ``numpy.dtype("float16")``). ValueError naming the allowed
    names otherwise; never a silent fallback."""
    return _core.dtype_info(dtype)["name"]


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype`` (any name :func:`resolve_dtype` accepts)."""
    return _core.dtype_info(dtype)["bytes"]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What a namespace's blocks hold. Two layouts that differ in any field never share blocks.

    dense: per layer, K and V of ``num_kv_heads x head_size`` per token.
    mla:   per layer, one latent vector of ``head_size`` per token (DeepSeek MLA).
    ``dtype`` takes any alias of :func:`dtypes` (or a torch/numpy dtype) and is stored canonical
    (``KVLayout(dtype="bfloat16").dtype == "bf16"``), so every alias names the same namespace.
    ``block_bytes`` overrides the computed size (for layouts with padding or extra scales).
    ``source`` says what ``model_id`` was derived from (shown by ``pool info``); it is not part of
    the identity: layouts that differ only in ``source`` open the same namespace, which keeps the
    source of its creator.
    The fields, their ranges and the block size rule are the core's (``_core.layout_fields()``);
    construction validates through the core exactly as ``Pool.namespace`` does.
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
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        canonical = _core.normalize_layout(self)
        for f in ("dtype", "kind", "block_bytes"):
            object.__setattr__(self, f, canonical[f])

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    def default_name(self) -> str:
        return f"{self.model_id}#tp{self.tp_rank}/{self.tp_size}"


SizeLike = Union[int, str]


class Pool:
    """One process's attachment to a pool. Use as a context manager, or call :meth:`close`."""

    def __init__(self, core: "_core.Pool"):
        self._core = core
        self._namespaces: dict = {}

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str = DEFAULT_POOL_PATH, size: SizeLike = "1GiB", *, chunk_size: Optional[SizeLike] = None,
               index_slots: Optional[int] = None, max_nodes: int = 64, pin_slots: int = 256,
               max_namespaces: int = 64, backend: str = "coherent", exist_ok: bool = False) -> "Pool":
        core = _core.Pool.create(
            os.fspath(path), parse_size(size), chunk_bytes=parse_size(chunk_size) if chunk_size else 0,
            index_slots=index_slots or 0, max_nodes=max_nodes, pin_slots=pin_slots,
            max_namespaces=max_namespaces, backend=backend, exist_ok=exist_ok)
        return cls(core)

    @classmethod
    def open(cls, path: str = DEFAULT_POOL_PATH, *, populate: bool = False) -> "Pool":
        """Attach to an existing pool. populate=True maps every page now (long-lived servers),
        instead of faulting pages in during the first copies."""
        return cls(_core.Pool.open(os.fspath(path), populate=populate))

    @classmethod
    def open_or_create(cls, path: str = DEFAULT_POOL_PATH, size: SizeLike = "1GiB", **kwargs) -> "Pool":
        return cls.create(path, size, exist_ok=True, **kwargs)

    @staticmethod
    def destroy(path: str = DEFAULT_POOL_PATH) -> None:
        _core.Pool.destroy(os.fspath(path))

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
        return self._core.info()

    # -- namespaces -----------------------------------------------------------------------
    def namespace(self, layout: KVLayout, name: Optional[str] = None) -> Namespace:
        name = name or layout.default_name()
        ns = self._namespaces.get((name, layout))
        if ns is None:
            ns = self._core.open_namespace(name, layout)
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
