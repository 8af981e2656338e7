"""cxlkv as an SGLang HiCache storage backend (the L3 tier behind SGLang's host pool).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "cxlkv", "module_path": "cxlkv.integrations.sglang",
          "class_name": "CxlKVHiCacheStorage", "interface_v1": 1,
          "pool_path": "/dev/shm/cxlkv-1000/pool", "model_path": "/models/x"}'

``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1`` / ``batch_set_v1`` with the
host pool's token indices: one SGLang page is one cxlkv block, gathered from (and scattered into)
SGLang's host buffer by the core's copy engine, with no intermediate tensor. ``batch_exists``
returns the leading run of pages present (``match_prefix``).

Sharing with vLLM (docs/IDENTITY.md, "Across engines"): an MLA host pool (bf16/fp16/fp32 latent
rows of kv_lora_rank + rope, layouts ``layer_first``, ``page_first``, ``page_first_direct``) is
stored as one entry per page, per layer the page's latent rows, as vLLM CPU's MLA block; an MHA host pool in the layouts
``layer_first``, ``page_first``, ``page_first_direct`` or ``page_head``, with bf16/fp16/fp32 KV,
one pipeline stage, no context parallelism and ``interface_v1`` is stored in the engine-neutral
namespace (identity.shared_identity: the weights by content, dtype, layers, the model's KV heads,
head size, page size) as one entry per page and KV head, converted at copy time from SGLang's
layout by a strided view (per layer: the head's K rows of the page's tokens, then its V rows:
what the vLLM connector stores). Its key is SGLang's page hash itself: the vLLM connector computes the
same chain from the tokens (keys.py), so a prefix either engine stored is found by the other. Every other pool (``page_unified``, packed fp8 latents, pipeline or context
parallel, fp8, the tensor interface) keeps the SGLang-only namespace below, and logs why.

SGLang-only namespace (docs/IDENTITY.md): derived from the weights ``model_path`` (default:
SGLang's ``model_name``) names on this host, by content (external_identity.py), and from
everything SGLang's page key does not cover: KV dtype, layer/head geometry, page size, TP rank
(MLA pools are replicated across ranks: one shared slice), pipeline stage and its layers,
context-parallel rank, the host pool's class, byte layout and storage format tag. Inside it a
page's key is sha256(version | SGLang's page hash): the hash chains the token ids of the whole
prefix and is seeded with the request's ``extra_key`` (LoRA) and ``cache_salt``.

Thread-safe: SGLang's prefetch and backup threads call concurrently; pool calls are serialised by
one lock (the copies are memory-bound; the lock also guards re-attachment after a fence).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

import cxlkv
from cxlkv.errors import ClosedError
from cxlkv.integrations import identity as ident
from cxlkv.integrations import keys as shared_keys
from cxlkv.integrations.external_identity import resolve_model_dir, weights_of
from cxlkv.integrations.heads import HeadNamespace, HeadPlan, block_before_tail
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.tenant import tenant_of

log = logging.getLogger("cxlkv.sglang")

KEY_VERSION = b"cxlkv/sglang/v1"


def pool_key(page_hash: str) -> bytes:
    return hashlib.sha256(KEY_VERSION + page_hash.encode()).digest()


class UnsupportedHostPoolError(TypeError):
    """A host pool whose page is not one gatherable block (layout or class cxlkv does not map)."""


def page_view(host_pool: Any) -> tuple[torch.Tensor, int]:
    """(view, block_dim): SGLang's host buffer as ``[..., page, ...rest]`` so that the pieces
    ``view[..., p, ...]`` (every index of the dims before block_dim) are exactly page p's bytes,
    the same pieces ``get_page_buffer_meta`` lists. Zero-copy: a view of ``kv_buffer``."""
    buf, layout, pages = host_pool.kv_buffer, host_pool.layout, host_pool.page_num
    if not buf.is_contiguous():
        raise UnsupportedHostPoolError(f"{type(host_pool).__name__}: kv_buffer is not contiguous")
    mha = buf.dim() >= 1 and buf.shape[0] == 2 and buf.dim() in (5, 6)
    lead = (2,) if mha else ()
    if layout == "layer_first":
        return buf.view(*lead, host_pool.layer_num, pages, -1), len(lead) + 1
    if layout in ("page_first", "page_first_direct") or (mha and layout == "page_head"):
        return buf.view(*lead, pages, -1), len(lead)
    raise UnsupportedHostPoolError(f"{type(host_pool).__name__}: layout {layout!r} is not supported by cxlkv")


SHARED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
SHARED_MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mla_entry_view(host_pool: Any) -> torch.Tensor:
    """SGLang's MLA host buffer as ``[page, layer, token, latent]`` (a strided view, no copy):
    ``view[p]`` read in order is the engine-neutral entry of page p (vLLM CPU's MLA block). The
    copies take it with the page dim moved before its contiguous tail (heads.block_before_tail)."""
    buf = host_pool.kv_buffer
    pages, n, layers, dim = (
        host_pool.page_num,
        host_pool.page_size,
        host_pool.layer_num,
        host_pool.kv_cache_dim,
    )
    layout = host_pool.layout
    if layout == "layer_first":  # [layer, token, 1, latent]
        return buf.view(layers, pages, n, dim).permute(1, 0, 2, 3)
    if layout == "page_first":  # [token, layer, 1, latent]
        return buf.view(pages, n, layers, dim).permute(0, 2, 1, 3)
    if layout == "page_first_direct":  # [page, layer, token, 1, latent]
        return buf.view(pages, layers, n, dim)
    raise UnsupportedHostPoolError(f"{type(host_pool).__name__}: layout {layout!r} has no latent view")


def entry_view(host_pool: Any) -> torch.Tensor:
    """SGLang's MHA host buffer as ``[page, head, layer, k/v, token, dim]`` (a strided view, no
    copy): ``view[p, h]`` read in order is the engine-neutral entry of page p and KV head h."""
    buf = host_pool.kv_buffer
    pages, n, layers = host_pool.page_num, host_pool.page_size, host_pool.layer_num
    heads, dim = host_pool.head_num, host_pool.head_dim
    layout = host_pool.layout
    if layout == "layer_first":  # [2, layer, token, head, dim]
        return buf.view(2, layers, pages, n, heads, dim).permute(2, 4, 1, 0, 3, 5)
    if layout == "page_first":  # [2, token, layer, head, dim]
        return buf.view(2, pages, n, layers, heads, dim).permute(1, 4, 3, 0, 2, 5)
    if layout == "page_first_direct":  # [2, page, layer, token, head, dim]
        return buf.permute(1, 4, 2, 0, 3, 5)
    if layout == "page_head":  # [2, page, head, token, layer, dim]
        return buf.permute(1, 2, 4, 0, 3, 5)
    raise UnsupportedHostPoolError(f"{type(host_pool).__name__}: layout {layout!r} has no per-head view")


def why_not_shared(host: Any, c: HiCacheStorageConfig, extra: dict) -> str | None:
    """Why this host pool's pages cannot go to the engine-neutral namespace (None: they can)."""
    dtype = ident.canonical_dtype(host.dtype)
    mla = bool(c.is_mla_model)
    host_class, layouts = (
        ("MLATokenToKVPoolHost", SHARED_MLA_LAYOUTS) if mla else ("MHATokenToKVPoolHost", SHARED_LAYOUTS)
    )
    checks = [
        (extra.get("share_engines", True) is False, "share_engines is false"),
        (
            not extra.get("interface_v1"),
            "the tensor interface moves pages in SGLang's own layout (set interface_v1)",
        ),
        (type(host).__name__ != host_class, f"host pool class {type(host).__name__}"),
        (host.layout not in layouts, f"host layout {host.layout!r}"),
        (dtype not in ident.SHARED_DTYPES, f"KV dtype {dtype} (scaled or quantized)"),
        (bool(host.storage_format_tag), f"storage format {host.storage_format_tag!r}"),
        (c.pp_size != 1, "pipeline parallelism (a page holds a stage's layers)"),
        (c.attn_cp_size != 1 or c.dcp_size != 1, "context parallelism"),
        (bool(c.should_split_heads), "tp_lcm_size head splitting"),
    ]
    if mla:
        checks += [
            (bool(getattr(host, "dsa_kv_cache_store_fp8", False)), "a packed fp8 latent"),
            (
                host.kv_cache_dim != host.kv_lora_rank + host.qk_rope_head_dim,
                f"a latent row of {host.kv_cache_dim} elements (not kv_lora_rank + rope)",
            ),
        ]
    elif getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
        checks.append((True, "K and V head sizes differ"))
    return next((why for bad, why in checks if bad), None)


def total_kv_heads(model: str, host: Any, c: HiCacheStorageConfig, extra: dict) -> int:
    """The model's KV heads: the extra config's ``num_kv_heads``, else config.json's, else this
    rank's times the TP size."""
    if extra.get("num_kv_heads"):
        return int(extra["num_kv_heads"])
    try:
        root = resolve_model_dir(model)
        cfg = json.loads((root / "config.json").read_text()) if root.is_dir() else {}
        n = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
        if n:
            return int(n)
    except (OSError, ValueError, LookupError):
        pass
    return int(host.head_num) * int(c.tp_size)


class CxlKVHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage in a cxlkv pool. extra_config: ``pool_path`` (default: cxlkv's
    default pool), ``pool_size`` (create it if missing), ``model_path`` (the weights; default
    SGLang's model_name), ``tenant`` (the quota label its stores are charged to, ``cxlkv pool
    quota``; not part of any key)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self._path = str(extra.get("pool_path") or cxlkv.default_pool_path())
        self._size = extra.get("pool_size")
        self._tenant = tenant_of(extra)
        model = extra.get("model_path") or storage_config.model_name
        if not model:
            raise ValueError("cxlkv HiCache storage: no model_path in the extra config and no model_name")
        self._model, self._extra = str(model), extra
        if extra.get("model_id"):  # the operator's name for the weights, as the vLLM connector's
            self._weights, self._weights_source = "model_id:" + str(extra["model_id"]), "operator model_id"
        else:
            self._weights, self._weights_source = weights_of(str(model))  # UnresolvableModelError: clear
        self._key: Callable[[str], bytes] = pool_key
        self.shared = False
        self._lock = threading.Lock()
        self._closed = False
        self._session: PoolSession | None = None
        self._view: torch.Tensor | None = None
        self._block_dim = 0
        self.identity: ident.KVIdentity | None = None

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        why = why_not_shared(mem_pool_host, self.config, self._extra)
        wrap: Callable[[Any], Any] = lambda ns: ns  # noqa: E731
        if why is None:
            self.identity = self._shared_identity(mem_pool_host)
            name = self.identity.namespace_name()
            key: Callable[[str], bytes] = shared_keys.page_key
            if self.config.is_mla_model:  # one latent entry per page, written by rank 0
                plan = HeadPlan.replicated(self.config.tp_size, self.config.tp_rank)
                (view,), block_dim = block_before_tail([mla_entry_view(mem_pool_host)], 0)
                wrap = functools.partial(HeadNamespace, plan=plan)
            else:
                plan = HeadPlan(self.identity.num_kv_heads, self.config.tp_size, self.config.tp_rank)
                view, block_dim = entry_view(mem_pool_host), 0
                wrap = functools.partial(HeadNamespace, plan=plan, head_dim=1)
        else:
            log.info("cxlkv: SGLang pages stay in an SGLang-only namespace (not shared with vLLM): %s", why)
            view, block_dim = page_view(mem_pool_host)
            self.identity = self._identity(mem_pool_host, view, block_dim)
            name = self.identity.namespace_name()
            key = pool_key
        layout = cxlkv.KVLayout(
            model_id=self.identity.model_id(),
            dtype=self.identity.dtype,
            num_layers=self.identity.num_layers,
            num_kv_heads=self.identity.num_kv_heads,
            head_size=self.identity.head_size,
            tokens_per_block=self.identity.block_size,
            kind=self.identity.kind,
            heads_per_entry=self.identity.heads_per_entry,
            block_bytes=self.identity.block_bytes,
            source=self.identity.source(),
        )
        with self._lock:
            if self._closed:
                raise ClosedError("cxlkv HiCache storage: register_mem_pool_host after close()")
            self._view, self._block_dim, self._key, self.shared = view, block_dim, key, why is None
            self._session = PoolSession(
                self._path,
                log,
                self._open_pool,
                lambda pool: wrap(pool.namespace(layout, name, tenant=self._tenant)),
                who="sglang-hicache",
                fail_fast=True,
            )

    def _shared_identity(self, host: Any) -> ident.KVIdentity:
        if self.config.is_mla_model:
            return ident.shared_identity(
                self._weights, self._weights_source, host.dtype, host.layer_num, 1, host.kv_cache_dim,
                host.page_size, kind="mla",
            )  # fmt: skip
        return ident.shared_identity(
            self._weights,
            self._weights_source,
            host.dtype,
            host.layer_num,
            total_kv_heads(self._model, host, self.config, self._extra),
            host.head_dim,
            host.page_size,
        )

    def _identity(self, host: Any, view: torch.Tensor, block_dim: int) -> ident.KVIdentity:
        c = self.config
        mla = bool(c.is_mla_model)
        page_bytes = 1
        for i, n in enumerate(view.shape):
            if i != block_dim:
                page_bytes *= n
        page_bytes *= view.element_size()
        if not mla and getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
            raise UnsupportedHostPoolError(f"{type(host).__name__}: K and V head sizes differ")
        if c.should_split_heads:
            raise UnsupportedHostPoolError("tp_lcm_size head splitting is not supported by cxlkv")
        head_size = host.kv_cache_dim if mla else host.head_dim
        layout = (
            f"sglang/{type(host).__name__}/{host.layout}/pp{c.pp_rank}of{c.pp_size}"
            f"/layers{host.start_layer}-{host.end_layer}/cp{c.attn_cp_rank}of{c.attn_cp_size}"
            f"/dcp{c.dcp_rank}of{c.dcp_size}/{host.storage_format_tag or '-'}/{sys.byteorder}"
        )
        if not mla:  # a page holds this rank's slice of the KV heads: the slice is the layout
            layout += f"/tp{c.tp_rank}of{c.tp_size}"
        return ident.KVIdentity(
            weights=self._weights,
            dtype=ident.canonical_dtype(host.dtype),
            kind="mla" if mla else "dense",
            num_layers=host.layer_num,
            num_kv_heads=1 if mla else host.head_num,
            head_size=head_size,
            block_size=host.page_size,
            device_layout=layout,
            block_bytes=page_bytes,
            weights_source=self._weights_source,
        )

    def _open_pool(self, create: bool) -> Any:
        if create and self._size is not None:
            return cxlkv.Pool.open_or_create(self._path, self._size)
        return cxlkv.Pool.open(self._path)

    # ------------------------------------------------------------------ zero-copy interface
    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        page = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * page:
            raise ValueError(f"{len(keys)} keys but {host_indices.numel()} host indices (page size {page})")
        firsts = host_indices.reshape(len(keys), page)[:, 0].tolist()
        if any(i % page for i in firsts):
            raise ValueError("host indices do not start on page boundaries")
        return [i // page for i in firsts]

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        # Checked under the lock close() takes: a call racing close() sees either the open
        # session or the closed flag, never a session being torn down.
        with self._lock:
            if self._closed:
                raise ClosedError(f"cxlkv HiCache storage: {what} after close()")
            if self._session is None:
                raise RuntimeError("cxlkv HiCache storage: register_mem_pool_host was not called")
            return self._session.call(what, fn)

    def _copy(self, op: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        pages = self._pages(keys, host_indices)
        pkeys = [self._key(k) for k in keys]

        def run(ns: Any) -> int:
            copy = ns.store if op == "store" else ns.load
            return int(copy(pkeys, [self._view], pages, block_dim=self._block_dim))

        done = self._call(f"sglang {op}", run) or 0
        return [i < done for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._copy("store", keys, host_indices)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._copy("load", keys, host_indices)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        pkeys = [self._key(k) for k in keys]
        return int(self._call("sglang exists", lambda ns: ns.match_prefix(pkeys)) or 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ tensor interface (interface_v1 off)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None:
            raise ValueError("cxlkv HiCache storage: get needs a target_location tensor")
        self._tensor_interface("get")
        out = target_location.view(-1).view(torch.uint8).numpy()
        ok = self._call("sglang get", lambda ns: ns.get(pool_key(key), out, whole=True))
        return target_location if ok else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._tensor_interface("set")
        src = value if value is not None else target_location
        data = src.contiguous().view(-1).view(torch.uint8).numpy()
        return bool(self._call("sglang set", functools.partial(_put, key=pool_key(key), data=data)))

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        srcs = values if values is not None else target_locations
        stored = [self.set(k, v) for k, v in zip(keys, srcs, strict=True)]  # every one, not up to a failure
        return all(stored)

    def _tensor_interface(self, what: str) -> None:
        if self.shared and not self._closed:  # SGLang calls it only with interface_v1 off
            raise UnsupportedHostPoolError(
                f"cxlkv HiCache storage: {what} of a whole page in a shared namespace"
            )

    def close(self) -> None:
        """Releases the pool; idempotent. Any call after it raises ClosedError."""
        with self._lock:
            self._closed = True
            if self._session is not None:
                self._session.close()
                self._session = None


def _put(ns: Any, key: bytes, data: Any) -> bool:
    return bool(ns.put(key, data))
