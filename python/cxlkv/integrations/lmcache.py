"""cxlkv as an L2 adapter of LMCache's multiprocess server (LMCache >= 0.5.6).

    lmcache server ... --l2-adapter '{"type": "native_plugin",
        "module_path": "cxlkv.integrations.lmcache", "class_name": "CxlKVL2Connector",
        "adapter_params": {"pool_path": "/dev/shm/cxlkv-1000/pool"}}' --l2-adapter <remote>

LMCache's ``native_plugin`` type wraps the object named here in its ``NativeConnectorL2Adapter``:
this class is the "native client" it drives (``event_fd``, ``submit_batch_get/set/exists/delete``,
``drain_completions``, ``close``). LMCache serialises each ``ObjectKey`` as
``model@kv_rank_hex@object_group_hex@chunk_hash_hex[@cache_salt]`` and hands the bytes of an L1
memory object (one chunk of KV in LMCache's own format) as a memoryview; the submit calls return
at once and one worker thread copies between those views and the pool.

Identity (docs/IDENTITY.md, docs/INTEGRATIONS.md): the namespace is derived from

* the identity the *engine* derived and sent in the key's ``model`` field (``cxlkv-kv1.<sha256>``,
  lmcache_identity.py): the weights it loaded, the config as it parsed it, the KV dtype and
  scales, quantization, compute dtype, device and backend. vLLM's stock LMCacheMPConnector sends
  ``model_config.model``, a name the server cannot tie to bytes (another host, another
  ``--revision``, overrides): such keys are refused (never stored, always a miss; logged once);
  the engine must run cxlkv's ``CxlKVLMCacheMPConnector`` (lmcache_vllm.py);
* ``kv_rank`` (LMCache packs the TP/PP rank and world size into it) and the object group
  (hybrid models), which say which slice of the KV the bytes are;
* the object's size in bytes (LMCache's chunk geometry) and, when the operator states it
  (``kv_dtype``), the KV dtype (the engine's identity covers it already).

Inside it a block's key is sha256(version | cache_salt | chunk_hash): the chunk hash chains the
token ids of the whole prefix (LMCache computes it), and the salt keeps tenants apart.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cxlkv
from cxlkv.errors import ClosedError, CxlkvError
from cxlkv.integrations import identity as ident
from cxlkv.integrations.lmcache_identity import weights_of_model_field
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.tenant import tenant_of

log = logging.getLogger("cxlkv.lmcache")

KEY_VERSION = b"cxlkv/lmcache/v1"
DEVICE_LAYOUT = "lmcache-mp-l1-object/v1"  # LMCache's L1 memory object, byte for byte
NAMESPACE_LIST_TTL_S = 1.0  # how stale the list of namespaces may be before a miss re-reads it
MAX_CHUNK_HASH_BYTES = 64
MAX_OBJECT_BYTES = 1 << 34


@dataclass(frozen=True)
class LMCacheKey:
    """One parsed ``ObjectKey`` string (the serialisation of LMCache 0.5.6's
    ``native_connector_l2_adapter._object_key_to_string``)."""

    model: str
    kv_rank: int
    group: int
    chunk_hash: bytes
    cache_salt: str

    @classmethod
    def parse(cls, text: str) -> LMCacheKey:
        parts = text.split("@")
        if len(parts) not in (4, 5) or not parts[0]:
            raise ValueError(f"not an LMCache object key: {text[:120]!r}")
        try:
            kv_rank, group, chunk = int(parts[1], 16), int(parts[2], 16), bytes.fromhex(parts[3])
        except ValueError:
            raise ValueError(f"not an LMCache object key: {text[:120]!r}") from None
        if not chunk or len(chunk) > MAX_CHUNK_HASH_BYTES or kv_rank < 0 or group < 0:
            raise ValueError(f"not an LMCache object key: {text[:120]!r}")
        return cls(parts[0], kv_rank, group, chunk, parts[4] if len(parts) == 5 else "")

    def pool_key(self) -> bytes:
        """The 32-byte key inside the namespace (which covers model, rank and group)."""
        h = hashlib.sha256(KEY_VERSION)
        salt = self.cache_salt.encode()
        h.update(len(salt).to_bytes(4, "little") + salt)
        h.update(len(self.chunk_hash).to_bytes(4, "little") + self.chunk_hash)
        return h.digest()


class CxlKVL2Connector:
    """LMCache's native connector protocol over one cxlkv pool (thread-safe: LMCache submits
    from its event loop, drains from its demux thread).

    adapter_params: ``pool_path`` (default: cxlkv's default pool), ``pool_size`` (create the pool
    with this size if it does not exist; default: it must exist), ``kv_dtype`` (optional, see the
    module docstring), ``tenant`` (optional: the quota label its stores are charged to,
    ``cxlkv pool quota``; not part of any key)."""

    def __init__(
        self,
        pool_path: str | None = None,
        pool_size: str | int | None = None,
        kv_dtype: str | None = None,
        tenant: str | None = None,
    ) -> None:
        self._path = str(pool_path or cxlkv.default_pool_path())
        self._tenant = tenant_of({"tenant": tenant})
        self._size = pool_size
        self._kv_dtype = ident.canonical_dtype(kv_dtype) if kv_dtype else "bytes"
        self._session = PoolSession(
            self._path, log, self._open_pool, lambda pool: pool, who="lmcache-l2", fail_fast=True
        )
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list[tuple[int, bool, str, list[bool] | None]] = []
        self._done_lock = threading.Lock()
        self._next_id = 0
        self._id_lock = threading.Lock()
        # worker-thread state: namespace handles of the current attachment, the pool's listing
        self._ns: dict[str, Any] = {}
        self._ns_pool: Any = None
        self._listing: list[dict] = []
        self._listing_at = 0.0
        self._warned: set[str] = set()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="cxlkv-lmcache-l2", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ LMCache's protocol
    def event_fd(self) -> int:
        return self._efd

    def submit_batch_set(self, keys: list[str], views: list[Any]) -> int:
        return self._submit("set", keys, views)

    def submit_batch_get(self, keys: list[str], views: list[Any]) -> int:
        return self._submit("get", keys, views)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit("exists", keys, None)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("delete", keys, None)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        with self._id_lock:  # after close() the descriptor's number may name another file
            if not self._closed:
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Idempotent; a submit after it raises ClosedError. Jobs submitted before it complete."""
        with self._id_lock:  # a racing submit enqueues before the stop marker or not at all
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._worker.join(timeout=30)
        self._session.close()
        os.close(self._efd)

    # ------------------------------------------------------------------ the worker
    def _submit(self, op: str, keys: list[str], views: list[Any] | None) -> int:
        if views is not None and len(views) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
        with self._id_lock:
            if self._closed:
                raise ClosedError(f"cxlkv lmcache L2: submit_batch_{op} after close()")
            self._next_id += 1
            fid = self._next_id
            self._jobs.put((fid, op, list(keys), views))
        return fid

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._complete(*job)

    def _complete(self, fid: int, op: str, keys: list[str], views: list[Any] | None) -> None:
        try:
            results = self._session.call(
                f"lmcache {op}", functools.partial(self._batch, op=op, keys=keys, views=views)
            )
            ok, error = results is not None, "" if results is not None else "cxlkv pool unusable"
            results = results if results is not None else [False] * len(keys)
            if op == "set":
                ok = ok and all(results)
                error = error or ("" if ok else f"{results.count(False)} of {len(keys)} not stored")
        except Exception as e:
            log.exception("cxlkv lmcache %s failed", op)
            ok, error, results = False, f"{type(e).__name__}: {e}", [False] * len(keys)
        with self._done_lock:
            self._done.append((fid, ok, error, results))
        os.eventfd_write(self._efd, 1)

    def _batch(self, pool: Any, op: str, keys: list[str], views: list[Any] | None) -> list[bool]:
        if pool is not self._ns_pool:  # a new attachment (first call, or after a fence)
            self._ns, self._ns_pool, self._listing_at = {}, pool, 0.0
        out = []
        # One identity per (model, rank, group) of the batch, not per key (a batch is one model).
        prefixes: dict[tuple, Callable[[int], ident.KVIdentity]] = {}
        for i, text in enumerate(keys):
            try:
                key = LMCacheKey.parse(text)
                which = (key.model, key.kv_rank, key.group)
                prefix = prefixes.get(which) or prefixes.setdefault(which, self._identity_prefix(key))
            except ValueError as e:  # not a key, or a model field that is a name (UntrustedModelNameError)
                self._warn_once(str(e))
                out.append(False)
                continue
            if op == "set":
                view = memoryview(views[i]).cast("B")  # type: ignore[index]
                ns = self._namespace(pool, prefix, view.nbytes, create=True)
                out.append(ns is not None and bool(ns.put(key.pool_key(), view)))
            elif op == "get":
                view = memoryview(views[i]).cast("B")  # type: ignore[index]
                ns = self._namespace(pool, prefix, view.nbytes, create=False)
                out.append(ns is not None and bool(ns.get(key.pool_key(), view, whole=True)))
            else:
                out.append(self._any_namespace(pool, prefix, op, key.pool_key()))
        return out

    def _any_namespace(self, pool: Any, prefix: Callable[[int], ident.KVIdentity], op: str, k: bytes) -> bool:
        """exists/delete know no size: ask every namespace of this identity (one per size)."""
        for attempt in range(2):
            hit = False
            for size in self._sizes(pool, prefix, refresh=attempt == 1):
                ns = self._namespace(pool, prefix, size, create=False)
                if ns is not None and (ns.contains(k) if op == "exists" else ns.delete(k)):
                    hit = True
            if hit or time.monotonic() - self._listing_at < NAMESPACE_LIST_TTL_S:
                return hit
        return False

    # ------------------------------------------------------------------ identity -> namespace
    def _identity_prefix(self, key: LMCacheKey) -> Callable[[int], ident.KVIdentity]:
        weights = weights_of_model_field(key.model)  # UntrustedModelNameError for a plain name
        source = f"LMCache engine identity {key.model[:26]}"

        def at(size: int) -> ident.KVIdentity:
            return ident.KVIdentity(
                weights=weights,
                dtype=self._kv_dtype,
                kind="opaque",
                num_layers=1,
                num_kv_heads=1,
                head_size=1,
                block_size=1,
                device_layout=f"{DEVICE_LAYOUT} kv_rank={key.kv_rank:08x} group={key.group}",
                block_bytes=size,
                weights_source=source,
            )

        return at

    def _sizes(self, pool: Any, prefix: Callable[[int], ident.KVIdentity], refresh: bool) -> list[int]:
        """Object sizes this identity has namespaces for: the listing's candidates, each verified
        by recomputing its name from the identity (the pool's text never decides a match)."""
        if refresh or not self._listing_at:
            self._listing, self._listing_at = pool.namespaces(), time.monotonic()
        model_id = prefix(1).model_id()
        sizes = []
        for info in self._listing:
            size = info.get("block_bytes")
            if info.get("model_id") != model_id or not isinstance(size, int):
                continue
            if 0 < size <= MAX_OBJECT_BYTES and info.get("name") == prefix(size).namespace_name():
                sizes.append(size)
        return sizes

    def _namespace(
        self, pool: Any, prefix: Callable[[int], ident.KVIdentity], size: int, create: bool
    ) -> Any:
        identity = prefix(size)
        name = identity.namespace_name()
        ns = self._ns.get(name)
        if ns is not None:
            return ns
        if not create and name not in {i.get("name") for i in self._listing}:
            self._listing, self._listing_at = pool.namespaces(), time.monotonic()
            if name not in {i.get("name") for i in self._listing}:
                return None
        layout = cxlkv.KVLayout(
            model_id=identity.model_id(),
            dtype=identity.dtype,
            num_layers=1,
            num_kv_heads=1,
            head_size=1,
            tokens_per_block=1,
            kind="opaque",
            block_bytes=size,
            source=identity.source(),
        )
        try:
            ns = pool.namespace(layout, name, tenant=self._tenant)
        except CxlkvError as e:  # full namespace table, a layout clash: this size is not cached
            self._warn_once(f"cxlkv namespace for LMCache objects of {size} bytes: {e}")
            return None
        self._ns[name] = ns
        return ns

    def _open_pool(self, create: bool) -> Any:
        if create and self._size is not None:
            return cxlkv.Pool.open_or_create(self._path, self._size)
        return cxlkv.Pool.open(self._path)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned and len(self._warned) < 256:
            self._warned.add(message)
            log.warning("cxlkv lmcache L2: %s", message)
