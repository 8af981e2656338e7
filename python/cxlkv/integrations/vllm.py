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
the KV layout, dtype and scales, quantization, block size, the model's KV heads (not the TP
rank: heads.py), device layout: see identity.py and docs/IDENTITY.md), never from the served alias. LoRA adapters enter the keys by
content; prompt embeddings by their digest.

The connector is laid out like vLLM's own offloading connector: this module is the façade vLLM
loads (its module path is public), over the scheduler side (vllm_scheduler.py), the worker side
(vllm_worker.py), the identity of the KV bytes (vllm_identity.py), what both sides share
(vllm_common.py: the step's metadata, the pool session) and the stats and metrics
(vllm_metrics.py).

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
``share_engines`` (true, the default: where the KV bytes allow, the engine-neutral namespace
SGLang's HiCache backend shares, docs/IDENTITY.md "Across engines"; false: this engine's own),
``file_check_interval_s`` (default 0.001), ``async_saves`` (true, the default: no step waits
for a save; false: each step waits for its own), ``on_pool_error`` ("degrade": a pool that cannot be
opened means serving without the cache, the default; "fail": refuse to start),
``load_failure_policy`` ("recompute", the default the connector sets, or vLLM's "fail"),
``kv_events`` (BlockStored/BlockRemoved through vLLM's KV-event publisher; default: whether vLLM
publishes KV events), ``coalesce``
(default true), ``coalesce_wait_s`` (default 30, the cap of one wait) and
``coalesce_prefill_tokens_per_s`` (the prefill rate assumed before one is measured): a new prefix
requested from several engines at once is computed by one of them while the others wait for the
blocks it covers, each wait bounded by the estimated time to compute them (coalesce.py);
``window_checkpoint_blocks`` (default 16): a sliding-window group stores the window before every
this many blocks and before the prompt's last block boundary (vllm_groups.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from cxlkv.integrations import vllm_metrics
from cxlkv.integrations.vllm_common import ConnectorContext, CxlKVConnectorMetadata
from cxlkv.integrations.vllm_identity import CxlKVHandshake, derive_identity, hashes_loaded_weights
from cxlkv.integrations.vllm_metrics import STAT_KEYS, CxlKVStats
from cxlkv.integrations.vllm_scheduler import CxlKVScheduler
from cxlkv.integrations.vllm_worker import CxlKVWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# What earlier releases exported from this module (tests and tools import them from here).
__all__ = [
    "STAT_KEYS",
    "CxlKVConnector",
    "CxlKVConnectorMetadata",
    "CxlKVHandshake",
    "CxlKVStats",
    "derive_identity",
    "hashes_loaded_weights",
]


class CxlKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry point: each method goes to the side that runs it (vLLM builds one instance in
    the scheduler process, role SCHEDULER, and one in each worker, role WORKER).

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with this connector; each KV
    cache group (full attention, sliding window, chunked local attention, MLA) is stored in its
    own namespace (vllm_groups.py), and so is each SSM / linear-attention state group
    (vllm_state_groups.py: vLLM's "align" mode, TP=1); a group it cannot serve is refused at
    start-up (``vllm_groups.UnsupportedKVCacheGroup``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.connector_scheduler: CxlKVScheduler | None = None
        self.connector_worker: CxlKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = CxlKVScheduler(vllm_config, kv_cache_config)
        else:
            self.connector_worker = CxlKVWorker(vllm_config, kv_cache_config)

    @property
    def scheduler(self) -> CxlKVScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker"
        return self.connector_scheduler

    @property
    def worker(self) -> CxlKVWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    @property
    def _ctx(self) -> ConnectorContext:
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        return side.ctx

    # The connector's identity, namespace and pool session (either side's).
    @property
    def identity(self):
        return self._ctx.identity

    @property
    def _ns_name(self) -> str:
        return self._ctx.ns_name

    @property
    def _session(self):
        return self._ctx.session

    # ------------------------------------------------------------------------------------------
    # handshake: the workers name the namespace (vllm_identity.py)
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker: the identity this rank derived (vLLM hands it to the scheduler side)."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_handshake_metadata()

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_xfer_handshake_metadata_pp_aware(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.set_xfer_handshake_metadata(metadata)

    # ------------------------------------------------------------------------------------------
    # scheduler side (vllm_scheduler.py)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        """vLLM's hybrid manager: once per request, for every group (SupportsHMA)."""
        return self.scheduler.request_finished(request)

    def take_events(self) -> Iterable:
        if self.connector_scheduler is None:
            return ()
        return self.connector_scheduler.take_events()

    # ------------------------------------------------------------------------------------------
    # worker side (vllm_worker.py)
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(cast(CxlKVConnectorMetadata, self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(cast(CxlKVConnectorMetadata, self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = self.worker.take_failed_recving()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats()

    # ------------------------------------------------------------------------------------------
    # stats and metrics (vllm_metrics.py)
    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return CxlKVStats(data=dict(data)) if data is not None else CxlKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return vllm_metrics.CxlKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
