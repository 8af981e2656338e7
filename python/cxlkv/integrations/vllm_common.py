"""What both sides of the vLLM connector share (vllm.py is the façade, vllm_scheduler.py and
vllm_worker.py its two sides): the metadata the scheduler sends the workers each step, and the
connector's context (its configuration, identity, namespace name and pool session) that each side
builds from vLLM's configs for itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

import cxlkv
from cxlkv.integrations import identity as ident
from cxlkv.integrations import vllm_groups as vg
from cxlkv.integrations import vllm_identity as vid
from cxlkv.integrations.heads import HeadNamespace
from cxlkv.integrations.placement import placement_device
from cxlkv.integrations.pool_session import PoolSession
from cxlkv.integrations.save_tracker import async_saves_enabled
from cxlkv.integrations.state_shards import StateNamespace
from cxlkv.integrations.tenant import tenant_of

# Under the "vllm" logger, so that vLLM's logging configuration (level, format) applies.
logger = init_logger("vllm.cxlkv")


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


class ConnectorContext:
    """One side's view of the connector: configuration, identity, namespace and pool session.

    ``is_worker``: the worker side (it holds the loaded weights and names the namespace by them;
    the scheduler side waits for the workers' name, see vllm_identity.py). ``count(key)`` adds one
    to that side's counters (the session counts fences and a disabled pool)."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        *,
        is_worker: bool,
        who: str,
        count: Callable[[str], None],
    ) -> None:
        tc = vllm_config.kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        self.extra = extra
        self.block_size: int = vllm_config.cache_config.block_size
        self.can_load = not tc.is_kv_producer or tc.is_kv_consumer
        self.can_save = not tc.is_kv_consumer or tc.is_kv_producer
        # A block that fails to load (evicted, corrupt) is a cache miss: have vLLM recompute it.
        # vLLM's default policy fails the request instead; keep it only when asked to.
        if extra.get("load_failure_policy", "recompute") == "recompute":
            tc.kv_load_failure_policy = "recompute"
        # Saves off the critical path (issue 16), the default: the step submits them and returns;
        # vLLM frees a finished request's blocks once its copies are done (request_finished /
        # get_finished), a step later than without the connector. "async_saves": false makes each
        # step wait for its own saves (and frees at once).
        self.async_saves = async_saves_enabled(extra)
        # "tenant": the quota label this engine's saves are charged to (`cxlkv pool quota`); not part
        # of any key: engines of other tenants with the same model share its blocks.
        self.tenant = tenant_of(extra)
        pool_path = extra.get("pool_path") or cxlkv.default_pool_path()
        # A striped pool: a comma-separated string or a JSON list of device paths.
        self.pool_path = ",".join(map(str, pool_path)) if isinstance(pool_path, list) else str(pool_path)
        self.awaits_workers = not is_worker and vid.hashes_loaded_weights(extra)
        # One identity and namespace per KV cache group (vllm_groups.py); "identity" and "ns_name"
        # are the primary group's (the one that names requests' blocks in events and coalescing).
        self.groups = vg.group_layouts(
            kv_cache_config,
            self.block_size,
            vllm_config.parallel_config.tensor_parallel_size,
            text_config=vid.text_config_of(vllm_config),
        )
        self.primary = vg.primary_group(self.groups)
        self.checkpoint_blocks = int(extra.get("window_checkpoint_blocks", vg.DEFAULT_CHECKPOINT_BLOCKS))
        if self.checkpoint_blocks < 1:
            raise ValueError(f"cxlkv: window_checkpoint_blocks must be >= 1, not {self.checkpoint_blocks}")
        self.identities = vid.describe(vllm_config, kv_cache_config, is_worker, extra)
        self.ns_names = self._names(self.identities)
        self.tp_rank = vid.tp_rank_of(vllm_config, is_worker)
        # This rank's KV heads, per group (heads.py): one pool entry per block and KV head; a
        # state group's units (state_shards.py): one entry per block and unit.
        self.group_heads = [
            vid.head_plan(vllm_config, g.spec, vid.kind_of(g.spec), self.tp_rank, g.shards)
            for g in self.groups
        ]
        self.head_dim: int | None = None  # the KV arrays' head dim (the worker's register_kv_caches)
        self.logged: set[str] = set()

        def open_pool(create: bool) -> cxlkv.Pool:
            if not create:  # again, after a fence: the pool that was there, never a new one
                return cxlkv.Pool.open(self.pool_path)
            return cxlkv.Pool.open_or_create(
                self.pool_path,
                extra.get("pool_size", "4GiB"),
                **({"chunk_size": extra["chunk_size"]} if "chunk_size" in extra else {}),
            )

        def open_namespace(pool: cxlkv.Pool) -> Any:
            if self.awaits_workers:  # identity: opened when the workers report (handshake)
                return vid.AwaitingWorkers(lambda: self.open_namespace(pool))
            return self.open_namespace(pool)

        # Every use of the pool goes through self.session.call, which runs nothing while the pool
        # is unusable (from the start when opening failed), and opens it again after a fence. A
        # damaged or unusable pool must not keep the engine from serving (without the cache);
        # "on_pool_error": "fail" restores fail-fast start-up.
        self.session = PoolSession(
            self.pool_path,
            logger,
            open_pool,
            open_namespace,
            who=who,
            check_interval_s=float(extra.get("file_check_interval_s", 0.001)),
            count=count,
            fail_fast=extra.get("on_pool_error", "degrade") == "fail",
        )

    def _names(self, identities: list) -> list[str]:
        override = self.extra.get("namespace")
        if not override:
            return [i.namespace_name() for i in identities]
        if len(identities) == 1:
            return [ident.short_name(str(override))]
        return [ident.short_name(f"{override}/group{g}") for g in range(len(identities))]

    # The primary group's identity and namespace (the only ones of a model with one group).
    @property
    def identity(self) -> ident.KVIdentity:
        return self.identities[self.primary]

    @property
    def ns_name(self) -> str:
        return self.ns_names[self.primary]

    @property
    def heads(self) -> Any:
        """The primary group's head plan (HeadPlan)."""
        return self.group_heads[self.primary]

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one block of a group in this rank's KV arrays: its local heads' entries."""
        return self.identities[group].block_bytes * len(self.group_heads[group].local)

    @property
    def block_bytes(self) -> int:
        return self.group_block_bytes(self.primary)

    @property
    def multi(self) -> bool:
        """Served group by group (vllm_groups.py): several groups, or a state group (its hit
        is one block per boundary, not the whole prefix)."""
        return len(self.groups) > 1 or any(g.reach == vg.STATE for g in self.groups)

    def adopt_weights(self, weights: str, weights_source: str) -> None:
        """The workers' weights field (vLLM's handshake) for every group's identity."""
        self.identities = [
            dataclasses.replace(i, weights=weights, weights_source=weights_source) for i in self.identities
        ]
        self.ns_names = self._names(self.identities)

    def open_namespace(self, pool: cxlkv.Pool) -> Any:
        """The namespace, or a hybrid model's namespaces (GroupNamespaces, one per group). Block
        keys in, per-head entries in the pool: lookups ask for every head, loads and stores move
        this rank's (heads.py)."""
        device = placement_device(self.extra.get("pool_device"), self.tp_rank, len(pool.info()["devices"]))
        spaces = [
            StateNamespace(
                pool.namespace(vid.pool_layout(i), name=n, device=device, tenant=self.tenant), h, g.shards
            )
            if g.shards is not None
            else HeadNamespace(
                pool.namespace(vid.pool_layout(i), name=n, device=device, tenant=self.tenant),
                h,
                self.head_dim if h.split else None,
            )
            for g, i, n, h in zip(self.groups, self.identities, self.ns_names, self.group_heads, strict=True)
        ]
        return GroupNamespaces(spaces) if self.multi else spaces[0]

    def group_session(self, group: int) -> Any:
        """The pool session as one group sees it (its calls run on the group's namespace)."""
        return GroupSession(self.session, group) if self.multi else self.session

    def once(self, cause: str, msg: str, *args: Any) -> None:
        """A warning logged once per cause and process."""
        if cause not in self.logged:
            self.logged.add(cause)
            logger.warning(msg + " (logged once; counted in the connector's metrics)", *args)

    def log_started(self, role_name: str) -> None:
        logger.info(
            "cxlkv connector (%s) on pool %s as node %d, namespace %r (%s), %d-byte blocks",
            role_name,
            self.pool_path,
            self.session.node,
            self.ns_name,
            self.identity.source(),
            self.block_bytes,
        )


class GroupNamespaces(tuple):
    """A hybrid model's namespaces in one pool session, indexed by KV cache group: a fence reopens
    them all at once (pool_session.py)."""


class GroupSession:
    """The pool session seen by one KV cache group: ``call`` runs on that group's namespace; the
    rest (usable, retire, guard, pool, close...) is the session's."""

    def __init__(self, session: PoolSession, group: int) -> None:
        self._session = session
        self.group = group

    def call(self, what: str, fn: Callable[..., Any], *, retry: bool = True) -> Any:
        return self._session.call(what, lambda spaces: fn(spaces[self.group]), retry=retry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)
