"""A hybrid model's KV cache groups through both sides of the connector, without an engine (the
real-engine version is tests/vllm/test_hybrid.py): a sliding-window group and a full-attention
group on a real pool. The producer stores every full-attention block and only the sliding-window
blocks an anchor's hit needs; a fresh engine's hit is the deepest boundary both groups serve (a
missing window block moves it), loads fill each group's own block ids, asynchronously, and a
failed load is reported as a failed request (vLLM's failed_recving), never as block ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
torch = pytest.importorskip("torch")
import cxlkv  # noqa: E402
from cxlkv.integrations import vllm as conn  # noqa: E402
from cxlkv.integrations.keys import block_keys  # noqa: E402
from cxlkv.integrations.vllm_common import GroupNamespaces  # noqa: E402
from test_connector_unit import BS, HEAD, NUM_BLOCKS, Role, fake_configs, make_req, tokens  # noqa: E402

CHECKPOINT = 4  # window_checkpoint_blocks
WINDOW = 2 * BS + 1  # tokens: a hit needs the 2 blocks before it


class SlidingWindowSpec(SimpleNamespace):
    pass


def hybrid_configs(pool_path, model_dir):
    vc, kc = fake_configs(pool_path, model_dir, window_checkpoint_blocks=CHECKPOINT)
    page = 2 * BS * HEAD * 2
    full = kc.kv_cache_groups[0].kv_cache_spec
    full.block_size = BS
    swa = SlidingWindowSpec(
        dtype=torch.bfloat16,
        num_kv_heads=1,
        head_size=HEAD,
        page_size_bytes=page,
        block_size=BS,
        sliding_window=WINDOW,
    )
    kc.kv_cache_groups = [
        SimpleNamespace(kv_cache_spec=swa, layer_names=["s0", "s1"]),
        SimpleNamespace(kv_cache_spec=full, layer_names=["f0", "f1"]),
    ]
    return vc, kc


class Hybrid:
    """One engine's scheduler and worker connectors over real KV arrays of two groups (their
    block ids never collide, as vLLM allocates them from one pool)."""

    def __init__(self, pool_path, model_dir):
        vc, kc = hybrid_configs(pool_path, model_dir)
        self.sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
        self.worker = conn.CxlKVConnector(vc, Role.WORKER, kc)
        self.kv = {
            n: torch.zeros((NUM_BLOCKS, 2, BS, 1, HEAD), dtype=torch.bfloat16)
            for n in ("s0", "s1", "f0", "f1")
        }
        self.worker.register_kv_caches(self.kv)

    def run(self, meta):
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        w.connector_worker._saves.wait_all()
        results = w.get_transfer_results(set())
        w.clear_connector_metadata()
        return results

    def block(self, group: int, bid: int) -> bytes:
        names = ("s0", "s1") if group == 0 else ("f0", "f1")
        return b"".join(self.kv[n][bid].contiguous().view(torch.uint8).numpy().tobytes() for n in names)

    def delete(self, toks, depth: int, group: int = 0) -> None:
        """Deletes group ``group``'s block at ``depth`` of ``toks``' chain from the pool."""
        name = self.sched.connector_scheduler.ctx.ns_names[group]
        key = block_keys(toks, BS, name)[depth]
        assert self.sched._session.call("delete", lambda spaces: spaces[group].delete(key))

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


def new_req_output(rid, ids, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=ids, num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={rid: scheduled},
        total_num_scheduled_tokens=scheduled,
    )


def idle_output():
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )


N_BLOCKS = 10
SW_IDS = list(range(1, 1 + N_BLOCKS + 1))  # block 0 is vLLM's null block
FULL_IDS = list(range(20, 20 + N_BLOCKS + 1))


def produce(pool_path, model_dir, toks) -> Hybrid:
    a = Hybrid(pool_path, model_dir)
    req = make_req("p", toks)
    assert a.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    for g, ids in ((0, SW_IDS), (1, FULL_IDS)):  # every block's bytes, distinct per group
        for j, bid in enumerate(ids):
            for n in ("s0", "s1") if g == 0 else ("f0", "f1"):
                a.kv[n][bid].fill_(float(1 + j + 100 * g))
    blocks = SimpleNamespace(get_block_ids=lambda: (SW_IDS, FULL_IDS))
    a.sched.update_state_after_alloc(req, blocks, 0)
    meta = a.sched.build_connector_meta(new_req_output("p", (SW_IDS, FULL_IDS), 0, len(toks)))
    a.run(meta)
    a.sched.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
    a.sched.request_finished_all_groups(req, (SW_IDS, FULL_IDS))
    return a


def stored(pool_path, ns_name, toks) -> list:
    with cxlkv.Pool.open(pool_path) as pool:
        d = next(n for n in pool.namespaces() if n["name"] == ns_name)
        ns = pool.namespace(cxlkv.KVLayout.from_info(d), name=ns_name)
        return [i for i, k in enumerate(block_keys(toks, BS, ns_name)) if ns.get_bytes(k) is not None]


def test_stores_every_full_block_and_only_the_windows_anchors_need(pool_path, model_dir):
    toks = tokens(7, N_BLOCKS * BS + 1)
    a = produce(pool_path, model_dir, toks)
    names = a.sched.connector_scheduler.ctx.ns_names
    assert len(set(names)) == 2  # one namespace per group
    assert stored(pool_path, names[1], toks) == list(range(N_BLOCKS))
    # checkpoints 4 and 8, and the prompt's last boundary 10: the 2 blocks before each
    assert stored(pool_path, names[0], toks) == [2, 3, 6, 7, 8, 9]
    stats = a.worker.get_kv_connector_stats().data
    assert stats["store_blocks_group1"] == N_BLOCKS and stats["store_blocks_group0"] == 6
    a.close()


def test_fresh_engine_loads_each_groups_needs_asynchronously(pool_path, model_dir):
    toks = tokens(8, N_BLOCKS * BS + 1)
    a = produce(pool_path, model_dir, toks)
    b = Hybrid(pool_path, model_dir)
    req = make_req("c", toks)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (N_BLOCKS * BS, True)
    ids = ([0] * (N_BLOCKS - 2) + [40, 41, 42], list(range(50, 61)))  # the window's blocks only
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), N_BLOCKS * BS)
    meta = b.sched.build_connector_meta(idle_output())
    assert sorted((op.group, op.start_depth, len(op.keys)) for op in meta.loads) == [(0, 8, 2), (1, 0, 10)]
    results = b.run(meta)
    assert results.finished_recving == {"c"} and not results.failed_recving
    for j in range(N_BLOCKS):
        assert b.block(1, ids[1][j]) == a.block(1, FULL_IDS[j])
    for j in (8, 9):
        assert b.block(0, ids[0][j]) == a.block(0, SW_IDS[j])
    assert b.block(0, 1) == bytes(len(b.block(0, 1)))  # nothing loaded below the window
    b.sched.update_connector_output(SimpleNamespace(finished_recving={"c"}, failed_recving=set()))
    assert not b.sched.connector_scheduler._reqs["c"].lease  # released once loaded
    a.close(), b.close()


def test_a_missing_window_block_moves_the_hit_to_a_boundary_both_groups_serve(pool_path, model_dir):
    toks = tokens(9, N_BLOCKS * BS + 1)
    a = produce(pool_path, model_dir, toks)
    b = Hybrid(pool_path, model_dir)
    b.delete(toks, 9)  # window block 9
    # boundary 10 needs window blocks 8, 9; boundary 9 needs 7, 8: both there
    assert b.sched.get_num_new_matched_tokens(make_req("c", toks), 0) == (9 * BS, True)
    a.close(), b.close()


def test_a_failed_load_is_a_failed_request_never_block_ids(pool_path, model_dir):
    toks = tokens(10, N_BLOCKS * BS + 1)
    a = produce(pool_path, model_dir, toks)
    b = Hybrid(pool_path, model_dir)
    req = make_req("c", toks)
    b.sched.get_num_new_matched_tokens(req, 0)
    ids = ([0] * (N_BLOCKS - 2) + [40, 41, 42], list(range(50, 61)))
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), N_BLOCKS * BS)
    meta = b.sched.build_connector_meta(idle_output())
    session = b.worker._session
    real = session.ns

    class Failing:  # the full group's namespace loses its blocks past the 3rd
        def load(self, keys, arrays, block_ids, block_dim=0):
            return real[1].load(keys[:3], arrays, block_ids[:3], block_dim=block_dim)

        def __getattr__(self, name):
            return getattr(real[1], name)

    session.ns = GroupNamespaces([real[0], Failing()])
    results = b.run(meta)
    session.ns = real
    assert results.failed_recving == {"c"} and "c" in results.finished_recving
    assert b.worker.get_block_ids_with_load_errors() == set()  # vLLM refuses those for several groups
    b.sched.update_connector_output(SimpleNamespace(finished_recving={"c"}, failed_recving={"c"}))
    st = b.sched.connector_scheduler._reqs["c"]
    assert st.saved_blocks == 0 and not st.lease  # vLLM recomputes it from scratch: saved again
    a.close(), b.close()


# -------------------------------------------------------------------------------------------------
# a state group (SSM / linear attention: vllm_state_groups.py) beside a full-attention group
class MambaSpec(SimpleNamespace):
    pass


CONV, SSM = (3, 8), (2, 4)  # one layer's conv state (bf16) and SSM state (fp32) per block
STATE_BYTES = 3 * 8 * 2 + 2 * 4 * 4


def mamba_spec(**kw):
    fields = dict(
        shapes=(CONV, SSM),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_bytes=2 * BS * HEAD * 2,  # vLLM pads a state page to the KV page size
        block_size=BS,
        mamba_cache_mode="align",
        num_speculative_blocks=0,
        tp_replicated=False,
        mamba_type=SimpleNamespace(name="MAMBA2"),
    )
    return MambaSpec(**{**fields, **kw})


def ssm_configs(pool_path, model_dir, role=None, **spec_kw):
    """vLLM's configs of the model; with ``role``, the connector's constructor arguments."""
    vc, kc = fake_configs(pool_path, model_dir, window_checkpoint_blocks=CHECKPOINT)
    full = kc.kv_cache_groups[0].kv_cache_spec
    full.block_size = BS
    kc.kv_cache_groups = [
        SimpleNamespace(kv_cache_spec=mamba_spec(**spec_kw), layer_names=["m0"]),
        SimpleNamespace(kv_cache_spec=full, layer_names=["f0", "f1"]),
    ]
    return (vc, kc) if role is None else (vc, role, kc)


class SsmHybrid(Hybrid):
    """A Mamba layer (conv + SSM state tensors, as vLLM's worker holds them) and two
    full-attention layers."""

    def __init__(self, pool_path, model_dir, **spec_kw):
        vc, kc = ssm_configs(pool_path, model_dir, **spec_kw)
        self.sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
        self.worker = conn.CxlKVConnector(vc, Role.WORKER, kc)
        self.kv = {
            "m0": [
                torch.zeros((NUM_BLOCKS, *CONV), dtype=torch.bfloat16),
                torch.zeros((NUM_BLOCKS, *SSM), dtype=torch.float32),
            ],
            **{n: torch.zeros((NUM_BLOCKS, 2, BS, 1, HEAD), dtype=torch.bfloat16) for n in ("f0", "f1")},
        }
        self.worker.register_kv_caches(self.kv)

    def block(self, group: int, bid: int) -> bytes:
        if group == 0:
            return b"".join(t[bid].contiguous().view(torch.uint8).numpy().tobytes() for t in self.kv["m0"])
        return super().block(group, bid)

    def write_state(self, bid: int, boundary: int) -> None:
        """What vLLM's forward leaves in a state block: the state after ``boundary`` blocks."""
        self.kv["m0"][0][bid].fill_(float(boundary))
        self.kv["m0"][1][bid].fill_(float(1000 + boundary))


MAMBA_IDS = list(range(1, 1 + N_BLOCKS + 1))


def cached_output(rid, new_ids, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid], new_block_ids=[new_ids], resumed_req_ids=set(), num_computed_tokens=[computed]
        ),
        num_scheduled_tokens={rid: scheduled},
        total_num_scheduled_tokens=scheduled,
    )


def produce_ssm(pool_path, model_dir, toks, a: SsmHybrid | None = None) -> SsmHybrid:
    """vLLM's align mode with a one-block prefill budget: each step computes one block and
    leaves the state at its end boundary in that block's slot; the last step the prompt's
    tail (mid-block: no boundary state). ``a``: the engine (default: a new one)."""
    a = a or SsmHybrid(pool_path, model_dir)
    req = make_req("p", toks)
    assert a.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    for j, bid in enumerate(FULL_IDS):
        for n in ("f0", "f1"):
            a.kv[n][bid].fill_(float(1 + j))
    a.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (MAMBA_IDS, FULL_IDS)), 0)
    for k in range(N_BLOCKS + 1):
        start, n = k * BS, min(BS, len(toks) - k * BS)
        if start + n == (k + 1) * BS:
            a.write_state(MAMBA_IDS[k], k + 1)
        if k == 0:
            out = new_req_output("p", ([MAMBA_IDS[0]], [FULL_IDS[0]]), 0, n)
        else:
            out = cached_output("p", ([MAMBA_IDS[k]], [FULL_IDS[k]]), start, n)
        a.run(a.sched.build_connector_meta(out))
        a.sched.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
    a.sched.request_finished_all_groups(req, (MAMBA_IDS, FULL_IDS))
    return a


def test_state_group_stores_the_states_at_anchor_boundaries_only(pool_path, model_dir):
    toks = tokens(11, N_BLOCKS * BS + 1)
    a = produce_ssm(pool_path, model_dir, toks)
    names = a.sched.connector_scheduler.ctx.ns_names
    assert stored(pool_path, names[1], toks) == list(range(N_BLOCKS))
    # checkpoints 4 and 8, and the prompt's last boundary 10: the state blocks ending there
    assert stored(pool_path, names[0], toks) == [3, 7, 9]
    stats = a.worker.get_kv_connector_stats().data
    assert stats["store_blocks_group0"] == 3 and stats["skip_blocks_group0"] == N_BLOCKS - 3
    with cxlkv.Pool.open(pool_path) as pool:
        info = next(n for n in pool.namespaces() if n["name"] == names[0])
    assert info["block_bytes"] == STATE_BYTES and info["kind"] == "opaque"
    a.close()


def test_a_prefill_ending_mid_block_stores_no_state(pool_path, model_dir):
    """One step over the whole prompt: the running state is mid-block, no boundary state."""
    toks = tokens(12, N_BLOCKS * BS + 1)
    a = SsmHybrid(pool_path, model_dir)
    req = make_req("p", toks)
    a.sched.get_num_new_matched_tokens(req, 0)
    a.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (MAMBA_IDS, FULL_IDS)), 0)
    a.run(a.sched.build_connector_meta(new_req_output("p", (MAMBA_IDS, FULL_IDS), 0, len(toks))))
    names = a.sched.connector_scheduler.ctx.ns_names
    assert stored(pool_path, names[0], toks) == []
    assert len(stored(pool_path, names[1], toks)) == N_BLOCKS
    b = SsmHybrid(pool_path, model_dir)
    assert b.sched.get_num_new_matched_tokens(make_req("c", toks), 0) == (0, False)  # no state: no hit
    a.close(), b.close()


def test_a_block_size_the_engine_core_lost_after_start_up_is_put_back(pool_path, model_dir, caplog):
    """vLLM's multiprocess engine core re-initialises its config after its handshake and its
    platform's default block size comes back, smaller than the groups' (vLLM rounded it up for the
    states): its scheduler would end prefill chunks mid-block, where no state is stored. The
    connector puts the groups' size back before it answers the first lookup."""
    a = SsmHybrid(pool_path, model_dir)
    cc = a.sched.connector_scheduler._cache_config
    cc.block_size, cc.mamba_cache_mode, cc.mamba_block_size = BS // 2, "align", 16  # as vLLM leaves them
    with caplog.at_level("INFO"):
        a.sched.get_num_new_matched_tokens(make_req("p", tokens(16, 3 * BS + 1)), 0)
    assert (cc.block_size, cc.mamba_block_size) == (BS, BS)
    assert sum("reset its cache block size" in r.getMessage() for r in caplog.records) == 1
    a.sched.get_num_new_matched_tokens(make_req("q", tokens(17, 3 * BS + 1)), 0)  # once
    assert sum("reset its cache block size" in r.getMessage() for r in caplog.records) == 1
    a.close()


def test_fresh_engine_loads_the_state_at_the_hit_into_its_block(pool_path, model_dir):
    toks = tokens(13, N_BLOCKS * BS + 1)
    a = produce_ssm(pool_path, model_dir, toks)
    b = SsmHybrid(pool_path, model_dir)
    req = make_req("c", toks)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (N_BLOCKS * BS, True)
    ids = ([0] * (N_BLOCKS - 1) + [40], list(range(50, 61)))  # align mode: the hit's state block
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), N_BLOCKS * BS)
    meta = b.sched.build_connector_meta(idle_output())
    assert sorted((op.group, op.start_depth, len(op.keys)) for op in meta.loads) == [(0, 9, 1), (1, 0, 10)]
    results = b.run(meta)
    assert results.finished_recving == {"c"} and not results.failed_recving
    assert b.block(0, 40) == a.block(0, MAMBA_IDS[9])  # conv and SSM state of boundary 10
    assert b.kv["m0"][1][40][0, 0].item() == 1010.0
    for j in range(N_BLOCKS):
        assert b.block(1, ids[1][j]) == a.block(1, FULL_IDS[j])
    a.close(), b.close()


def test_a_missing_state_moves_the_hit_to_the_next_stored_state(pool_path, model_dir):
    toks = tokens(14, N_BLOCKS * BS + 1)
    a = produce_ssm(pool_path, model_dir, toks)
    b = SsmHybrid(pool_path, model_dir)
    b.delete(toks, 9)  # the state at boundary 10
    # boundaries 9 and 10 have no state; 8 has
    assert b.sched.get_num_new_matched_tokens(make_req("c", toks), 0) == (8 * BS, True)
    a.close(), b.close()


def test_state_layout_is_in_the_identity(pool_path, model_dir):
    a = conn.CxlKVConnector(*ssm_configs(pool_path, model_dir, role=Role.SCHEDULER))
    b = conn.CxlKVConnector(*ssm_configs(pool_path, model_dir, role=Role.SCHEDULER, shapes=(CONV, (2, 2))))
    ca, cb = a.connector_scheduler.ctx, b.connector_scheduler.ctx
    assert "state=3x8:bfloat16+2x4:float32 mixer=MAMBA2 conv=SD" in ca.identities[0].device_layout
    assert ca.ns_names[0] != cb.ns_names[0] and ca.ns_names[1] == cb.ns_names[1]
    a.shutdown(), b.shutdown()


@pytest.mark.parametrize(
    "other",
    [
        {"mamba_type": SimpleNamespace(name="GDN_ATTN")},  # Gated DeltaNet (Qwen3-Next): same bytes
        {"mamba_type": SimpleNamespace(name="MAMBA1")},  # Mamba-1 (Jamba)
        {"dtypes": (torch.bfloat16, torch.bfloat16)},  # vLLM CPU keeps GDN's SSM state in fp32
        {"conv_layout": "DS"},  # VLLM_SSM_CONV_STATE_LAYOUT: same shapes here, another order
    ],
)
def test_a_state_of_another_mixer_dtype_or_conv_order_is_another_namespace(
    pool_path, model_dir, monkeypatch, other
):
    """States of the same size whose bytes mean something else (another mixer's kernels, another
    dtype, the conv state transposed) never share a namespace; the full-attention group does."""
    from cxlkv.integrations import vllm_state_groups as vsg

    a = conn.CxlKVConnector(*ssm_configs(pool_path, model_dir, role=Role.SCHEDULER))
    layout = other.pop("conv_layout", None)
    if layout:  # the process's vLLM setting (an environment variable vLLM reads once)
        monkeypatch.setattr(vsg, "conv_state_layout", lambda: layout)
    b = conn.CxlKVConnector(*ssm_configs(pool_path, model_dir, role=Role.SCHEDULER, **other))
    ca, cb = a.connector_scheduler.ctx, b.connector_scheduler.ctx
    assert ca.ns_names[0] != cb.ns_names[0] and ca.ns_names[1] == cb.ns_names[1]
    if layout:
        assert "conv=DS" in cb.identities[0].device_layout
    a.shutdown(), b.shutdown()


@pytest.mark.parametrize(
    "tp, spec_kw, why",
    [
        (1, {"mamba_cache_mode": "none"}, "mamba_cache_mode is 'none' (prefix caching off)"),
        (1, {"num_speculative_blocks": 1}, "speculative decoding"),
        (2, {}, "tensor_parallel_size 2"),
    ],
)
def test_state_groups_vllm_cannot_resume_from_are_refused_in_one_line(pool_path, model_dir, tp, spec_kw, why):
    from cxlkv.integrations.vllm_groups import UnsupportedKVCacheGroup, group_layouts

    _, kc = ssm_configs(pool_path, model_dir, **spec_kw)
    with pytest.raises(UnsupportedKVCacheGroup) as e:
        group_layouts(kc, BS, tp)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cxlkv: KV cache group 0 of 2 (MambaSpec") and why in msg


# -------------------------------------------------------------------------------------------------
# coalescing a new prefix across engines with several KV cache groups (coalesce.py): a waiter waits
# only for a boundary its writer marked as servable in every group (its anchors: every CHECKPOINT
# boundaries and its prompt's last), loads every group's needs, or fails the request as a whole.
B_SW_IDS = list(range(30, 30 + 13))
B_FULL_IDS = list(range(45, 45 + 13))


def start_writer(pool_path, model_dir, toks) -> tuple[Hybrid, object]:
    """Engine A looks up a new prompt: it computes it and holds its intents and anchor marks."""
    a = Hybrid(pool_path, model_dir)
    req = make_req("p", toks)
    assert a.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert a.sched.connector_scheduler._coalesce.held_blocks("p") == (0, N_BLOCKS)
    return a, req


def writer_saves(a: Hybrid, req, toks, finish: bool = False) -> None:
    """A computes its whole prompt in one step and saves it (its KV: distinct bytes per block and
    group); its intents go once its saves are reported done."""
    for g, ids in ((0, SW_IDS), (1, FULL_IDS)):
        for j, bid in enumerate(ids):
            for n in ("s0", "s1") if g == 0 else ("f0", "f1"):
                a.kv[n][bid].fill_(float(1 + j + 100 * g))
    a.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (SW_IDS, FULL_IDS)), 0)
    results = a.run(a.sched.build_connector_meta(new_req_output("p", (SW_IDS, FULL_IDS), 0, len(toks))))
    a.sched.update_connector_output(
        SimpleNamespace(invalid_block_ids=set(), finished_sending=results.finished_sending)
    )
    if finish:  # the request ends; its saves are reported done, and its intents go with them
        a.sched.request_finished_all_groups(req, (SW_IDS, FULL_IDS))
        results = a.worker.get_transfer_results({"p"})
        a.sched.update_connector_output(
            SimpleNamespace(invalid_block_ids=set(), finished_sending=results.finished_sending)
        )
        assert not a.sched.connector_scheduler._coalesce.holds("p")


def start_waiter(pool_path, model_dir, toks, offered: int) -> tuple[Hybrid, object, object]:
    """Engine B (a slow prefill: waiting is clearly shorter) gets a prompt A computes: it offers
    vLLM `offered` blocks as an asynchronous load, and vLLM allocates them."""
    b = Hybrid(pool_path, model_dir)
    b.sched.connector_scheduler._coalesce.rate.tps = 1.0
    req = make_req("c", toks)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (offered * BS, offered > 0)
    if not offered:
        return b, req, None
    ids = SimpleNamespace(get_block_ids=lambda: (B_SW_IDS, B_FULL_IDS))
    b.sched.update_state_after_alloc(req, ids, offered * BS)
    meta = b.sched.build_connector_meta(idle_output())
    return b, req, meta


def waited_outcome(b: Hybrid, results, failed: bool) -> dict:
    b.sched.update_connector_output(
        SimpleNamespace(
            invalid_block_ids=set(),
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )
    )
    assert results.finished_recving == {"c"} and (results.failed_recving == {"c"}) == failed
    return {k: v for k, v in b.worker.get_kv_connector_stats().data.items() if k.startswith("coalesce") and v}


def test_coalesce_waits_for_the_deepest_boundary_every_group_serves_and_loads_every_group(
    pool_path, model_dir
):
    toks = tokens(20, N_BLOCKS * BS + 1)  # A's anchors: 4, 8 and 10 (its prompt's last)
    a, req_a = start_writer(pool_path, model_dir, toks)
    # B shares A's first 9 blocks: the deepest boundary A marked within them is 8 (not 9, whose
    # window A never stores), so B waits for blocks [0, 8) and computes from there.
    b_toks = toks[: 9 * BS] + tokens(21, 3 * BS + 1)
    b, _req, meta = start_waiter(pool_path, model_dir, b_toks, offered=8)
    (wait,) = meta.waits
    assert sorted((op.group, op.start_depth, len(op.keys)) for op in wait.groups) == [(0, 6, 2), (1, 0, 8)]
    results = b.run(meta)
    assert not results.finished_recving  # A has not saved yet: B keeps waiting
    writer_saves(a, req_a, toks)
    results = b.run(b.sched.build_connector_meta(idle_output()))
    counts = waited_outcome(b, results, failed=False)
    for j in range(8):
        assert b.block(1, B_FULL_IDS[j]) == a.block(1, FULL_IDS[j])
    for j in (6, 7):
        assert b.block(0, B_SW_IDS[j]) == a.block(0, SW_IDS[j])
    assert b.block(0, B_SW_IDS[5]) == bytes(len(b.block(0, 1)))  # out of the window: not loaded
    assert counts["coalesce_waits"] == 1 and counts["coalesced_blocks"] == 8
    assert counts["coalesce_saved_tokens"] == 8 * BS and "coalesce_fallback_writer_gone" not in counts
    # vLLM has blocks [0, 8) now: B saves from there on (and holds the intents of what it computes).
    assert b.sched.connector_scheduler._coalesce.loaded_floor("c") == 8
    a.close(), b.close()


def test_coalesce_no_boundary_marked_within_the_run_means_no_wait(pool_path, model_dir):
    toks = tokens(22, N_BLOCKS * BS + 1)
    a, _req = start_writer(pool_path, model_dir, toks)
    # B shares A's first 3 blocks only: no anchor of A's in (0, 3], so no boundary A computes there
    # will be served by both groups: B computes at once, and holds the intents of its own blocks.
    b, _req_b, _ = start_waiter(pool_path, model_dir, toks[: 3 * BS] + tokens(23, 6 * BS + 1), offered=0)
    assert b.sched.connector_scheduler._coalesce.held_blocks("c") == (3, 9)
    a.close(), b.close()


@pytest.mark.parametrize("how", ["gone", "short", "stalled"])
def test_coalesce_a_wait_that_gives_up_loads_nothing_and_vllm_computes(pool_path, model_dir, how):
    """Writer gone (finished without saving), short (its saves lack a window block of the boundary
    waited for), stalled (no new block within the stall bound): the request fails as a whole
    (failed_recving), nothing is loaded into its blocks, and vLLM computes it."""
    toks = tokens(24, N_BLOCKS * BS + 1)
    a, req_a = start_writer(pool_path, model_dir, toks)
    b, _req, meta = start_waiter(pool_path, model_dir, toks, offered=N_BLOCKS)
    if how == "gone":
        a.sched.request_finished_all_groups(req_a, (SW_IDS, FULL_IDS))
    elif how == "short":
        writer_saves(a, req_a, toks, finish=True)
        b.delete(toks, 9)  # the window block boundary 10 needs, in group 0
    else:
        meta.waits[0].stall_s = 0.0  # the stall bound passed at the first check
    results = b.run(meta)
    counts = waited_outcome(b, results, failed=True)
    cause = {"gone": "writer_gone", "short": "writer_gone", "stalled": "stalled"}[how]
    assert counts[f"coalesce_fallback_{cause}"] == 1 and counts["coalesce_recomputed_blocks"] == N_BLOCKS
    assert "coalesced_blocks" not in counts
    for g, ids in ((0, B_SW_IDS), (1, B_FULL_IDS)):
        assert all(b.block(g, bid) == bytes(len(b.block(g, bid))) for bid in ids)  # nothing loaded
    assert b.worker.get_block_ids_with_load_errors() == set()  # never block ids with several groups
    st = b.sched.connector_scheduler._reqs["c"]
    assert b.sched.connector_scheduler._coalesce.loaded_floor("c") == 0 and st.saved_blocks == 0
    # vLLM looks the request up again (from scratch): it waits once at most, so it loads what the
    # pool holds (short: boundary 9, whose window blocks 7 and 8 are there) and computes the rest.
    got = b.sched.get_num_new_matched_tokens(make_req("c", toks), 0)
    assert got == ((9 * BS, True) if how == "short" else (0, False))
    assert not b.sched.connector_scheduler._coalesce._pending
    a.close(), b.close()


def test_coalesce_with_a_state_group_waits_only_for_the_writers_prompt_boundary(pool_path, model_dir):
    """A model with a state group: its writer stores a state only where a chunk ends on an
    anchor, and vLLM's align mode ends one at the prompt's last boundary only for sure. So A marks
    boundary 10 alone (not its checkpoints 4 and 8): a request sharing A's first 9 blocks computes
    at once; one with A's prompt waits for boundary 10 and loads its state and every KV block."""
    toks = tokens(25, N_BLOCKS * BS + 1)
    a = SsmHybrid(pool_path, model_dir)
    req_a = make_req("p", toks)
    assert a.sched.get_num_new_matched_tokens(req_a, 0) == (0, False)
    assert a.sched.connector_scheduler._coalesce.held_blocks("p") == (0, N_BLOCKS)
    b = SsmHybrid(pool_path, model_dir)
    b.sched.connector_scheduler._coalesce.rate.tps = 1.0  # a slow prefill: waiting is shorter
    short = make_req("s", toks[: 9 * BS] + tokens(26, 3 * BS + 1))
    assert b.sched.get_num_new_matched_tokens(short, 0) == (0, False)  # 8 is no mark: no wait
    req = make_req("c", toks)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (N_BLOCKS * BS, True)
    ids = ([0] * (N_BLOCKS - 1) + [40], list(range(50, 61)))  # align mode: the boundary's state block
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), N_BLOCKS * BS)
    meta = b.sched.build_connector_meta(idle_output())
    (wait,) = meta.waits
    assert sorted((op.group, op.start_depth, len(op.keys)) for op in wait.groups) == [(0, 9, 1), (1, 0, 10)]
    assert not b.run(meta).finished_recving  # A has not computed it yet: B keeps waiting
    produce_ssm(pool_path, model_dir, toks, a)  # A computes, stores the states at 4, 8, 10, finishes
    results = b.run(b.sched.build_connector_meta(idle_output()))
    counts = waited_outcome(b, results, failed=False)
    assert b.block(0, 40) == a.block(0, MAMBA_IDS[9])  # conv and SSM state of boundary 10
    for j in range(N_BLOCKS):
        assert b.block(1, ids[1][j]) == a.block(1, FULL_IDS[j])
    assert counts["coalesce_waits"] == 1 and counts["coalesced_blocks"] == N_BLOCKS
    a.close(), b.close()
