"""cxlkv as a vLLM v1 KV connector: every vLLM instance attached to one pool reuses the KV of
prefixes any of them computed, with no server on the path.

Use it with unmodified vLLM::

    --kv-transfer-config '{"kv_connector": "CxlKVConnector",
                           "kv_connector_module_path": "cxlkv.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool_path": "/dev/shm/cxlkv",
                                                         "pool_size": "4GiB"}}'

Roles: ``kv_both`` (shared prefix cache), ``kv_producer`` (a prefill instance: saves, never
loads) and ``kv_consumer`` (a decode instance: loads, never saves).

Identity: the namespace is derived from what determines the KV bytes (the weights by content,
the KV layout, dtype and scales, quantization, block size, TP rank, device layout: see
identity.py and docs/IDENTITY.md), never from the served alias. LoRA adapters enter the keys by
content; prompt embeddings by their digest.

Scheduler side: ``get_num_new_matched_tokens`` asks the in-pool index directly (``acquire``: a
lookup that also pins the matched blocks, so they cannot be evicted before the worker loads
them); the lease is released once the step that loads them has completed, or when the request
ends. Worker side: ``start_load_kv`` scatters the matched blocks into vLLM's paged KV buffers
before the forward pass; ``wait_for_save`` submits the blocks that became full to a transfer
thread (transfer.py) and returns: the step never waits for a save. The blocks stay owned by the
request until their copy is done (``request_finished`` delays their free, ``get_finished``
reports the request once its copies are done, preempted requests' copies are waited for before
the next forward: save_tracker.py), and the pool publishes a block only once its bytes and
checksum are complete.

A block that fails to load (evicted meanwhile, checksum mismatch) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it. Saves never publish KV computed on top
of a load that has not been confirmed: while a request has a load in flight, the saves planned
for it are held; they go out once the load's step completed without errors, and are dropped when
it failed (the blocks from the first failed one on are saved again after vLLM recomputes them).

A pool that fails (truncated, deleted or replaced file, any error from the core) turns the
process into "no cache" with one log line (pool_guard.py); the engine keeps serving. A node that
was fenced (the engine paused past the pool's lease, or reaped by force) is not a failed pool: the
connector opens the pool again as a new node, logs it once and keeps using the cache
(pool_session.py).

Extra config keys: ``pool_path`` (default: ``cxlkv.default_pool_path()``, i.e. ``$CXLKV_POOL`` or
/dev/shm/cxlkv-<uid>/pool; a comma-separated string or a list of paths: a striped pool),
``pool_device`` (a striped pool: store on this device, or ``"tp_rank"``: rank modulo the device
count; default: interleaved, see placement.py), ``pool_size`` (used when the pool does not exist yet, default 4GiB),
``chunk_size``, ``model_id`` (replaces the weights' content digest in the identity: for operators
who know two checkpoints are the same), ``namespace`` (overrides the namespace name entirely),
``weights_identity`` ("loaded", the default: every byte of the weights, hashed by the workers and
adopted by the scheduler side through vLLM's handshake; "sampled": the sampled file digest only),
``file_check_interval_s`` (default 0.001), ``async_saves`` (true, the default: no step waits
for a save; false: each step waits for its own), ``on_pool_error`` ("degrade": a pool that cannot be
opened means serving without the cache, the default; "fail": refuse to start), ``coalesce``
(default true) and ``coalesce_wait_s`` (default 30): a new prefix requested from several engines
at once is computed by one of them while the others wait for its blocks (coalesce.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

import cxlkv
from cxlkv.integrations import identity as ident
from cxlkv.integrations import loaded_weights as lw
from cxlkv.integrations import vllm_metrics
from cxlkv.integrations.coalesce import STAT_KEYS as COALESCE_STAT_KEYS
from cxlkv.integrations.coalesce import CoalesceConfig, CoalesceScheduler, CoalesceWorker
from cxlkv.integrations.keys import ChainedKeys, MMSpan, root_key
from cxlkv.integrations.placement import placement_device
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.save_tracker import SaveTracker, async_saves_enabled
from cxlkv.integrations.transfer import BlockOp, CpuSaveHandle, CpuTransfer, Transfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under the "vllm" logger, so that vLLM's logging configuration (level, format) applies.
logger = init_logger("vllm.cxlkv")

STAT_KEYS = (
    "load_blocks",
    "load_failed_blocks",
    "load_bytes",
    "load_s",
    "save_blocks",
    "save_failed_blocks",
    "save_bytes",
    "save_s",
    "saves_dropped_after_failed_load",
    "saves_waited_at_preemption",
    "pin_capped_requests",
    "pin_capped_blocks",
    "uncacheable_requests",
    "pool_disabled",
    "pool_fenced",
    "lookup_tokens",
    "hit_tokens",
    "load_failed_unavailable_blocks",
    *COALESCE_STAT_KEYS,
)


@dataclasses.dataclass
class CxlKVConnectorMetadata(KVConnectorMetadata):
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    # Requests preempted by this step's schedule: their blocks may be reused by its forward.
    preempted: set = dataclasses.field(default_factory=set)
    # Scheduler-side counters of this step, reported by the worker (vLLM collects stats there).
    counters: dict = dataclasses.field(default_factory=dict)
    # Requests waiting for blocks another engine computes (coalesce.py), sent once.
    waits: list = dataclasses.field(default_factory=list)
    idle: bool = False  # nothing scheduled this step


@dataclasses.dataclass
class CxlKVStats(KVConnectorStats):
    """Per-interval counters of the connector, aggregated by vLLM's stats logger."""

    def __post_init__(self):
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)
        for k in vllm_metrics.OP_TIME_KEYS:  # seconds of each copy, for the histograms
            self.data.setdefault(k, [])

    def reset(self):
        for k in self.data:
            self.data[k] = [] if isinstance(self.data[k], list) else 0

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict:
        d = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        d["load_gbps"] = round(d["load_bytes"] / d["load_s"] / 1e9, 3) if d["load_s"] else 0.0
        d["save_gbps"] = round(d["save_bytes"] / d["save_s"] / 1e9, 3) if d["save_s"] else 0.0
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclasses.dataclass
class _ReqState:
    request: Any
    keys: ChainedKeys | None  # None: the request is not cached (see _keys_for)
    block_ids: list = dataclasses.field(default_factory=list)
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the pool or planned/held
    load: BlockOp | None = None  # matched, not yet sent to the worker
    inflight: BlockOp | None = None  # sent with step `lease_step`, outcome unknown
    held: list = dataclasses.field(default_factory=list)  # saves waiting for `inflight`'s outcome
    lease: Any = None
    lease_step: int | None = None  # step whose metadata carries the load of this lease
    saving: bool = False  # a save of it went to the workers: its blocks are freed once they say so


# -------------------------------------------------------------------------------------------------
# identity of the KV bytes (the vLLM side of identity.py)
def _model_path(mc: Any) -> str | None:
    for cand in (getattr(mc, "model_weights", None), mc.model):
        if cand and os.path.exists(str(cand)):
            return str(cand)
    try:  # a hub id: the local snapshot vLLM loaded
        from huggingface_hub import snapshot_download

        return snapshot_download(mc.model, revision=getattr(mc, "revision", None), local_files_only=True)
    except Exception:  # noqa: BLE001 - not resolvable: the caller says what to do
        return None


def _kv_dtype(vllm_config: Any, spec: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype != "auto":  # fp8 caches may be stored as uint8: the configured type is the truth
        return ident.canonical_dtype(cache_dtype)
    return ident.canonical_dtype(getattr(spec, "dtype", vllm_config.model_config.dtype))


def _kv_scales(vllm_config: Any, dtype: str) -> str:
    if not dtype.startswith("fp8") and dtype not in ("int8", "uint8"):  # canonical names
        return "none"
    if getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        # Scales computed from this process's first batch: the bytes depend on it, so no other
        # process can share them.
        return f"dynamic-{uuid.uuid4().hex}"
    return "checkpoint-or-unit"  # scales from the checkpoint (in the weights digest) or 1.0


def _config_paths(mc: Any) -> list[str]:
    """Config sources other than the model directory (whose config files weights_digest hashes)."""
    p = getattr(mc, "hf_config_path", None)
    return [str(p)] if p and os.path.exists(str(p)) else []


def _loaded_config(mc: Any) -> dict | None:
    """The config as vLLM parsed it (hf_config_path, hf_overrides, GGUF metadata all end up here)."""
    to_dict = getattr(getattr(mc, "hf_config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else None


def hashes_loaded_weights(extra: dict) -> bool:
    """Whether the workers name the namespace by the weights as loaded (the default) rather
    than by the sampled file digest ("weights_identity": "sampled"). An operator's model_id or
    namespace replaces both."""
    mode = extra.get("weights_identity", "loaded")
    if mode not in ("loaded", "sampled"):
        raise ValueError(f"cxlkv: weights_identity must be 'loaded' or 'sampled', not {mode!r}")
    return mode == "loaded" and not extra.get("model_id") and not extra.get("namespace")


def loaded_digest(mc: Any) -> lw.LoadedDigest | None:
    """Every byte of this worker's weights: as loaded (its TP rank's parameters); where the
    engine moved some out of reach (vLLM CPU's oneDNN linears), of the weight files they were
    loaded from; None when the model is not reachable (the namespace then uses the sampled file
    digest, and its source says so)."""
    model = lw.caller_model()
    if model is None:
        logger.warning(
            "cxlkv: the loaded model is not reachable from the connector; the namespace is "
            "named by the sampled file digest (docs/IDENTITY.md)"
        )
        return None
    try:
        d = lw.module_digest(model)
        path = _model_path(mc) if d.emptied else None
        if path is not None:
            logger.info(
                "cxlkv: %d weights were repacked out of reach at load; hashing every byte of the weight files",
                d.emptied,
            )
            d = lw.files_digest(ident.weight_files(path))
    except (RuntimeError, TypeError, ValueError, OSError) as e:  # a tensor numpy cannot view, ...
        logger.warning(
            "cxlkv: the weights cannot be hashed (%s); the namespace is named by the sampled file digest", e
        )
        return None
    logger.info("cxlkv: weights (%s): %s, hashed in %.2f s", d.kind, d.describe(), d.seconds)
    return d


def derive_identity(
    vllm_config: Any,
    spec: Any,
    layers: int,
    block_bytes: int,
    kind: str,
    tp_rank: int,
    tp_size: int,
    extra: dict,
    loaded: lw.LoadedDigest | None = None,
) -> ident.KVIdentity:
    mc = vllm_config.model_config
    if extra.get("model_id"):
        override = str(extra["model_id"])
        weights, source = "model_id:" + override, f"operator model_id {override!r}"
    else:
        path = _model_path(mc)
        if path is None:
            raise ValueError(
                f"cxlkv: cannot read the weights of model {mc.model!r} to derive the KV "
                "namespace from them; set kv_connector_extra_config.model_id"
            )
        w = ident.weights_digest(path)
        config = ident.config_digest(_config_paths(mc), _loaded_config(mc))
        weights, source = ident.weights_identity(w, config, loaded)
    dtype = _kv_dtype(vllm_config, spec)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    device = vllm_config.device_config.device_type
    overrides = getattr(mc, "hf_overrides", None)
    return ident.KVIdentity(
        weights=weights,
        weights_source=source,
        dtype=dtype,
        kind=kind,
        num_layers=layers,
        num_kv_heads=int(getattr(spec, "num_kv_heads", 1)),
        head_size=int(getattr(spec, "head_size", 1)),
        block_size=vllm_config.cache_config.block_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_scales=_kv_scales(vllm_config, dtype),
        quantization=str(mc.quantization or "none"),
        compute_dtype=str(mc.dtype).replace("torch.", ""),
        overrides=repr(overrides) if overrides and not callable(overrides) else "",
        device_layout=f"{device}|{backend or 'auto'}|{type(spec).__name__}|{sys.byteorder}",
        block_bytes=block_bytes,
    )


@dataclasses.dataclass
class CxlKVHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side: the namespace it derived and the weights field
    (with its source text) that the scheduler cannot compute, not holding the weights."""

    namespace: str
    weights: str
    weights_source: str


class _AwaitingWorkers:
    """The scheduler's namespace until the workers report theirs. vLLM's engine core reports
    before the first request; an engine that never does gets the namespace of the sampled
    file digest at first use: the one workers that could not hash their weights use."""

    def __init__(self, open_namespace: Any) -> None:
        self._open = open_namespace
        self._ns: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._ns is None:
            self._ns = self._open()
        return getattr(self._ns, name)


def _layout(identity: ident.KVIdentity) -> cxlkv.KVLayout:
    return cxlkv.KVLayout(
        model_id=identity.model_id(),
        dtype=identity.dtype,
        num_layers=identity.num_layers,
        num_kv_heads=identity.num_kv_heads,
        head_size=identity.head_size,
        tokens_per_block=identity.block_size,
        kind=identity.kind,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        block_bytes=identity.block_bytes,
        source=identity.source(),
    )


class CxlKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        self._can_load = not tc.is_kv_producer or tc.is_kv_consumer
        self._can_save = not tc.is_kv_consumer or tc.is_kv_producer
        # A block that fails to load (evicted, corrupt) is a cache miss: have vLLM recompute it.
        # vLLM's default policy fails the request instead; keep it only when asked to.
        if extra.get("load_failure_policy", "recompute") == "recompute":
            tc.kv_load_failure_policy = "recompute"
        # Saves off the critical path (issue 16), the default: the step submits them and returns;
        # vLLM frees a finished request's blocks once its copies are done (request_finished /
        # get_finished), a step later than without the connector. "async_saves": false makes each
        # step wait for its own saves (and frees at once).
        self._async_saves = async_saves_enabled(extra)
        pool_path = extra.get("pool_path") or cxlkv.default_pool_path()
        # A striped pool: a comma-separated string or a JSON list of device paths.
        self._pool_path = ",".join(map(str, pool_path)) if isinstance(pool_path, list) else str(pool_path)
        self._awaits_workers = role == KVConnectorRole.SCHEDULER and hashes_loaded_weights(extra)
        self.identity = self._describe(vllm_config, kv_cache_config)
        self._block_bytes = self.identity.block_bytes
        self._ns_name = (
            ident.short_name(str(extra["namespace"]))
            if extra.get("namespace")
            else self.identity.namespace_name()
        )
        self._counters: dict[str, int] = {}  # scheduler side, sent to the worker per step
        self._stats = CxlKVStats()  # worker side

        def open_pool(create: bool) -> cxlkv.Pool:
            if not create:  # again, after a fence: the pool that was there, never a new one
                return cxlkv.Pool.open(self._pool_path)
            return cxlkv.Pool.open_or_create(
                self._pool_path,
                extra.get("pool_size", "4GiB"),
                **({"chunk_size": extra["chunk_size"]} if "chunk_size" in extra else {}),
            )

        def open_namespace(pool: cxlkv.Pool) -> Any:
            if self._awaits_workers:  # identity: opened when the workers report (handshake)
                return _AwaitingWorkers(lambda: self._open_namespace(pool))
            return self._open_namespace(pool)

        # Every use of the pool goes through self._session.call, which runs nothing while the pool
        # is unusable (from the start when opening failed), and opens it again after a fence. A
        # damaged or unusable pool must not keep the engine from serving (without the cache);
        # "on_pool_error": "fail" restores fail-fast start-up.
        self._session = PoolSession(
            self._pool_path,
            logger,
            open_pool,
            open_namespace,
            who=f" ({role.name.lower()})",
            check_interval_s=float(extra.get("file_check_interval_s", 0.001)),
            count=self._count_here,
            fail_fast=extra.get("on_pool_error", "degrade") == "fail",
        )
        self._logged: set[str] = set()
        self._adapters: dict[tuple[str, float], str | None] = {}
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._completed_steps = 0
        self._disabled_reported = False
        # worker side
        self._kv_arrays: list = []
        self._block_dim = 0
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._transfer: Transfer | None = None
        self._saves = SaveTracker()
        self._setup_coalescing(extra)
        logger.info(
            "cxlkv connector (%s) on pool %s as node %d, namespace %r (%s), %d-byte blocks",
            role.name,
            self._pool_path,
            self._session.node,
            self._ns_name,
            self.identity.source(),
            self._block_bytes,
        )

    def _setup_coalescing(self, extra: dict) -> None:
        cfg = CoalesceConfig.from_extra(extra)
        if cfg.enabled and self.identity.tp_size > 1:
            logger.info("cxlkv: coalescing of new prefixes is off with tensor parallelism (coalesce.py)")
            cfg = dataclasses.replace(cfg, enabled=False)
        self._coalesce = CoalesceScheduler(cfg, self._session, self._count, logger)
        self._coalesce_worker = CoalesceWorker(self._session, self._count_stat, logger)

    # ------------------------------------------------------------------------------------------
    # identity and keys
    def _describe(self, vllm_config, kv_cache_config) -> ident.KVIdentity:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                "cxlkv supports models with one KV cache group (uniform attention); "
                f"this model has {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        layers = len(groups[0].layer_names)
        kind = "mla" if "MLA" in type(spec).__name__ else "dense"
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = 0
        if self.role == KVConnectorRole.WORKER and tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # The worker holds the loaded weights (vLLM builds it after load_model); the scheduler
        # never sees them and adopts rank 0's identity in set_xfer_handshake_metadata.
        loaded = (
            loaded_digest(vllm_config.model_config)
            if self.role == KVConnectorRole.WORKER and hashes_loaded_weights(extra)
            else None
        )
        return derive_identity(
            vllm_config, spec, layers, spec.page_size_bytes * layers, kind, tp_rank, tp_size, extra, loaded
        )

    def _open_namespace(self, pool: cxlkv.Pool) -> Any:
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        device = placement_device(
            extra.get("pool_device"), self.identity.tp_rank, len(pool.info()["devices"])
        )
        return pool.namespace(_layout(self.identity), name=self._ns_name, device=device)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker: the identity this rank derived (vLLM hands it to the scheduler side)."""
        if self.role != KVConnectorRole.WORKER:
            return None
        return CxlKVHandshake(self._ns_name, self.identity.weights, self.identity.weights_source)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # vLLM's default raises on a pipeline stage > 0; the first stage's ranks name the
        # namespace the scheduler looks up (the others report their own, unused here).
        self.set_xfer_handshake_metadata({tp: m for (pp, tp), m in metadata.items() if pp == 0})

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler: name the namespace as TP rank 0 did from the weights it loaded (the keys'
        root and the lookups must be those of the namespace the workers load from and save to);
        every other field is this side's own, and must give the workers' name."""
        meta = metadata.get(0)
        if not self._awaits_workers or not isinstance(meta, CxlKVHandshake):
            return
        self._awaits_workers = False
        adopted = dataclasses.replace(self.identity, weights=meta.weights, weights_source=meta.weights_source)
        if adopted.namespace_name() != meta.namespace:
            self._session.guard.fail(
                "the workers derived another KV namespace",
                ValueError(
                    f"workers: {meta.namespace}, scheduler: {adopted.namespace_name()} ({adopted.source()})"
                ),
            )
            return
        self.identity, self._ns_name = adopted, meta.namespace
        # The session's pool now (it may be a new node after a fence); a fence here reopens it.
        ns = self._session.call("namespace", lambda _awaiting: self._open_namespace(self._session.pool))
        if ns is not None:
            self._session.ns = ns
        logger.info(
            "cxlkv: namespace %r (%s), reported by the workers", self._ns_name, self.identity.source()
        )

    def _once(self, cause: str, msg: str, *args: Any) -> None:
        if cause not in self._logged:
            self._logged.add(cause)
            logger.warning(msg + " (logged once; counted in the connector's metrics)", *args)

    def _count(self, key: str, n: int = 1) -> None:
        self._counters[key] = self._counters.get(key, 0) + n

    def _count_stat(self, key: str, n: int = 1) -> None:
        self._stats.data[key] = self._stats.data.get(key, 0) + n

    def _count_here(self, key: str) -> None:
        """A counter of either side: the scheduler's travel to the worker with the next step."""
        if self.role == KVConnectorRole.WORKER:
            self._stats.data[key] = self._stats.data.get(key, 0) + 1
        else:
            self._count(key)

    def _adapter_id(self, lora: Any) -> str | None:
        """The adapter's content digest (cached by path and mtime); None if unreadable."""
        path = str(getattr(lora, "lora_path", "") or "")
        try:
            stamp = os.stat(path).st_mtime
        except OSError:
            stamp = -1.0
        key = (path, stamp)
        if key not in self._adapters:
            try:
                self._adapters[key] = "lora:" + ident.adapter_digest(path)
            except (OSError, ValueError) as e:
                self._once(
                    f"lora:{path}",
                    "cxlkv: LoRA adapter %r at %r cannot be hashed (%s); its requests are not cached",
                    getattr(lora, "lora_name", "?"),
                    path,
                    e,
                )
                self._adapters[key] = None
        return self._adapters[key]

    def _keys_for(self, request: Request) -> ChainedKeys | None:
        lora_id = None
        if getattr(request, "lora_request", None) is not None:
            lora_id = self._adapter_id(request.lora_request)
            if lora_id is None:
                return None
        extra = None
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None:
            extra = self._embeds_extra(request, embeds)
        mm = [
            MMSpan(f.identifier, f.mm_position.offset, f.mm_position.length)
            for f in (getattr(request, "mm_features", None) or [])
        ]
        return ChainedKeys(
            root_key(self._ns_name, lora_id, getattr(request, "cache_salt", None)),
            self._block_size,
            mm,
            extra=extra,
        )

    def _embeds_extra(self, request: Request, embeds: Any):
        """Per-block digest of the prompt embeddings (their token ids are placeholders)."""
        bs, n_prompt = self._block_size, int(request.num_prompt_tokens)
        mask = getattr(request, "prompt_is_token_ids", None)

        def extra(b: int) -> bytes:
            lo, hi = b * bs, min((b + 1) * bs, n_prompt)
            if lo >= hi:
                return b""
            part = ident.tensor_digest(embeds[lo:hi])
            if mask is not None:
                part += "|" + "".join("1" if m else "0" for m in list(mask)[lo:hi])
            return ("embeds:" + part).encode()

        return extra

    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request, self._keys_for(request))
            if st.keys is None:
                self._count("uncacheable_requests")
            self._reqs[request.request_id] = st
        return st

    # ------------------------------------------------------------------------------------------
    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        st = self._state(request)
        self._release(st)
        self._coalesce.lookup_started(request.request_id)
        if not self._can_load or st.keys is None or not self._session.usable():
            return 0, False
        prompt = (
            request.prompt_token_ids
            if request.prompt_token_ids is not None
            else list(request.all_token_ids)[: request.num_prompt_tokens]
        )
        # Leave at least one prompt token to compute: vLLM needs it to sample.
        max_blocks = (len(prompt) - 1) // self._block_size
        have = num_computed_tokens // self._block_size
        if max_blocks <= have:
            return 0, False
        keys = st.keys.extend(prompt, upto_blocks=max_blocks)
        lease = self._session.call("acquire", lambda ns: ns.acquire(keys[:max_blocks]))
        if lease is None:
            return 0, False
        hit = len(lease)
        self._count("lookup_tokens", (max_blocks - have) * self._block_size)
        self._count("hit_tokens", max(0, hit - have) * self._block_size)
        if hit < max_blocks:
            self._check_pin_cap(request.request_id, keys[hit:max_blocks], hit)
            if self._coalesce.on_miss(
                request.request_id, keys, have, hit, max_blocks, self._can_save, self._can_load
            ):  # another engine computes the rest: wait for it (asynchronous load)
                self._session.retire(lease)
                return (max_blocks - have) * self._block_size, True
        if hit <= have:
            self._session.retire(lease)
            return 0, False
        st.lease = lease
        st.load = BlockOp(request.request_id, keys[have:hit], [], start_depth=have)
        logger.debug(
            "cxlkv: %s: %d of %d prompt blocks in the pool (%d computed locally)",
            request.request_id,
            hit,
            max_blocks,
            have,
        )
        return (hit - have) * self._block_size, False

    def _check_pin_cap(self, req_id: str, rest: list, hit: int) -> None:
        """A hit that stopped while the next block is in the pool was capped by pin slots."""
        more = self._session.call("match_prefix", lambda ns: ns.match_prefix(rest)) or 0
        if more > 0:
            self._count("pin_capped_requests")
            self._count("pin_capped_blocks", more)
            self._once(
                "pin_cap",
                "cxlkv: %s: the prefix hit stopped at %d blocks although %d more "
                "are in pool %s: the pool's pin slots are exhausted (create it with more "
                "pin_slots)",
                req_id,
                hit,
                more,
                self._pool_path,
            )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        ids = blocks.get_block_ids()[0]
        if self._coalesce.allocated(request.request_id, ids, num_external_tokens, self._block_size):
            return
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None:
            return
        if num_external_tokens == 0:
            st.load = None
            self._release(st)
            return
        first = st.load.start_depth
        n = num_external_tokens // self._block_size
        st.load.keys = st.load.keys[:n]
        st.load.block_ids = list(ids[first : first + n])
        if len(st.load.block_ids) != n:
            logger.warning(
                "cxlkv: %s: %d blocks allocated for %d external blocks; not loading",
                request.request_id,
                len(st.load.block_ids),
                n,
            )
            st.load = None
            self._release(st)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        meta = CxlKVConnectorMetadata(
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        )
        if not self._session.usable() and self._session.disabled and not self._disabled_reported:
            self._disabled_reported = True
            self._count("pool_disabled")
        meta.waits = self._coalesce.take_waits()
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        for req_id in meta.preempted:
            self._coalesce.release(req_id, "preempted")
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            st.saved_blocks = self._coalesce.loaded_floor(new.req_id)  # a wait's blocks are in the pool
            # (Re)scheduled from scratch (a preempted request may come back as new): the KV of
            # held saves lived in blocks it no longer owns.
            self._drop_held(st, "rescheduled as new")
            self._plan(st, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: the KV of held saves is gone; recompute re-saves them.
                st.block_ids = list(new_ids[0]) if new_ids else []
                self._drop_held(st, "preempted")
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(st, req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta)
        if not self._async_saves:  # this step's saves are published when it completes
            for req_id, st in self._reqs.items():  # held saves are not sent yet
                sent = st.held[0].start_depth if st.held else st.saved_blocks
                self._coalesce.saves_planned(req_id, sent, self._step)
        meta.counters, self._counters = {k: v for k, v in self._counters.items() if v}, {}
        return meta

    def _plan(self, st: _ReqState, req_id: str, computed_after_step: int, meta) -> None:
        # A load planned for this step is sent even when the pool has failed since: the worker
        # then reports its blocks as load errors, and vLLM recomputes them.
        if st.load is not None and st.load.block_ids:
            meta.loads.append(st.load)
            st.saved_blocks = max(st.saved_blocks, st.load.start_depth + len(st.load.keys))
            st.inflight, st.lease_step = st.load, self._step
            st.load = None
        if not self._can_save or st.keys is None or not self._session.usable():
            return
        if st.held and st.inflight is None:  # their load was confirmed
            meta.saves.extend(st.held)
            st.held, st.saving = [], True
        tokens = st.request.all_token_ids
        full = min(computed_after_step, len(tokens)) // self._block_size
        full = min(full, len(st.block_ids))
        if full <= st.saved_blocks:
            return
        keys = st.keys.extend(tokens, upto_blocks=full)
        first = st.saved_blocks
        op = BlockOp(req_id, keys[first:full], st.block_ids[first:full], first)
        st.saved_blocks = full
        # KV computed while a load is unconfirmed may sit on top of blocks that never arrived.
        if st.inflight is not None:
            st.held.append(op)
        else:
            meta.saves.append(op)
            st.saving = True

    def _drop_held(self, st: _ReqState, why: str) -> None:
        if st.held:
            st.saved_blocks = min(st.saved_blocks, st.held[0].start_depth)
            logger.debug("cxlkv: %s: %d held saves dropped (%s)", st.held[0].req_id, len(st.held), why)
            st.held = []

    def update_connector_output(self, connector_output) -> None:
        # One call per completed step, in order: loads of steps <= completed are done. Failures
        # are matched by block id, so a late report is still attributed to its request.
        self._completed_steps += 1
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        self._coalesce.step_done(
            self._completed_steps,
            invalid,
            getattr(connector_output, "finished_recving", None) or (),
            getattr(connector_output, "finished_sending", None) or (),
        )
        for st in self._reqs.values():
            op = st.inflight
            if op is not None:
                bad = [i for i, b in enumerate(op.block_ids) if b in invalid]
                if bad:
                    self._load_failed(st, op, bad[0])
                elif st.lease_step is not None and st.lease_step <= self._completed_steps:
                    st.inflight = None  # confirmed: held saves go out with the next step
            if st.lease is not None and st.lease_step is not None and st.lease_step <= self._completed_steps:
                self._release(st)

    def _load_failed(self, st: _ReqState, op: BlockOp, first_bad: int) -> None:
        """vLLM recomputes from the first failed block: nothing computed on top of it is saved,
        and those blocks are saved again once recomputed."""
        depth = op.start_depth + first_bad
        self._count("saves_dropped_after_failed_load", sum(len(h.keys) for h in st.held))
        st.held = []
        st.inflight = None
        st.saved_blocks = min(st.saved_blocks, depth)
        self._release(st)
        # The block that failed (corrupt, or gone) must not be found again by anyone; the core
        # drops a checksum failure itself, this covers a pin that kept it (no-op when absent).
        self._session.call("delete", lambda ns: ns.delete(op.keys[first_bad]))
        logger.info(
            "cxlkv: %s: load failed at block %d; vLLM recomputes from there and the "
            "connector saves those blocks again",
            op.req_id,
            depth,
        )

    def request_finished(self, request: Request, block_ids: list[int]):
        st = self._reqs.pop(request.request_id, None)
        self._coalesce.finished(request.request_id, st is not None and st.saving and self._async_saves)
        if st is None:
            return False, None
        self._release(st)
        events = self._events_tracker()
        if events is not None:  # its last saves are announced once stored
            events.finished(request.request_id, st)
        # Async saves may still be copying from its blocks: vLLM frees them once every worker has
        # reported the request in finished_sending (save_tracker.py). Synchronous saves are done.
        return st.saving and self._async_saves, None

    def _release(self, st: _ReqState) -> None:
        if st.lease is not None:
            self._session.retire(st.lease)
            st.lease = None
            st.lease_step = None

    # ------------------------------------------------------------------------------------------
    # KV events (vllm_events.py): vLLM publishes what take_events returns (--kv-events-config)
    def _events_tracker(self):
        from cxlkv.integrations import vllm_events

        if "_kv_events" not in self.__dict__:
            extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
            on = self.role == KVConnectorRole.SCHEDULER and vllm_events.events_enabled(
                self._vllm_config, extra
            )
            self._kv_events = vllm_events.ConnectorEvents(self._block_size) if on else None
        return self._kv_events

    def take_events(self):
        tracker = self._events_tracker()
        if tracker is None:
            return ()
        if not self._session.usable():
            return tracker.pool_lost() if self._session.disabled else ()
        return self._session.call("events", lambda ns: tracker.take(self._session.pool, ns, self._reqs)) or ()

    # ------------------------------------------------------------------------------------------
    # worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        names = list(kv_caches)
        arrays = [kv_caches[n] for n in names]
        num_blocks = self._kv_cache_config.num_blocks
        first = arrays[0]
        # CUDA-style layouts put K/V first: [2, num_blocks, ...]; CPU ones lead with blocks.
        self._block_dim = 1 if first.shape[0] == 2 and first.ndim > 1 and first.shape[1] == num_blocks else 0
        per_block = sum(a.element_size() * a[(slice(None),) * self._block_dim + (0,)].numel() for a in arrays)
        if per_block != self._block_bytes:
            raise ValueError(
                f"cxlkv: the KV cache holds {per_block} bytes per block, the namespace "
                f"{self._ns_name!r} expects {self._block_bytes}"
            )
        self._kv_arrays = [a.detach() for a in arrays]
        self._transfer = self._build_transfer(first.is_cuda)
        logger.info(
            "cxlkv: %d KV layers registered, %s, block_dim=%d",
            len(arrays),
            tuple(first.shape),
            self._block_dim,
        )

    def _build_transfer(self, on_cuda: bool) -> Transfer:
        # KV on a GPU: the CUDA data path (transfer_cuda.py: one fused Triton kernel per batch,
        # through the pool mapping registered with CUDA, else staged); on the CPU the core's copy
        # engine (ns.store / ns.load) on a save thread.
        if on_cuda:
            from cxlkv.integrations.transfer_cuda import CudaTransfer

            return CudaTransfer(self._session, self._kv_arrays, self._block_dim, self._block_bytes)
        return CpuTransfer(self._session, self._kv_arrays, self._block_dim)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward, which may write the blocks the preempted requests held.
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted:
            n = self._saves.pending(preempted)
            if n:
                self._stats.data["saves_waited_at_preemption"] += n
                if "preempted_saves" not in self._logged:
                    self._logged.add("preempted_saves")
                    logger.info(
                        "cxlkv: %d saves of preempted requests in flight: the forward waits for them "
                        "(logged once; counted as saves_waited_at_preemption)",
                        n,
                    )
            self._saves.wait_for(preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = cast(CxlKVConnectorMetadata, self._get_connector_metadata())
        self._failed_reqs = set()
        if self.identity.tp_rank == 0:
            for k, v in meta.counters.items():
                self._stats.data[k] = self._stats.data.get(k, 0) + v
        self._coalesce_worker.add(meta.waits, meta.idle)
        for op in meta.loads:
            t0 = time.perf_counter()
            # Not retried after a fence: the blocks were pinned by the fenced node's lease.
            usable = self._session.usable()
            n = self._transfer.load(op) if self._transfer is not None and usable else 0
            if not usable:  # the pool could not be used: every block of the op fails
                self._stats.data["load_failed_unavailable_blocks"] += len(op.keys)
            self._account_load(t0, n)
            if n < len(op.keys):
                self._stats.data["load_failed_blocks"] += len(op.keys) - n
                self._load_errors.update(op.block_ids[n:])
                self._failed_reqs.add(op.req_id)
                logger.warning(
                    "cxlkv: %s: %d of %d blocks failed to load; vLLM recomputes them",
                    op.req_id,
                    len(op.keys) - n,
                    len(op.keys),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = cast(CxlKVConnectorMetadata, self._get_connector_metadata())
        for op in meta.saves:
            if self._async_saves:  # its blocks are held: reported in finished_sending whatever happens below
                self._saves.note(op.req_id)
            if op.req_id in self._failed_reqs:
                # Defence in depth (the scheduler holds such saves): this rank's load failed in
                # this very step, so this step's KV of the request sits on missing blocks.
                self._stats.data["saves_dropped_after_failed_load"] += len(op.keys)
                continue
            if self._transfer is not None and self._session.usable():
                self._saves.add(op, self._transfer.submit_save(op))
        if not self._can_load or not self._async_saves:
            # Synchronous saves (the "async_saves": false opt-out), and a prefill instance
            # (kv_producer) in any mode: its answer tells the proxy that the decode instance may
            # load the prompt's KV now, so the step ends once it is published.
            self._saves.wait_for({op.req_id for op in meta.saves})
        self._account_saves()

    def _account_saves(self) -> None:
        for op, handle in self._saves.completed():
            n = handle.result()
            if isinstance(handle, CpuSaveHandle):
                if handle.refused:  # the pool is unusable: nothing to count
                    continue
                self._stats.data["save_s"] += handle.seconds
                self._stats.data["save_op_s"].append(handle.seconds)
            self._stats.data["save_blocks"] += n
            self._stats.data["save_bytes"] += n * self._block_bytes
            if n < len(op.keys):
                self._stats.data["save_failed_blocks"] += len(op.keys) - n
                self._once(
                    "save_failed",
                    "cxlkv: %s: %d of %d blocks could not be saved to pool %s "
                    "(no free block: the pool is full of pinned or in-flight blocks); "
                    "see `cxlkv pool stats` puts_failed",
                    op.req_id,
                    len(op.keys) - n,
                    len(op.keys),
                    self._pool_path,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._account_saves()
        sending = self._saves.finished_sending(finished_req_ids)
        recving, errors = self._coalesce_worker.poll(finished_req_ids, self._load_waited)
        self._load_errors |= errors
        return sending or None, recving or None

    def _load_waited(self, op: BlockOp) -> int:
        """A coalesced wait's blocks, through the same checksummed load as every load."""
        if self._transfer is None:
            return 0
        t0 = time.perf_counter()
        n = self._transfer.load(op)
        self._account_load(t0, n)
        return n

    def _account_load(self, t0: float, n: int) -> None:
        """One load op's time and the blocks it delivered, for the connector's stats."""
        dt = time.perf_counter() - t0
        self._stats.data["load_s"] += dt
        self._stats.data["load_op_s"].append(dt)
        self._stats.data["load_blocks"] += n
        self._stats.data["load_bytes"] += n * self._block_bytes

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self._account_saves()
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, CxlKVStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return CxlKVStats(data=dict(data)) if data is not None else CxlKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return vllm_metrics.CxlKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        self._coalesce.close()
        for st in self._reqs.values():
            self._release(st)
        if self._transfer is not None:
            self._transfer.close()  # lets the queued saves finish (bounded)
        self._session.close()
