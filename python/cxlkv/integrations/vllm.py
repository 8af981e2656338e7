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

Scheduler side: ``get_num_new_matched_tokens`` asks the in-pool index directly (``acquire``: a
lookup that also pins the matched blocks, so they cannot be evicted before the worker loads
them); the lease is released once the step that loads them has completed, or when the request
ends. Worker side: ``start_load_kv`` scatters the matched blocks into vLLM's paged KV buffers
before the forward pass; ``wait_for_save`` gathers every block that became full in this step into
the pool (blocks the pool already holds are skipped by the index). A block that fails to load
(evicted meanwhile, checksum mismatch) is reported through ``get_block_ids_with_load_errors`` and
vLLM recomputes it: the output stays correct.

Extra config keys: ``pool_path`` (default ``$CXLKV_POOL`` or /dev/shm/cxlkv), ``pool_size``
(used when the pool does not exist yet, default 4GiB), ``chunk_size``, ``namespace`` (overrides
the namespace name derived from the model and KV layout).
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

import cxlkv
from cxlkv.integrations.keys import ChainedKeys, MMSpan, root_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under the "vllm" logger, so that vLLM's logging configuration (level, format) applies.
logger = init_logger("vllm.cxlkv")


@dataclasses.dataclass
class BlockOp:
    req_id: str
    keys: list          # 32-byte keys, one per block
    block_ids: list     # vLLM block ids, same length
    start_depth: int = 0  # position of keys[0] in its prefix chain


@dataclasses.dataclass
class CxlKVConnectorMetadata(KVConnectorMetadata):
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CxlKVStats(KVConnectorStats):
    """Per-interval counters of the worker side, aggregated by vLLM's stats logger."""

    def __post_init__(self):
        for k in ("load_blocks", "load_failed_blocks", "load_bytes", "load_s", "save_blocks",
                  "save_bytes", "save_s"):
            self.data.setdefault(k, 0)

    def reset(self):
        for k in self.data:
            self.data[k] = 0

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        d = dict(self.data)
        d["load_gbps"] = round(d["load_bytes"] / d["load_s"] / 1e9, 3) if d["load_s"] else 0.0
        d["save_gbps"] = round(d["save_bytes"] / d["save_s"] / 1e9, 3) if d["save_s"] else 0.0
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclasses.dataclass
class _ReqState:
    request: Any
    keys: ChainedKeys
    block_ids: list = dataclasses.field(default_factory=list)
    saved_blocks: int = 0        # blocks [0, saved_blocks) are known to be in the pool
    load: Optional[BlockOp] = None
    lease: Any = None
    lease_step: Optional[int] = None  # step whose metadata carries the load of this lease


class CxlKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
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
        self._pool_path = str(extra.get("pool_path", cxlkv.DEFAULT_POOL_PATH))
        self._pool = cxlkv.Pool.open_or_create(
            self._pool_path, extra.get("pool_size", "4GiB"),
            **({"chunk_size": extra["chunk_size"]} if "chunk_size" in extra else {}))
        self._layout, self._ns_name = self._describe_layout(vllm_config, kv_cache_config, extra)
        self._ns = self._pool.namespace(self._layout, name=self._ns_name)
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._completed_steps = 0
        # worker side
        self._kv_arrays: list = []
        self._block_dim = 0
        self._load_errors: set[int] = set()
        self._stats = CxlKVStats()
        logger.info("cxlkv connector (%s) on pool %s, namespace %r, %d-byte blocks", role.name,
                    self._pool_path, self._ns_name, self._ns.block_bytes)

    # ------------------------------------------------------------------------------------------
    # layout and keys
    def _describe_layout(self, vllm_config, kv_cache_config, extra):
        """The namespace: model, dtype, KV layout and TP rank. The raw bytes of a vLLM block
        depend on the attention backend's layout, so the device type is part of the name."""
        mc = vllm_config.model_config
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError("cxlkv supports models with one KV cache group (uniform attention); "
                             f"this model has {len(groups)}")
        spec = groups[0].kv_cache_spec
        layers = len(groups[0].layer_names)
        block_bytes = spec.page_size_bytes * layers
        kind = "mla" if "MLA" in type(spec).__name__ else "dense"
        dtype = str(getattr(spec, "dtype", mc.dtype)).replace("torch.", "")
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "uint8",
                 "float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2", "int8": "int8"}.get(dtype, "bytes")
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = 0
        if self.role == KVConnectorRole.WORKER and tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            tp_rank = get_tensor_model_parallel_rank()
        device = vllm_config.device_config.device_type
        model_id = str(extra.get("model_id") or mc.served_model_name or mc.model)
        layout = cxlkv.KVLayout(model_id=model_id[:90], dtype=dtype, num_layers=layers,
                                num_kv_heads=int(getattr(spec, "num_kv_heads", 1)),
                                head_size=int(getattr(spec, "head_size", 1)),
                                tokens_per_block=self._block_size, kind=kind, tp_rank=tp_rank,
                                tp_size=tp_size, block_bytes=block_bytes)
        name = extra.get("namespace") or f"{model_id[:60]}|{dtype}|bs{self._block_size}|{device}|tp{tp_rank}/{tp_size}"
        return layout, name

    def _keys_for(self, request: "Request") -> ChainedKeys:
        lora = request.lora_request.lora_name if getattr(request, "lora_request", None) else None
        mm = [MMSpan(f.identifier, f.mm_position.offset, f.mm_position.length)
              for f in (getattr(request, "mm_features", None) or [])]
        return ChainedKeys(root_key(self._ns_name, lora, getattr(request, "cache_salt", None)),
                           self._block_size, mm)

    def _state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request, self._keys_for(request))
            self._reqs[request.request_id] = st
        return st

    # ------------------------------------------------------------------------------------------
    # scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        st = self._state(request)
        self._release(st)
        if not self._can_load:
            return 0, False
        prompt = request.prompt_token_ids or []
        # Leave at least one prompt token to compute: vLLM needs it to sample.
        max_blocks = (len(prompt) - 1) // self._block_size
        have = num_computed_tokens // self._block_size
        if max_blocks <= have:
            return 0, False
        keys = st.keys.extend(prompt, upto_blocks=max_blocks)
        lease = self._ns.acquire(keys[:max_blocks])
        hit = len(lease)
        if hit <= have:
            lease.release()
            return 0, False
        st.lease = lease
        st.load = BlockOp(request.request_id, keys[have:hit], [], start_depth=have)
        logger.debug("cxlkv: %s: %d of %d prompt blocks in the pool (%d computed locally)",
                     request.request_id, hit, max_blocks, have)
        return (hit - have) * self._block_size, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None:
            return
        if num_external_tokens == 0:
            st.load = None
            self._release(st)
            return
        ids = blocks.get_block_ids()[0]
        first = st.load.start_depth
        n = num_external_tokens // self._block_size
        st.load.keys = st.load.keys[:n]
        st.load.block_ids = list(ids[first:first + n])
        if len(st.load.block_ids) != n:
            logger.warning("cxlkv: %s: %d blocks allocated for %d external blocks; not loading",
                           request.request_id, len(st.load.block_ids), n)
            st.load = None
            self._release(st)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._step += 1
        meta = CxlKVConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            st.saved_blocks = 0
            self._plan(st, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(st, req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta)
        return meta

    def _plan(self, st: _ReqState, req_id: str, computed_after_step: int, meta) -> None:
        if st.load is not None and st.load.block_ids:
            meta.loads.append(st.load)
            st.saved_blocks = max(st.saved_blocks, st.load.start_depth + len(st.load.keys))
            st.lease_step = self._step
            st.load = None
        if not self._can_save:
            return
        tokens = st.request.all_token_ids
        full = min(computed_after_step, len(tokens)) // self._block_size
        full = min(full, len(st.block_ids))
        if full <= st.saved_blocks:
            return
        keys = st.keys.extend(tokens, upto_blocks=full)
        first = st.saved_blocks
        meta.saves.append(BlockOp(req_id, keys[first:full], st.block_ids[first:full], first))
        st.saved_blocks = full

    def update_connector_output(self, connector_output) -> None:
        # One call per completed step, in order: loads of steps <= completed are done.
        self._completed_steps += 1
        for st in self._reqs.values():
            if st.lease is not None and st.lease_step is not None and st.lease_step <= self._completed_steps:
                self._release(st)

    def request_finished(self, request: "Request", block_ids: list[int]):
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st)
        return False, None

    @staticmethod
    def _release(st: _ReqState) -> None:
        if st.lease is not None:
            st.lease.release()
            st.lease = None
            st.lease_step = None

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
        if per_block != self._ns.block_bytes:
            raise ValueError(f"cxlkv: the KV cache holds {per_block} bytes per block, the namespace "
                             f"{self._ns_name!r} expects {self._ns.block_bytes}")
        self._kv_arrays = [a.detach() for a in arrays]
        logger.info("cxlkv: %d KV layers registered, %s, block_dim=%d", len(arrays),
                    tuple(first.shape), self._block_dim)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for op in meta.loads:
            t0 = time.perf_counter()
            n = self._ns.load(op.keys, self._kv_arrays, op.block_ids, block_dim=self._block_dim)
            self._stats.data["load_s"] += time.perf_counter() - t0
            self._stats.data["load_blocks"] += n
            self._stats.data["load_bytes"] += n * self._ns.block_bytes
            if n < len(op.keys):
                self._stats.data["load_failed_blocks"] += len(op.keys) - n
                self._load_errors.update(op.block_ids[n:])
                logger.warning("cxlkv: %s: %d of %d blocks failed to load; vLLM recomputes them",
                               op.req_id, len(op.keys) - n, len(op.keys))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for op in meta.saves:
            t0 = time.perf_counter()
            n = self._ns.store(op.keys, self._kv_arrays, op.block_ids, block_dim=self._block_dim,
                               start_depth=op.start_depth)
            self._stats.data["save_s"] += time.perf_counter() - t0
            self._stats.data["save_blocks"] += n
            self._stats.data["save_bytes"] += n * self._ns.block_bytes

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, CxlKVStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> Optional[KVConnectorStats]:
        return CxlKVStats(data=dict(data)) if data is not None else CxlKVStats()

    def shutdown(self):
        try:
            self._pool.close()
        except Exception:  # noqa: BLE001 - shutdown must not raise
            pass
