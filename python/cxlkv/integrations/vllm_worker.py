"""The worker side of the vLLM connector (vllm.py is the façade vLLM loads).

``start_load_kv`` scatters the matched blocks into vLLM's paged KV buffers before the forward
pass; ``wait_for_save`` submits the blocks that became full to a transfer thread (transfer.py)
and returns: the step never waits for a save. The blocks stay owned by the request until their
copy is done (``get_finished`` reports the request once its copies are done; preempted requests'
copies are waited for before the next forward: save_tracker.py). A block that fails to load
(evicted meanwhile, checksum mismatch) is reported through ``get_block_ids_with_load_errors`` and
vLLM recomputes it. The connector's stats (vllm_metrics.py) are collected here, the scheduler's
counters included (they arrive with each step's metadata)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cxlkv.integrations import vllm_groups as vg
from cxlkv.integrations import vllm_state_groups as vsg
from cxlkv.integrations.coalesce import CoalesceWorker
from cxlkv.integrations.heads import HeadNamespace, PerHeadTransfer, head_dim_of
from cxlkv.integrations.save_tracker import SaveTracker
from cxlkv.integrations.state_shards import StateNamespace, unit_views
from cxlkv.integrations.transfer import BlockOp, CpuSaveHandle, CpuTransfer, SaveHandle, Transfer
from cxlkv.integrations.vllm_common import ConnectorContext, CxlKVConnectorMetadata, logger
from cxlkv.integrations.vllm_identity import CxlKVHandshake
from cxlkv.integrations.vllm_metrics import CxlKVStats

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class CxlKVWorker:
    """The connector in each of vLLM's worker processes (one per TP rank)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self._stats = CxlKVStats()
        self._kv_cache_config = kv_cache_config
        self.ctx = ConnectorContext(
            vllm_config, kv_cache_config, is_worker=True, who=" (worker)", count=self._count_stat
        )
        self._session = self.ctx.session
        self._block_bytes = self.ctx.block_bytes
        self._can_load = self.ctx.can_load
        self._async_saves = self.ctx.async_saves
        self._kv_arrays: list = []
        self._block_dim = 0
        self._group_block_dims: list[int] = []  # per group (a state group's tensors: 0)
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._transfer: Transfer | None = None
        # A hybrid model's groups: one transfer each (its layers, its namespace); the saves of
        # bounded groups (sliding window) in flight, waited for before the next forward.
        self._group_transfers: list[Transfer] = []
        self._window_saves: list[SaveHandle] = []
        # A hybrid model's loads are asynchronous for vLLM (its only failure report for several
        # groups is a failed request): the requests loaded, and those that failed.
        self._recved: set[str] = set()
        self._failed_recving: set[str] = set()
        self._saves = SaveTracker()
        # Every TP rank polls and loads its own heads of a wait; rank 0 counts (vLLM sums the
        # ranks' stats, and a wait is one request's, whatever the ranks).
        self._coalesce_worker = CoalesceWorker(
            self._session,
            self._count_stat if self.ctx.tp_rank == 0 else _no_count,
            logger,
            groups=[self.ctx.group_session(g.index) for g in self.ctx.groups] if self.ctx.multi else None,
        )
        self.ctx.log_started("WORKER")

    def _count_stat(self, key: str, n: int = 1) -> None:
        self._stats.data[key] = self._stats.data.get(key, 0) + n

    def get_handshake_metadata(self) -> CxlKVHandshake:
        """Worker: the identity this rank derived (vLLM hands it to the scheduler side)."""
        return CxlKVHandshake(self.ctx.ns_name, self.ctx.identity.weights, self.ctx.identity.weights_source)

    def register_kv_caches(self, kv_caches: dict) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        # A state group's layer holds several tensors (conv, SSM state: vllm_state_groups.py)
        state_specs = {n: g.spec for g in self.ctx.groups if g.reach == vg.STATE for n in g.layer_names}
        kv_layers = [v for n, v in kv_caches.items() if n not in state_specs]
        if kv_layers:
            first = kv_layers[0]
        else:
            n0 = next(iter(state_specs))
            first = vsg.state_arrays(kv_caches[n0], state_specs[n0])[0]
        # CUDA-style layouts put K/V first: [2, num_blocks, ...]; CPU ones lead with blocks.
        self._block_dim = 1 if first.shape[0] == 2 and first.ndim > 1 and first.shape[1] == num_blocks else 0
        # Each group's layers, in vLLM's order (a hybrid model's groups may share tensors: their
        # block ids never collide, vLLM allocates them from one pool); a state layer's tensors
        # in its order (vLLM's state tensors lead with blocks).
        groups = [
            [a for n in g.layer_names for a in vsg.state_arrays(kv_caches[n], g.spec)]
            if g.reach == vg.STATE
            else [kv_caches[n] for n in g.layer_names]
            for g in self.ctx.groups
        ]
        self._group_block_dims = [0 if g.reach == vg.STATE else self._block_dim for g in self.ctx.groups]
        if not self.ctx.multi:
            groups = [[kv_caches[n] for n in kv_caches]]
        for g, arrays in enumerate(groups):
            bd = self._group_block_dims[g]
            per_block = sum(a.element_size() * a[(slice(None),) * bd + (0,)].numel() for a in arrays)
            want = self.ctx.group_block_bytes(g)
            if per_block != want:
                raise ValueError(
                    f"cxlkv: the KV cache holds {per_block} bytes per block, the namespace "
                    f"{self.ctx.ns_names[g]!r} expects {want}"
                )
        if any(
            h.split for g, h in zip(self.ctx.groups, self.ctx.group_heads, strict=True) if g.shards is None
        ):
            # The namespaces move this rank's heads through views of the arrays (heads.py).
            self.ctx.head_dim = int(
                self.ctx.extra.get("kv_head_dim")
                or head_dim_of(first, self._block_dim, len(self.ctx.heads.local))
            )
            spaces = self._session.ns  # None until the pool opens: open_namespace reads head_dim then
            spaces = spaces if isinstance(spaces, tuple) else [spaces]
            for ns in spaces:
                if isinstance(ns, HeadNamespace) and not isinstance(ns, StateNamespace) and ns.plan.split:
                    ns.head_dim = self.ctx.head_dim
        self._kv_arrays = [a.detach() for a in groups[self.ctx.primary]]
        if self.ctx.multi:
            self._group_transfers = [
                self._build_transfer(
                    first.is_cuda, self.ctx.group_session(g), [a.detach() for a in arrays], g
                )
                for g, arrays in enumerate(groups)
            ]
            self._transfer = self._group_transfers[self.ctx.primary]
        else:
            self._transfer = self._build_transfer(first.is_cuda, self._session, self._kv_arrays, 0)
        logger.info(
            "cxlkv: %d KV layers registered in %d group(s), %s, block_dim=%d",
            sum(len(a) for a in groups),
            len(groups),
            tuple(first.shape),
            self._block_dim,
        )

    def _build_transfer(self, on_cuda: bool, session: Any, arrays: list, group: int) -> Transfer:
        block_dim = self._group_block_dims[group] if self.ctx.multi else self._block_dim
        # KV on a GPU: the CUDA data path (transfer_cuda.py: one fused Triton kernel per batch,
        # through the pool mapping registered with CUDA, else staged); on the CPU the core's copy
        # engine (ns.store / ns.load) on a save thread.
        if on_cuda:
            from cxlkv.integrations.transfer_cuda import CudaTransfer

            heads = self.ctx.group_heads[group]
            shards = self.ctx.groups[group].shards if self.ctx.multi else None
            if shards is not None:  # a state group: a plan, reservations and pins per local unit
                return PerHeadTransfer(
                    session,
                    arrays,
                    block_dim,
                    self.ctx.identities[group].block_bytes,
                    0,
                    heads,
                    CudaTransfer,
                    views=lambda a, j: (unit_views(a, shards, len(heads.local), j), 1),
                )
            if heads.split:  # a plan, reservations and pins per local head
                assert self.ctx.head_dim is not None
                return PerHeadTransfer(
                    session,
                    arrays,
                    self._block_dim,
                    self.ctx.identities[group].block_bytes,
                    self.ctx.head_dim,
                    heads,
                    CudaTransfer,
                )
            return CudaTransfer(session, arrays, block_dim, self.ctx.group_block_bytes(group))
        return CpuTransfer(session, arrays, block_dim)

    def _transfer_for(self, op: BlockOp) -> Transfer | None:
        return self._group_transfers[op.group] if self._group_transfers else self._transfer

    def _bytes_of(self, op: BlockOp) -> int:
        return self.ctx.group_block_bytes(op.group)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Before this step's forward, which may write the blocks the preempted requests held.
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted:
            n = self._saves.pending(preempted)
            if n:
                self._stats.data["stores_waited_at_preemption"] += n
                if "preempted_saves" not in self.ctx.logged:
                    self.ctx.logged.add("preempted_saves")
                    logger.info(
                        "cxlkv: %d saves of preempted requests in flight: the forward waits for them "
                        "(logged once; counted as stores_waited_at_preemption)",
                        n,
                    )
            self._saves.wait_for(preempted)
        # vLLM frees a sliding window's blocks as the window moves past them (and may hand them
        # to another request in this step's schedule): the copies that read them end first.
        window_saves, self._window_saves = self._window_saves, []
        for h in window_saves:
            h.result()

    def start_load_kv(self, meta: CxlKVConnectorMetadata) -> None:
        self._failed_reqs = set()
        if self.ctx.tp_rank == 0:
            for k, v in meta.counters.items():
                self._stats.data[k] = self._stats.data.get(k, 0) + v
        self._coalesce_worker.add(meta.waits, meta.idle)
        for op in meta.loads:
            t0 = time.perf_counter()
            # Not retried after a fence: the blocks were pinned by the fenced node's lease.
            usable = self._session.usable()
            transfer = self._transfer_for(op)
            n = transfer.load(op) if transfer is not None and usable else 0
            if not usable:  # the pool could not be used: every block of the op fails
                self._stats.data["load_failed_unavailable_blocks"] += len(op.keys)
            self._account_load(t0, n, op)
            if self.ctx.multi:
                self._recved.add(op.req_id)
            if n < len(op.keys):
                self._stats.data["load_failed_blocks"] += len(op.keys) - n
                if self.ctx.multi:
                    self._failed_recving.add(op.req_id)
                else:
                    self._load_errors.update(op.block_ids[n:])
                self._failed_reqs.add(op.req_id)
                logger.warning(
                    "cxlkv: %s: %d of %d blocks failed to load; vLLM recomputes them",
                    op.req_id,
                    len(op.keys) - n,
                    len(op.keys),
                )

    def wait_for_save(self, meta: CxlKVConnectorMetadata) -> None:
        for op in meta.saves:
            if self._async_saves:  # its blocks are held: reported in finished_sending whatever happens below
                self._saves.note(op.req_id)
            if op.req_id in self._failed_reqs:
                # Defence in depth (the scheduler holds such saves): this rank's load failed in
                # this very step, so this step's KV of the request sits on missing blocks.
                self._stats.data["stores_dropped_after_failed_load"] += len(op.keys)
                continue
            transfer = self._transfer_for(op)
            if transfer is not None and self._session.usable():
                handle = transfer.submit_save(op)
                self._saves.add(op, handle)
                if self.ctx.groups[op.group].bounded:
                    self._window_saves.append(handle)
        if not self._can_load or not self._async_saves:
            # Synchronous saves (the "async_saves": false opt-out), and a prefill instance
            # (kv_producer) in any mode: its answer tells the proxy that the decode instance may
            # load the prompt's KV now, so the step ends once it is published.
            self._saves.wait_for({op.req_id for op in meta.saves})
        self._account_saves()

    def _account_saves(self) -> None:
        for op, handle in self._saves.completed():
            n = handle.result()
            if not self.ctx.group_heads[op.group].writes:
                # A replica (an MLA latent on a rank > 0, a KV head another rank writes): it
                # writes nothing, and its result is what it found of the writer's (heads.py)
                continue
            if isinstance(handle, CpuSaveHandle):
                if handle.refused:  # the pool is unusable: nothing to count
                    continue
                self._stats.data["store_s"] += handle.seconds
                self._stats.data["store_op_s"].append(handle.seconds)
            self._stats.data["store_blocks"] += n
            self._stats.data["store_bytes"] += n * self._bytes_of(op)
            if self.ctx.multi:
                self._count_stat(f"store_blocks_group{op.group}", n)
            if n < len(op.keys):
                self._stats.data["store_failed_blocks"] += len(op.keys) - n
                self.ctx.once(
                    "save_failed",
                    "cxlkv: %s: %d of %d blocks could not be saved to pool %s "
                    "(no free block: the pool is full of pinned or in-flight blocks); "
                    "see `cxlkv pool stats` puts_failed",
                    op.req_id,
                    len(op.keys) - n,
                    len(op.keys),
                    self.ctx.pool_path,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._account_saves()
        sending = self._saves.finished_sending(finished_req_ids)
        recving, errors = self._coalesce_worker.poll(finished_req_ids, self._load_waited)
        self._load_errors |= errors
        self._failed_recving |= self._coalesce_worker.take_failed()
        recving, self._recved = set(recving or ()) | self._recved, set()
        return sending or None, recving or None

    def _load_waited(self, op: BlockOp) -> int:
        """A coalesced wait's blocks, through the same checksummed load as every load."""
        transfer = self._transfer_for(op)
        if transfer is None:
            return 0
        t0 = time.perf_counter()
        n = transfer.load(op)
        self._account_load(t0, n, op)
        return n

    def _account_load(self, t0: float, n: int, op: BlockOp) -> None:
        """One load op's time and the blocks it delivered, for the connector's stats."""
        dt = time.perf_counter() - t0
        self._stats.data["load_s"] += dt
        self._stats.data["load_op_s"].append(dt)
        self._stats.data["load_blocks"] += n
        self._stats.data["load_bytes"] += n * self._bytes_of(op)
        if self.ctx.multi:
            self._count_stat(f"load_blocks_group{op.group}", n)

    def take_failed_recving(self) -> set[str]:
        """Requests of get_finished's finished_recving whose load failed (vLLM recomputes them)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self._account_saves()
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, CxlKVStats()
        return out

    def shutdown(self) -> None:
        for transfer in self._group_transfers or ([self._transfer] if self._transfer is not None else []):
            transfer.close()  # lets the queued saves finish (bounded)
        self._session.close()


def _no_count(key: str, n: float = 1) -> None:
    """A TP rank other than 0: its coalescing outcome is counted by rank 0."""
