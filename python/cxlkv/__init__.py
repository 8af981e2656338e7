"""cxlkv: a KV-cache tier for LLM serving that lives in a (CXL) shared-memory pool.

Everything is in the pool: KV blocks, the prefix index, the allocator and the node table. Any
process attaches with :meth:`Pool.open` and reads or publishes KV blocks with plain loads and
stores; there is no server on the path. See docs/API.md for the contract.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any

from . import _core
from ._core import Lease, Namespace
from .errors import (
    ClosedError,
    CxlkvError,
    FencedError,
    ForkedError,
    HostSlotBusyError,
    LayoutMismatchError,
    LockTimeoutError,
    NamespaceTableFullError,
    NodeTableFullError,
    PinSlotsFullError,
    PoolCorruptError,
    PoolFormatError,
    PoolFullError,
    PoolInUseError,
    PoolNotReadyError,
    PoolTruncatedError,
    PoolVersionError,
    QuotaTableFullError,
    ReadOnlyError,
    SequenceConflictError,
    SequenceMissError,
)
from .paths import DEFAULT_POOL_PATH, default_pool_path, ensure_private_dir, join_device_paths
from .sizes import format_size, parse_size
from .token_store import TokenStore, open_token_store

__all__ = [
    "DEFAULT_POOL_PATH",
    "DEFAULT_POOL_SIZE",
    "ClosedError",
    "CxlkvError",
    "FencedError",
    "ForkedError",
    "HostSlotBusyError",
    "KVLayout",
    "LayoutMismatchError",
    "Lease",
    "LockTimeoutError",
    "Namespace",
    "NamespaceTableFullError",
    "NodeTableFullError",
    "PinSlotsFullError",
    "Pool",
    "PoolCorruptError",
    "PoolFormatError",
    "PoolFullError",
    "PoolInUseError",
    "PoolNotReadyError",
    "PoolTruncatedError",
    "PoolVersionError",
    "QuotaTableFullError",
    "ReadOnlyError",
    "SequenceConflictError",
    "SequenceMissError",
    "TokenStore",
    "create_options",
    "default_pool_path",
    "dtype_bytes",
    "dtypes",
    "format_size",
    "parse_size",
    "resolve_dtype",
]

# The size Pool.create / open_or_create (and `cxlkv demo`) give a pool when none is named.
DEFAULT_POOL_SIZE = "1GiB"

# Pool.create's defaults and limits are the core's (CreateOptions, format.h).
_CREATE_OPTIONS: dict = _core.create_options()


def create_options() -> dict:
    """Pool creation's defaults and limits, from the core: ``{option: {"default", "min", "max"}}``
    for ``chunk_bytes``, ``index_slots``, ``max_nodes``, ``pin_slots``, ``max_namespaces``,
    ``lease_ms``, ``stripe_bytes``, ``lock_hosts`` (a default of 0: derived from the size; ``max``
    None: no fixed limit), and
    ``{"backend": {"default": ...}}``."""
    return {k: dict(v) for k, v in _CREATE_OPTIONS.items()}


def _create_default(option: str):
    return _CREATE_OPTIONS[option]["default"]


def dtypes() -> dict:
    """Every KV dtype the core knows: ``{canonical name: {"name", "code", "bytes", "aliases"}}``.
    The table lives in the core (src/core/format/dtype.h); every alias opens the same namespace."""
    return {d["name"]: d for d in _core.dtypes()}


def resolve_dtype(dtype: object) -> str:
    """The canonical name of ``dtype``: any alias (``"bfloat16"``, ``"fp8"``...) or an object whose
    ``str()`` is one (``torch.bfloat16``, ``numpy.dtype("float16")``). ValueError naming the allowed
    names otherwise; never a silent fallback."""
    return _core.dtype_info(dtype)["name"]


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype`` (any name :func:`resolve_dtype` accepts)."""
    return _core.dtype_info(dtype)["bytes"]


# The layout fields' defaults are the core's (format.h CXLKV_LAYOUT_FIELDS).
_LAYOUT_DEFAULTS = {f["name"]: f["default"] for f in _core.layout_fields()}


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What a namespace's blocks hold. Two layouts that differ in any field never share blocks.

    dense: per layer, K and V of ``num_kv_heads x head_size`` per token. ``heads_per_entry`` = k
           >= 1: an entry holds k KV heads of a block (every layer, K and V; one entry per block
           and head group, each under its own key), so that readers of any tensor-parallel size
           read exactly their heads; ``num_kv_heads`` is then the model's total (0: an entry is
           a whole block, as its writer laid it out).
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
    dtype: str = _LAYOUT_DEFAULTS["dtype"]
    num_layers: int = _LAYOUT_DEFAULTS["num_layers"]
    num_kv_heads: int = _LAYOUT_DEFAULTS["num_kv_heads"]
    head_size: int = _LAYOUT_DEFAULTS["head_size"]
    tokens_per_block: int = _LAYOUT_DEFAULTS["tokens_per_block"]
    kind: str = _LAYOUT_DEFAULTS["kind"]
    heads_per_entry: int = _LAYOUT_DEFAULTS["heads_per_entry"]
    block_bytes: int | None = None  # None: the natural size of the other fields
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_text("model_id", self.model_id)
        canonical = _core.normalize_layout(self)
        for f in ("dtype", "kind", "block_bytes"):
            object.__setattr__(self, f, canonical[f])

    @classmethod
    def from_info(cls, info: dict) -> KVLayout:
        """The layout of a ``Pool.namespaces()`` entry (or any dict holding the fields; other keys
        are ignored): the field list is the dataclass's, written once."""
        return cls(**{f.name: info[f.name] for f in dataclasses.fields(cls) if f.name in info})

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    def default_name(self) -> str:
        return f"{self.model_id}#h{self.heads_per_entry}" if self.heads_per_entry else self.model_id


SizeLike = int | str
# A pool path: one file or device, or a striped pool's devices, device 0 first (a sequence, or
# one string with the paths joined by commas).
PoolPath = str | os.PathLike[str] | list | tuple


def _path_or_default(path: PoolPath | None) -> str:
    return default_pool_path() if path is None else join_device_paths(path)


def _check_text(what: str, text: str) -> None:
    """Names are text without control characters: NUL would be cut when stored (every open then creates another namespace) and control
    characters reach operators' terminals. The core checks the bytes too; this names the field."""
    bad = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"{what} must not contain NUL or control characters (found {bad!r} in {text!r})")


class Pool:
    """One process's attachment to a pool. Use as a context manager, or call :meth:`close`."""

    def __init__(self, core: _core.Pool):
        self._core = core
        self._namespaces: dict = {}

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: PoolPath | None = None,
        size: SizeLike = DEFAULT_POOL_SIZE,
        *,
        chunk_size: SizeLike | None = None,
        stripe_size: SizeLike | None = None,
        index_slots: int | None = None,
        max_nodes: int = _create_default("max_nodes"),
        pin_slots: int | None = None,
        max_namespaces: int = _create_default("max_namespaces"),
        backend: str = _create_default("backend"),
        exist_ok: bool = False,
        lease_ms: int = _create_default("lease_ms"),
        lock_hosts: int | None = None,
        intent_permille: int = _create_default("intent_permille"),
        allow_foreign_owner: bool = False,
        allow_group: bool = False,
    ) -> Pool:
        """Create a pool (mode 0600) at ``path`` (default: :func:`default_pool_path`). With
        exist_ok, an existing pool is opened instead, under the same owner checks as :meth:`open`.
        chunk_size, index_slots, pin_slots: None lets the core derive them from the size.
        lease_ms: how long a node of another kernel may stay silent before it is judged dead
        (nodes of this kernel are judged by a kernel lock, at once). Defaults and limits:
        :func:`create_options`. A list of paths (or one string of comma-separated paths) creates
        a pool striped over those devices, stripe_size bytes at a time (None: 2 MiB); its size is
        cut to whole stripes. A stripe_size for a single path, or of 0, is a ValueError.
        lock_hosts (multihost backend only, ValueError otherwise): host rows of the lock area, the
        most hosts that can attach (None: the core's default).
        intent_permille: block-less intents (``reserve(keys, blocks=False)``) one node may hold at
        once, in thousandths of the index slots; a reserve past it reports "capped"."""
        path = _path_or_default(path)
        ensure_private_dir(path)
        core = _core.Pool.create(
            path,
            parse_size(size),
            chunk_bytes=parse_size(chunk_size) if chunk_size else _create_default("chunk_bytes"),
            index_slots=index_slots or _create_default("index_slots"),
            max_nodes=max_nodes,
            pin_slots=_create_default("pin_slots") if pin_slots is None else pin_slots,
            max_namespaces=max_namespaces,
            backend=backend,
            exist_ok=exist_ok,
            lease_ms=lease_ms,
            allow_foreign_owner=allow_foreign_owner,
            allow_group=allow_group,
            stripe_bytes=None if stripe_size is None else parse_size(stripe_size),
            lock_hosts=lock_hosts,
            intent_permille=intent_permille,
        )
        return cls(core)

    @classmethod
    def open(
        cls,
        path: PoolPath | None = None,
        *,
        populate: bool = False,
        read_only: bool = False,
        attach: bool = True,
        allow_foreign_owner: bool = False,
        allow_group: bool = False,
    ) -> Pool:
        """Attach to an existing pool. populate=True maps every page now (long-lived servers),
        instead of faulting pages in during the first copies.

        The pool must be owned by this user (or root; with allow_group, by one of our groups) and
        not writable by others: another user who can write it can read and corrupt every block.
        allow_foreign_owner=True accepts such a pool anyway. A symlink is never followed.
        read_only=True inspects without attaching (info, namespaces(), stats()): works without
        write access, no node slot is taken, namespaces cannot be opened. attach=False opens an
        observer that takes no node slot (works on a full node table; may still reclaim dead
        nodes) and cannot open namespaces: for stats, check and reap. ``path`` defaults to
        :func:`default_pool_path`."""
        path = _path_or_default(path)
        if not read_only:
            ensure_private_dir(path)
        return cls(
            _core.Pool.open(
                path,
                populate=populate,
                read_only=read_only,
                attach=attach,
                allow_foreign_owner=allow_foreign_owner,
                allow_group=allow_group,
            )
        )

    @classmethod
    def open_or_create(
        cls, path: PoolPath | None = None, size: SizeLike = DEFAULT_POOL_SIZE, **kwargs: Any
    ) -> Pool:
        return cls.create(path, size, exist_ok=True, **kwargs)

    @staticmethod
    def destroy(
        path: PoolPath | None = None, *, ignore_attached: bool = False, remove_invalid: bool = False
    ) -> None:
        """Delete a file pool, every device file of a striped pool (wipe a devdax pool's header).
        Refuses while live processes are
        attached (the error lists them) unless ignore_attached. remove_invalid=True also removes a
        regular file that is not a complete pool (0 bytes, bad magic, half-initialized)."""
        _core.Pool.destroy(
            _path_or_default(path), ignore_attached=ignore_attached, remove_invalid=remove_invalid
        )

    def close(self) -> None:
        self._namespaces.clear()
        self._core.close()

    def __enter__(self) -> Pool:
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

    def transfer_view(self):
        """The pool bytes as one writable numpy uint8 array, for a device data path (the CUDA
        transfer registers it with cudaHostRegister; docs/API.md "Device transfers"). Index it only
        at offsets of Namespace.reserve / pin_verified. It keeps the mapping alive after close()."""
        return self._core.transfer_view()

    def transfer_ranges(self, max_bytes: int, page: int = 4096) -> list:
        """(offset, length) ranges covering the pool, each <= max_bytes, cut on a page between two
        chunks (never inside a block): how a device registers the mapping in pieces."""
        return self._core.transfer_ranges(max_bytes, page)

    def info(self) -> dict:
        """Header fields, plus file_dev/file_ino: the identity of the mapped file, and
        ``stripe_bytes`` (0: not striped) and ``devices`` (index, path, pool_bytes, device_bytes,
        file_dev, file_ino per device; one for a single-device pool)."""
        return self._core.info()

    def device_usage(self) -> list:
        """Per device: pool_bytes (its share of the pool), capacity_bytes (bytes of carved blocks
        on it) and used_bytes (bytes of used blocks on it). Scans the block descriptors."""
        return self._core.device_usage()

    def namespace_usage(self) -> list:
        """Per namespace (by ``id``, as in :meth:`namespaces`): ``chunks`` carved for it,
        ``capacity_blocks`` (their blocks) and ``used_blocks`` (blocks holding data). Scans the
        block descriptors."""
        return self._core.namespace_usage()

    def file_replaced(self) -> bool:
        """True when the pool's path no longer names the mapped file (deleted or replaced)."""
        return self._core.file_replaced()

    # -- namespaces -----------------------------------------------------------------------
    def namespace(
        self,
        layout: KVLayout,
        name: str | None = None,
        *,
        device: int | None = None,
        tenant: str | None = None,
    ) -> Namespace:
        """The namespace of ``layout`` (created on first use). device=k (a striped pool): this
        handle stores its blocks on device k only (each block wholly inside a stripe of it);
        None: anywhere, interleaved. Reads find a key wherever it was stored. tenant: the quota
        label this handle's puts are charged to (docs/ARCHITECTURE.md, "Quotas"); it is not part
        of any key: two tenants with the same model share the same blocks."""
        name = name or layout.default_name()
        _check_text("namespace name", name)
        if device is not None and device < 0:
            raise ValueError(f"device must be >= 0 (or None: any device), not {device}")
        dev = -1 if device is None else device
        ten = tenant or ""
        ns = self._namespaces.get((name, layout, dev, ten))
        if ns is None:
            ns = self._core.open_namespace(name, layout, device=dev, tenant=ten)
            self._namespaces[(name, layout, dev, ten)] = ns
        return ns

    def set_quota(
        self,
        *,
        namespace: str | int | None = None,
        tenant: str | None = None,
        max_bytes: int = 0,
        max_fraction: float = 0.0,
    ) -> dict:
        """Caps the pool bytes of a namespace (its name or id) or of a tenant: max_bytes and/or
        max_fraction of the arena (the stricter applies); both 0 clear the limit. A put over it
        evicts the subject's own oldest blocks, else fails (``puts_over_quota``). Returns the row
        as :meth:`quotas` lists it."""
        if (namespace is None) == (tenant is None):
            raise ValueError("a quota names exactly one of namespace= and tenant=")
        try:
            max_bytes = operator.index(max_bytes)  # the core takes a uint64: a float or 2**64 is no size
        except TypeError:
            raise TypeError(f"max_bytes must be an integer, not {type(max_bytes).__name__}") from None
        if not 0 <= max_bytes < 1 << 64 or not 0.0 <= max_fraction <= 1.0:
            raise ValueError("max_bytes must be in [0, 2**64) and max_fraction in [0, 1]")
        ns_id = 0 if namespace is None else self.namespace_id(namespace)
        ppm = round(max_fraction * 1_000_000)
        if max_fraction > 0 and ppm == 0:
            ppm = 1
        row = self._core.set_quota(ns_id=ns_id, tenant=tenant or "", max_bytes=max_bytes, max_ppm=ppm)
        if row == 0:  # cleared a subject that never had a row: none is taken for it (rows are never freed)
            names = {n["id"]: n["name"] for n in self.namespaces()}
            return {
                "row": 0,
                "readable": True,
                "kind": "tenant" if ns_id == 0 else "namespace",
                "ns_id": ns_id,
                "tenant": tenant or "",
                "max_bytes": 0,
                "max_fraction": 0.0,
                "limit_bytes": 0,
                "usage_bytes": 0,
                "namespace": names.get(ns_id) if ns_id else None,
            }
        return next(q for q in self.quotas() if q["row"] == row)

    def clear_quota(self, *, namespace: str | int | None = None, tenant: str | None = None) -> dict:
        """Removes the limit of a namespace or tenant (its usage is still counted)."""
        return self.set_quota(namespace=namespace, tenant=tenant)

    def quotas(self) -> list[dict]:
        """Every quota row: kind ("tenant"/"namespace"), tenant or ns_id (and namespace name),
        max_bytes, max_fraction, limit_bytes (0 = none), usage_bytes, readable."""
        names = {n["id"]: n["name"] for n in self.namespaces()}
        rows = self._core.quotas()
        for q in rows:
            q["namespace"] = names.get(q["ns_id"]) if q["kind"] == "namespace" else None
        return rows

    def namespace_id(self, namespace: str | int) -> int:
        """The id of a namespace given by name or id; ValueError if the pool has none such."""
        for n in self.namespaces():
            if namespace in (n["id"], n["name"]) or str(namespace) == str(n["id"]):
                return int(n["id"])
        raise ValueError(f"pool {self.path} has no namespace {namespace!r}")

    def namespaces(self) -> list:
        return self._core.namespaces()

    def token_store(
        self,
        layout: KVLayout,
        *,
        max_tokens_per_seq: int,
        indexer: bool = False,
        placement: str | None = "request",
    ) -> TokenStore:
        """Token-addressable, layer-first rows of ``layout`` (docs/API.md, "Token store"):
        ``append(seq_key, rows)``, ``gather(seq_key, layer, indices, out)``,
        ``gather_layers(seq_key, indices, out)``. indexer=True adds ``.indexer``, the DeepSeek-V3.2
        indexer cache as a second stream of the same sequences. placement="request": on a striped
        pool each sequence on one device, sequences spread over devices; None: interleaved."""
        return open_token_store(self, layout, max_tokens_per_seq, indexer, placement)

    # -- observability --------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters summed over attached processes, plus block occupancy of the whole pool."""
        s = self._core.counters()
        lookups = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / lookups if lookups else 0.0
        s["namespaces"] = len(self.namespaces())
        return s

    def check(self, repair: bool = False, wait: float | None = 0.0) -> dict:
        """Reclaims what dead processes left, then verifies every invariant of the format.
        Nodes of another kernel are judged by their heartbeat lease: ``wait`` seconds are spent
        watching those not judged yet (``None``: up to a lease and a quarter, as ``cxlkv pool
        check`` does); any still undecided make the report fail (``undecided_nodes``).
        repair=True also releases what nobody else ever would (entries whose writer is gone,
        condemned blocks no pin holds, leaked blocks of gone writers, lock rows no host owns),
        each listed in ``repaired`` (one line each) instead of ``errors``."""
        if wait is not None and not wait >= 0:
            raise ValueError(f"wait must be >= 0 seconds or None, got {wait}")
        return self._core.check(repair, -1 if wait is None else int(wait * 1000))

    def reap_dead_nodes(self) -> int:
        """Reclaims every node judged dead now; returns how many."""
        return self._core.reap_dead_nodes()

    def nodes(self) -> list:
        """Every attached node slot with its liveness verdict and evidence (see ARCHITECTURE.md,
        Liveness): judged by the kernel lock on this kernel, by the heartbeat lease otherwise."""
        return self._core.nodes()

    def reap_node(self, node: int, *, force: bool = False, wait: float = 0.0) -> dict:
        """Reclaims one node if it is dead (waiting up to a lease to judge a node of another
        kernel). ``wait`` (seconds): keep watching a node judged alive or undecided until it is
        dead (then reclaim it) or the time is up. force=True reclaims it even if alive: its
        process is fenced and its next operation fails. Returns the judgment, with ``reclaimed``."""
        if not wait >= 0:
            raise ValueError(f"wait must be >= 0 seconds, got {wait}")
        return self._core.reap_node(node, force, int(wait * 1000))

    def __repr__(self) -> str:
        if self.closed:
            return "<cxlkv.Pool closed>"
        return f"<cxlkv.Pool {self.path} {format_size(self.size)} node={self.node_id} backend={self.backend}>"
