"""The scheduler side of the vLLM connector (vllm.py is the façade vLLM loads).

``get_num_new_matched_tokens`` asks the in-pool index directly (``acquire``: a lookup that also
pins the matched blocks, so they cannot be evicted before the worker loads them); the lease is
released once the step that loads them has completed, or when the request ends.
``build_connector_meta`` plans each step's loads and saves (whole blocks that became full); saves
planned while a request's load is unconfirmed are held until the step that loads it completed
without errors, and dropped when it failed (those blocks are saved again once vLLM recomputed
them). Coalescing of new prefixes across engines (coalesce.py) and the connector's KV events
(vllm_events.py) run here. The scheduler's counters travel to the worker with each step's
metadata (vLLM collects the connector's stats on the worker side)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from cxlkv.integrations import identity as ident
from cxlkv.integrations import vllm_groups as vg
from cxlkv.integrations import vllm_state_groups as vsg
from cxlkv.integrations.coalesce import NULL_BLOCK, CoalesceConfig, CoalesceScheduler, compute_place
from cxlkv.integrations.keys import ChainedKeys, MMSpan, root_key
from cxlkv.integrations.transfer import BlockOp
from cxlkv.integrations.vllm_common import ConnectorContext, CxlKVConnectorMetadata, logger
from cxlkv.integrations.vllm_identity import CxlKVHandshake

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclasses.dataclass
class _ReqState:
    request: Any
    keys: ChainedKeys | None  # the primary group's; None: the request is not cached (see _keys_for)
    # Per KV cache group (vllm_groups.py): its keys (group_keys[primary] is keys) and vLLM's block
    # ids for the request (null blocks where a bounded group freed them).
    group_keys: list = dataclasses.field(default_factory=list)
    group_blocks: list = dataclasses.field(default_factory=list)
    # Blocks [0, saved_blocks) are in the pool, planned/held, or (bounded groups) skipped: no
    # later hit needs them.
    saved_blocks: int = 0
    load: list | None = None  # BlockOps per group, matched, not yet sent to the worker
    inflight: list | None = None  # sent with step `lease_step`, outcome unknown
    held: list = dataclasses.field(default_factory=list)  # saves waiting for `inflight`'s outcome
    lease: list = dataclasses.field(default_factory=list)  # one per group with pinned blocks
    load_from: int = 0  # the blocks vLLM had locally when `load` was matched
    async_floor: int = 0  # a hybrid model's asynchronous load brought blocks [0, async_floor)
    lease_step: int | None = None  # step whose metadata carries the load of this lease
    saving: bool = False  # a save of it went to the workers: its blocks are freed once they say so


def _prompt_tokens(st: _ReqState, computed: int, scheduled: int) -> int:
    """Of a request's tokens scheduled in a step, those that compute its prompt (prefill)."""
    prompt = int(getattr(st.request, "num_prompt_tokens", 0) or 0)
    return max(0, min(computed + scheduled, prompt) - computed)


class CxlKVScheduler:
    """The connector in vLLM's scheduler process."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self._vllm_config = vllm_config
        self._counters: dict[str, int] = {}  # sent to the worker per step
        self.ctx = ConnectorContext(
            vllm_config, kv_cache_config, is_worker=False, who=" (scheduler)", count=self._count
        )
        self._session = self.ctx.session
        self._block_size = self.ctx.block_size
        self._cache_config = getattr(vllm_config, "cache_config", None)
        self._can_load, self._can_save = self.ctx.can_load, self.ctx.can_save
        self._async_saves = self.ctx.async_saves
        self._adapters: dict[tuple[str, float], str | None] = {}
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._completed_steps = 0
        self._disabled_reported = False
        self._async_loads: list[BlockOp] = []  # a hybrid model's loads, sent with the next step
        # Each group's view of the session (its namespace); the primary group's names requests'
        # blocks in events and coalescing.
        self._groups = [self.ctx.group_session(g.index) for g in self.ctx.groups]
        self._primary = self._groups[self.ctx.primary]
        cfg = CoalesceConfig.from_extra(self.ctx.extra)
        # Tensor parallelism: on (coalesce.py: a wait's blocks count as present once every head's
        # entry is, and vLLM truncates the request at the first block any rank failed to load).
        # Hybrid models: a wait is for a boundary its writer marked as servable in every group,
        # all or nothing; with a state group only the prompt's last boundary is marked (the one
        # where vLLM's "align" mode always ends a chunk, so the state there is stored).
        sched_cfg = getattr(vllm_config, "scheduler_config", None)
        self._coalesce = CoalesceScheduler(
            cfg,
            self._primary,
            self._count,
            logger,
            block_size=self._block_size,
            chunk_tokens=int(getattr(sched_cfg, "max_num_batched_tokens", 0) or 2048),
            place=compute_place(str(getattr(getattr(vllm_config, "device_config", None), "device_type", ""))),
            groups=list(self.ctx.groups) if self.ctx.multi else None,
            checkpoint=self.ctx.checkpoint_blocks,
            prompt_anchor_only=any(g.reach == vg.STATE for g in self.ctx.groups),
        )
        self.ctx.log_started("SCHEDULER")

    def _count(self, key: str, n: int = 1) -> None:
        self._counters[key] = self._counters.get(key, 0) + n

    # ------------------------------------------------------------------------------------------
    # identity: the namespace the workers name (vLLM's handshake)
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
        if not self.ctx.awaits_workers or not isinstance(meta, CxlKVHandshake):
            return
        self.ctx.awaits_workers = False
        others = {m.namespace for m in metadata.values() if isinstance(m, CxlKVHandshake)} - {meta.namespace}
        if others:  # every rank stores its heads into one namespace: they must agree on it
            self._session.guard.fail(
                "the TP ranks derived different KV namespaces",
                ValueError(f"rank 0: {meta.namespace}, others: {sorted(others)}"),
            )
            return
        adopted = dataclasses.replace(
            self.ctx.identity, weights=meta.weights, weights_source=meta.weights_source
        )
        if adopted.namespace_name() != meta.namespace:
            self._session.guard.fail(
                "the workers derived another KV namespace",
                ValueError(
                    f"workers: {meta.namespace}, scheduler: {adopted.namespace_name()} ({adopted.source()})"
                ),
            )
            return
        self.ctx.adopt_weights(meta.weights, meta.weights_source)
        # The session's pool now (it may be a new node after a fence); a fence here reopens it.
        ns = self._session.call("namespace", lambda _awaiting: self.ctx.open_namespace(self._session.pool))
        if ns is not None:
            self._session.ns = ns
        logger.info(
            "cxlkv: namespace %r (%s), reported by the workers", self.ctx.ns_name, self.ctx.identity.source()
        )

    # ------------------------------------------------------------------------------------------
    # keys
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
                self.ctx.once(
                    f"lora:{path}",
                    "cxlkv: LoRA adapter %r at %r cannot be hashed (%s); its requests are not cached",
                    getattr(lora, "lora_name", "?"),
                    path,
                    e,
                )
                self._adapters[key] = None
        return self._adapters[key]

    def _keys_for(self, request: Request, group: int | None = None) -> ChainedKeys | None:
        """The request's chained block keys in a group's namespace (default: the primary's)."""
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
            root_key(
                self.ctx.ns_names[self.ctx.primary if group is None else group],
                lora_id,
                getattr(request, "cache_salt", None),
            ),
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
            keys = [self._keys_for(request, g) for g in range(len(self.ctx.groups))]
            st = _ReqState(request, keys[self.ctx.primary], group_keys=keys)
            if st.keys is None:
                self._count("uncacheable_requests")
            self._reqs[request.request_id] = st
        return st

    # ------------------------------------------------------------------------------------------
    # lookups, allocation, the plan of each step
    def _keep_block_size(self) -> None:
        """Put back vLLM's cache block size where its engine core lost it after start-up.

        vLLM rounds a hybrid model's block size up so that a page holds an SSM state (the tiny
        Qwen3-Next with two key heads: 128 -> 256 tokens), in the workers, and its engine core
        copies the groups' size into its config before it builds its scheduler and this connector
        (``EngineCore._initialize_kv_caches``). A multiprocess engine core (every TP > 1 engine,
        and ``vllm serve``) then re-runs the config's ``__post_init__`` once its handshake with the
        front end is done (vLLM 0.32 ``EngineCoreProc._perform_handshakes``), and the platform's
        defaults put the unrounded size back (vLLM CPU: 128). Its scheduler ends prefill chunks in "align" mode on
        multiples of that field (``Scheduler._mamba_block_aligned_split``), so with 256-token
        blocks a 401-token prompt's chunk ended at 384, mid-block: no step ended on a block
        boundary, no state was stored (counted as skipped), and no engine could resume there
        (vLLM's own prefix cache of states relies on the same chunk ends). The groups' size is what the workers and vLLM's KV
        cache manager use: restored before the first request is scheduled (the scheduler asks
        this connector before it sizes a new request's chunk)."""
        cc = self._cache_config
        if cc is None or getattr(cc, "block_size", self._block_size) == self._block_size:
            return
        logger.info(
            "cxlkv: vLLM's engine core reset its cache block size to %s after start-up (its config "
            "re-initialised); its KV cache groups use %d-token blocks: restored, so that prefill "
            "chunks end on their block boundaries, where SSM states are stored",
            cc.block_size,
            self._block_size,
        )
        cc.block_size = self._block_size
        if getattr(cc, "mamba_cache_mode", None) == "align":
            cc.mamba_block_size = self._block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        self._keep_block_size()
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
        if self.ctx.multi:
            return self._match_groups(st, request, prompt, have, max_blocks)
        lease = self._primary.call("acquire", lambda ns: ns.acquire(keys[:max_blocks]))
        if lease is None:
            return 0, False
        hit = len(lease)
        self._count("lookup_tokens", (max_blocks - have) * self._block_size)
        self._count("hit_tokens", max(0, hit - have) * self._block_size)
        if hit < max_blocks:
            # capped by pin slots: the next block is in the pool, nobody needs to compute it
            capped = self._check_pin_cap(request.request_id, keys[hit:max_blocks], hit)
            wait = None if capped else self._coalesce_miss(request.request_id, keys, have, hit, max_blocks)
            if wait is not None:  # another engine computes the next blocks: wait for those only
                self._session.retire(lease)
                return len(wait.op.keys) * self._block_size, True
        if hit <= have:
            self._session.retire(lease)
            return 0, False
        st.lease, st.load_from = [lease], have
        st.load = [BlockOp(request.request_id, keys[have:hit], [], start_depth=have)]
        logger.debug(
            "cxlkv: %s: %d of %d prompt blocks in the pool (%d computed locally)",
            request.request_id,
            hit,
            max_blocks,
            have,
        )
        return (hit - have) * self._block_size, False

    def _prefill_backlog(self, req_id: str) -> int:
        """Prompt tokens other requests of this engine still have to compute (running or queued):
        a request that computed its blocks itself would share the steps with them."""
        return sum(
            max(
                0, int(st.request.num_prompt_tokens) - int(getattr(st.request, "num_computed_tokens", 0) or 0)
            )
            for rid, st in self._reqs.items()
            if rid != req_id
        )

    def _match_groups(self, st: _ReqState, request: Request, prompt: list, have: int, max_blocks: int):
        """A hybrid model's hit: the deepest block boundary every group can serve (vllm_groups.py),
        each group's needed blocks pinned; vLLM's local hit covers [0, have) in every group."""
        keys = [k.extend(prompt, upto_blocks=max_blocks) for k in st.group_keys]
        self._count("lookup_tokens", (max_blocks - have) * self._block_size)
        pinned = self._pin_groups(keys, have, max_blocks)
        hit, leases = pinned if pinned is not None else (have, [])
        if hit < max_blocks and (pinned is not None or self._session.usable()):
            wait = self._coalesce_miss(
                request.request_id, keys[self.ctx.primary], have, hit, max_blocks, group_keys=keys
            )
            if wait is not None:  # another engine makes a deeper boundary servable: wait for it
                for x in leases:
                    self._session.retire(x)
                return len(wait.op.keys) * self._block_size, True
        if pinned is None:
            return 0, False
        st.lease, st.load_from = leases, have
        st.load = []
        for g in self.ctx.groups:
            lo = max(g.first_needed(hit), have)
            st.load.append(
                BlockOp(request.request_id, keys[g.index][lo:hit], [], start_depth=lo, group=g.index)
            )
        self._count("hit_tokens", (hit - have) * self._block_size)
        logger.debug(
            "cxlkv: %s: %d of %d prompt blocks served by every group (%d computed locally)",
            request.request_id,
            hit,
            max_blocks,
            have,
        )
        # An asynchronous load: vLLM takes a failed load of a model with several groups only as a
        # failed request (failed_recving, then recomputed from scratch), never as failed blocks.
        return (hit - have) * self._block_size, True

    def _coalesce_miss(
        self, req_id: str, keys: list, have: int, hit: int, max_blocks: int, group_keys: list | None = None
    ) -> Any:
        """The pool hit ends at `hit` < `max_blocks`: coalescing takes this request's intents and
        says whether it waits for another engine (coalesce.py CoalesceScheduler.on_miss)."""
        return self._coalesce.on_miss(
            req_id,
            keys,
            have,
            hit,
            max_blocks,
            self._can_save,
            self._can_load,
            backlog=self._prefill_backlog(req_id),
            group_keys=group_keys,
        )

    def _pin_groups(self, keys: list, have: int, max_blocks: int) -> tuple[int, list] | None:
        """The deepest boundary every group serves (> have) and each group's needed blocks pinned
        there; None when there is none (or the pool is unusable)."""
        hit = max_blocks
        for _ in range(4):  # pins that lost a race with eviction: look again, a few times
            hit = self._common_hit(keys, have, hit)
            if hit <= have:
                return None
            leases: list = []
            short: int | None = None
            for g in self.ctx.groups:
                lo = max(g.first_needed(hit), have)
                lease = self._groups[g.index].call(
                    "acquire", lambda ns, k=keys[g.index][lo:hit]: ns.acquire(k)
                )
                if lease is None:  # the pool became unusable
                    for x in leases:
                        self._session.retire(x)
                    return None
                leases.append(lease)
                if len(lease) < hit - lo:
                    short = lo + len(lease)
                    break
            if short is None:
                break
            for x in leases:
                self._session.retire(x)
            hit = short
        else:
            return None
        return hit, leases

    def _common_hit(self, keys: list, have: int, hit: int) -> int:
        """The deepest boundary <= hit where every group has the blocks it needs (those below
        ``have`` are local), by lookups without pins."""
        while hit > have:
            before = hit
            for g in self.ctx.groups:
                while hit > have:
                    lo = max(g.first_needed(hit), have)
                    n = self._groups[g.index].call(
                        "match_prefix", lambda ns, k=keys[g.index][lo:hit]: ns.match_prefix(k)
                    )
                    if n is None:
                        return 0
                    if n >= hit - lo:
                        break
                    # the first missing block lo + n is in the reach of every boundary in
                    # (lo + n, hit]: the next candidate is lo + n
                    hit = lo + n
            if hit == before:
                return hit
        return hit

    def _check_pin_cap(self, req_id: str, rest: list, hit: int) -> bool:
        """A hit that stopped while the next block is in the pool was capped by pin slots."""
        more = self._primary.call("match_prefix", lambda ns: ns.match_prefix(rest)) or 0
        if more > 0:
            self._count("pin_capped_requests")
            self._count("pin_capped_blocks", more)
            self.ctx.once(
                "pin_cap",
                "cxlkv: %s: the prefix hit stopped at %d blocks although %d more "
                "are in pool %s: the pool's pin slots are exhausted (create it with more "
                "pin_slots)",
                req_id,
                hit,
                more,
                self.ctx.pool_path,
            )
        return more > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        ids = blocks.get_block_ids()
        if self._coalesce.allocated(
            request.request_id, ids[self.ctx.primary], num_external_tokens, self._block_size, group_ids=ids
        ):
            return
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None:
            return
        if num_external_tokens == 0:
            st.load = None
            self._release(st)
            return
        # vLLM may grant fewer tokens than offered: each group loads what that hit needs (a
        # block it did not pin may be gone: the worker reports it, and vLLM recomputes)
        hit = st.load_from + num_external_tokens // self._block_size
        for op in st.load:
            g = self.ctx.groups[op.group]
            lo = max(g.first_needed(hit), st.load_from)
            op.keys = list(st.group_keys[op.group].keys[lo:hit])
            op.start_depth = lo
            op.block_ids = list(ids[op.group][lo:hit])
            if len(op.block_ids) != len(op.keys) or (self.ctx.multi and NULL_BLOCK in op.block_ids):
                logger.warning(
                    "cxlkv: %s: %d blocks allocated for %d external blocks of group %d; not loading",
                    request.request_id,
                    len(op.block_ids),
                    len(op.keys),
                    op.group,
                )
                st.load = None
                self._release(st)
                return
        if self.ctx.multi:  # sent with the next step's metadata; the request waits for it
            self._async_loads.extend(st.load)
            st.inflight, st.load, st.async_floor = st.load, None, hit

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CxlKVConnectorMetadata:
        self._step += 1
        meta = CxlKVConnectorMetadata(
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        )
        if not self._session.usable() and self._session.disabled and not self._disabled_reported:
            self._disabled_reported = True
            self._count("pool_disabled")
        meta.waits = self._coalesce.take_waits()
        meta.loads, self._async_loads = self._async_loads, []
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        for req_id in meta.preempted:
            self._coalesce.release(req_id, "preempted")
        sched = scheduler_output.num_scheduled_tokens
        prefill = 0  # prompt tokens this step computes: the coalescing bound's rate (coalesce.py)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            prefill += _prompt_tokens(st, new.num_computed_tokens, sched.get(new.req_id, 0))
            st.group_blocks = [list(b) for b in new.block_ids]
            # blocks in the pool: a coalesced wait's, an asynchronous load's
            st.saved_blocks = max(self._coalesce.loaded_floor(new.req_id), st.async_floor)
            # (Re)scheduled from scratch (a preempted request may come back as new): the KV of
            # held saves lived in blocks it no longer owns.
            self._drop_held(st, "rescheduled as new")
            n = sched.get(new.req_id, 0)
            self._plan(st, new.req_id, new.num_computed_tokens + n, meta, n)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            prefill += _prompt_tokens(st, cached.num_computed_tokens[i], sched.get(req_id, 0))
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: the KV of held saves is gone; recompute re-saves them.
                st.group_blocks = [list(b) for b in new_ids] if new_ids else [[] for _ in self.ctx.groups]
                self._drop_held(st, "preempted")
            elif new_ids:
                for have_ids, more in zip(st.group_blocks, new_ids, strict=False):
                    have_ids.extend(more)
            n = sched.get(req_id, 0)
            self._plan(st, req_id, cached.num_computed_tokens[i] + n, meta, n)
        self._coalesce.rate.step_planned(prefill)
        if not self._async_saves:  # this step's saves are published when it completes
            for req_id, st in self._reqs.items():  # held saves are not sent yet
                sent = st.held[0].start_depth if st.held else st.saved_blocks
                self._coalesce.saves_planned(req_id, sent, self._step)
        meta.counters, self._counters = {k: v for k, v in self._counters.items() if v}, {}
        return meta

    def _plan(self, st: _ReqState, req_id: str, computed_after_step: int, meta, scheduled: int = 0) -> None:
        # A load planned for this step is sent even when the pool has failed since: the worker
        # then reports its blocks as load errors, and vLLM recomputes them.
        if st.load is not None and any(op.block_ids for op in st.load):
            ops = [op for op in st.load if op.block_ids]
            meta.loads.extend(ops)
            st.saved_blocks = max(st.saved_blocks, max(op.start_depth + len(op.keys) for op in ops))
            st.inflight, st.lease_step = ops, self._step
            st.load = None
        if not self._can_save or st.keys is None or not self._session.usable():
            return
        if st.held and st.inflight is None:  # their load was confirmed
            meta.saves.extend(st.held)
            st.held, st.saving = [], True
        tokens = st.request.all_token_ids
        full = min(computed_after_step, len(tokens)) // self._block_size
        full = min(full, *(len(ids) for ids in st.group_blocks)) if st.group_blocks else 0
        if full <= st.saved_blocks:
            return
        first = st.saved_blocks
        st.saved_blocks = full
        ops = []
        if not self.ctx.multi:
            keys = st.keys.extend(tokens, upto_blocks=full)
            ops.append(BlockOp(req_id, keys[first:full], st.group_blocks[0][first:full], first))
        else:
            ops = self._plan_groups(st, req_id, tokens, first, full, computed_after_step, scheduled)
        # KV computed while a load is unconfirmed may sit on top of blocks that never arrived.
        if st.inflight is not None:
            st.held.extend(ops)
        elif ops:
            meta.saves.extend(ops)
            st.saving = True

    def _plan_groups(
        self, st: _ReqState, req_id: str, tokens: list, first: int, full: int, end: int, scheduled: int
    ) -> list:
        """A hybrid model's saves of blocks [first, full): every block of a full-attention group;
        of a bounded group (sliding window, chunked local) the blocks some anchor's hit needs
        (vllm_groups.py), of a state group the state this step left at an anchor boundary
        (vllm_state_groups.py); the others counted as skipped."""
        prompt_anchor = (int(st.request.num_prompt_tokens) - 1) // self._block_size
        produced = vsg.produced_block(end - scheduled, end, self._block_size)
        ops = []
        for g in self.ctx.groups:
            keys = st.group_keys[g.index].extend(tokens, upto_blocks=full)
            ids = st.group_blocks[g.index]
            run: list[int] = []
            for j in [*range(first, full), None]:
                keep = (
                    j is not None
                    and ids[j] != NULL_BLOCK  # freed out of the window already
                    and (g.reach != vg.STATE or j == produced)  # a state only when produced
                    and g.anchors_needing(j, self.ctx.checkpoint_blocks, prompt_anchor)
                )
                if keep:
                    if run and run[-1] != j - 1:
                        ops.append(self._op(req_id, g.index, keys, ids, run))
                        run = []
                    run.append(j)
                elif j is not None:
                    self._count(f"skip_blocks_group{g.index}")
            if run:
                ops.append(self._op(req_id, g.index, keys, ids, run))
        return ops

    @staticmethod
    def _op(req_id: str, group: int, keys: list, ids: list, run: list) -> BlockOp:
        lo, hi = run[0], run[-1] + 1
        return BlockOp(req_id, keys[lo:hi], ids[lo:hi], lo, group=group)

    def _drop_held(self, st: _ReqState, why: str) -> None:
        if st.held:
            st.saved_blocks = min(st.saved_blocks, min(h.start_depth for h in st.held))
            logger.debug("cxlkv: %s: %d held saves dropped (%s)", st.held[0].req_id, len(st.held), why)
            st.held = []

    def update_connector_output(self, connector_output) -> None:
        # One call per completed step, in order: loads of steps <= completed are done. Failures
        # are matched by block id, so a late report is still attributed to its request.
        self._completed_steps += 1
        self._coalesce.rate.step_done()
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        self._coalesce.step_done(
            self._completed_steps,
            invalid,
            getattr(connector_output, "finished_recving", None) or (),
            getattr(connector_output, "finished_sending", None) or (),
            getattr(connector_output, "failed_recving", None) or (),
        )
        self._async_loads_done(connector_output)
        for st in self._reqs.values():
            if st.inflight is not None and st.lease_step is not None:
                bad = [(op, i) for op in st.inflight for i, b in enumerate(op.block_ids) if b in invalid]
                if bad:
                    op, i = min(bad, key=lambda x: x[0].start_depth + x[1])
                    self._load_failed(st, op, i)
                elif st.lease_step is not None and st.lease_step <= self._completed_steps:
                    st.inflight = None  # confirmed: held saves go out with the next step
            if st.lease and st.lease_step is not None and st.lease_step <= self._completed_steps:
                self._release(st)

    def _async_loads_done(self, connector_output) -> None:
        """A hybrid model's loads (asynchronous): vLLM reports each request in finished_recving,
        and a failed one in failed_recving too (it recomputes the request from scratch)."""
        done = set(getattr(connector_output, "finished_recving", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id in done:
            st = self._reqs.get(req_id)
            if st is None or st.inflight is None or st.lease_step is not None:
                continue
            st.inflight = None
            self._release(st)
            if req_id in failed:
                self._count("stores_dropped_after_failed_load", sum(len(h.keys) for h in st.held))
                st.held, st.saved_blocks, st.async_floor = [], 0, 0
                logger.info("cxlkv: %s: load failed; vLLM recomputes the request", req_id)

    def _load_failed(self, st: _ReqState, op: BlockOp, first_bad: int) -> None:
        """vLLM recomputes from the first failed block: nothing computed on top of it is saved,
        and those blocks are saved again once recomputed."""
        depth = op.start_depth + first_bad
        self._count("stores_dropped_after_failed_load", sum(len(h.keys) for h in st.held))
        st.held = []
        st.inflight = None
        st.saved_blocks = min(st.saved_blocks, depth)
        self._release(st)
        # The block that failed (corrupt, or gone) must not be found again by anyone; the core
        # drops a checksum failure itself, this covers a pin that kept it (no-op when absent).
        self._groups[op.group].call("delete", lambda ns: ns.delete(op.keys[first_bad]))
        logger.info(
            "cxlkv: %s: load failed at block %d; vLLM recomputes from there and the "
            "connector saves those blocks again",
            op.req_id,
            depth,
        )

    def request_finished(self, request: Request) -> tuple[bool, None]:
        st = self._reqs.pop(request.request_id, None)
        # a load not sent yet would write blocks vLLM frees now
        self._async_loads = [op for op in self._async_loads if op.req_id != request.request_id]
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
        for lease in st.lease:
            self._session.retire(lease)
        st.lease = []
        st.lease_step = None

    # ------------------------------------------------------------------------------------------
    # KV events (vllm_events.py): vLLM publishes what take_events returns (--kv-events-config)
    def _events_tracker(self):
        from cxlkv.integrations import vllm_events

        if "_kv_events" not in self.__dict__:
            on = vllm_events.events_enabled(self._vllm_config, self.ctx.extra)
            self._kv_events = vllm_events.ConnectorEvents(self._block_size) if on else None
        return self._kv_events

    def take_events(self):
        tracker = self._events_tracker()
        if tracker is None:
            return ()
        if not self._session.usable():
            return tracker.pool_lost() if self._session.disabled else ()
        return self._primary.call("events", lambda ns: tracker.take(self._session.pool, ns, self._reqs)) or ()

    def shutdown(self) -> None:
        self._coalesce.close()
        for st in self._reqs.values():
            self._release(st)
        self._session.close()
