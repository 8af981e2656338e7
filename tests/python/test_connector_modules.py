"""The vLLM connector's modules one by one (vllm.py is a façade over them, laid out like vLLM's
offloading connector): the façade routes each call to the side that runs it; the shared context
derives roles, policy and namespace from vLLM's configs; the worker side checks the KV cache it
is given; the stats module aggregates and reduces; the identity module refuses what it cannot
name. The state machine across both sides is test_connector_unit.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
torch = pytest.importorskip("torch")
from cxlkv.integrations import vllm as conn  # noqa: E402
from cxlkv.integrations import vllm_groups as vg  # noqa: E402
from cxlkv.integrations import vllm_metrics  # noqa: E402
from cxlkv.integrations.vllm_common import ConnectorContext  # noqa: E402
from cxlkv.integrations.vllm_scheduler import CxlKVScheduler  # noqa: E402
from cxlkv.integrations.vllm_worker import CxlKVWorker  # noqa: E402
from test_connector_unit import BS, HEAD, LAYERS, NUM_BLOCKS, Role, fake_configs  # noqa: E402


def test_facade_builds_one_side_per_role_and_routes_to_it(pool_path, model_dir):
    vc, kc = fake_configs(pool_path, model_dir)
    sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
    worker = conn.CxlKVConnector(vc, Role.WORKER, kc)
    try:
        assert isinstance(sched.connector_scheduler, CxlKVScheduler) and sched.connector_worker is None
        assert isinstance(worker.connector_worker, CxlKVWorker) and worker.connector_scheduler is None
        # a call for the other side is a bug in the caller, not a silent no-op
        with pytest.raises(AssertionError, match="worker-side call"):
            sched.get_block_ids_with_load_errors()
        with pytest.raises(AssertionError, match="scheduler-side call"):
            worker.build_connector_meta(None)
        # calls vLLM makes on both roles answer on both
        assert sched.get_handshake_metadata() is None and sched.get_kv_connector_stats() is None
        assert tuple(worker.take_events()) == ()
        # the workers' name reaches the scheduler through the façade's handshake
        sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        assert sched._ns_name == worker._ns_name and sched.identity == worker.identity
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.mark.parametrize(
    "role, loads, saves",
    [("kv_both", True, True), ("kv_producer", False, True), ("kv_consumer", True, False)],
)
def test_context_roles_policy_and_namespace(pool_path, model_dir, role, loads, saves):
    vc, kc = fake_configs(pool_path, model_dir, role, namespace="ops-chosen")
    counted: list[str] = []
    ctx = ConnectorContext(vc, kc, is_worker=True, who="", count=counted.append)
    try:
        assert (ctx.can_load, ctx.can_save) == (loads, saves)
        assert vc.kv_transfer_config.kv_load_failure_policy == "recompute"  # a failed load is a miss
        assert (
            ctx.ns_name == "ops-chosen"
            and ctx.block_bytes == kc.kv_cache_groups[0].kv_cache_spec.page_size_bytes * LAYERS
        )
        assert ctx.session.usable() and not ctx.awaits_workers
    finally:
        ctx.session.close()
    vc, kc = fake_configs(pool_path, model_dir, load_failure_policy="fail")
    ctx = ConnectorContext(vc, kc, is_worker=False, who="", count=counted.append)
    try:
        assert vc.kv_transfer_config.kv_load_failure_policy == "fail"  # the operator's choice kept
        assert ctx.awaits_workers  # the scheduler names the namespace once the workers report
    finally:
        ctx.session.close()


def test_worker_refuses_a_kv_cache_of_another_size(pool_path, model_dir):
    vc, kc = fake_configs(pool_path, model_dir)
    w = CxlKVWorker(vc, kc)
    try:
        wrong = [torch.zeros((NUM_BLOCKS, 2, BS, 2, HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
        with pytest.raises(ValueError, match="bytes per block"):
            w.register_kv_caches({f"l{i}": a for i, a in enumerate(wrong)})
        right = [torch.zeros((NUM_BLOCKS, 2, BS, 1, HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
        w.register_kv_caches({f"l{i}": a for i, a in enumerate(right)})
        assert w.get_kv_connector_stats() is None  # nothing happened yet
    finally:
        w.shutdown()


def test_stats_aggregate_and_reduce():
    a, b = vllm_metrics.CxlKVStats(), vllm_metrics.CxlKVStats()
    assert a.is_empty() and set(vllm_metrics.STAT_KEYS) <= set(a.data)
    a.data["load_bytes"], a.data["load_s"] = 2_000_000_000, 1.0
    b.data["load_bytes"], b.data["load_s"] = 2_000_000_000, 1.0
    a.data["load_op_s"].append(1.0)
    b.data["load_op_s"].append(1.0)
    a.aggregate(b)
    r = a.reduce()
    assert r["load_gbps"] == 2.0 and r["store_gbps"] == 0.0 and "load_op_s" not in r
    assert a.data["load_op_s"] == [1.0, 1.0]
    a.reset()
    assert a.is_empty()
    # the façade builds the same stats object vLLM aggregates
    assert isinstance(
        conn.CxlKVConnector.build_kv_connector_stats({"load_blocks": 3}), vllm_metrics.CxlKVStats
    )


# -------------------------------------------------------------------------------------------------
# KV cache groups (vllm_groups.py): what a hit needs from each, what a save keeps
class SlidingWindowSpec(SimpleNamespace):
    pass


class ChunkedLocalAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def kv_config(*specs):
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=s, layer_names=[f"g{i}.l{j}" for j in range(2)])
            for i, s in enumerate(specs)
        ],
        num_blocks=NUM_BLOCKS,
    )


def test_groups_reach_follows_vllms_hybrid_prefix_cache():
    full = SimpleNamespace(page_size_bytes=64, block_size=128)
    swa = SlidingWindowSpec(page_size_bytes=64, block_size=128, sliding_window=256)
    chunked = ChunkedLocalAttentionSpec(page_size_bytes=64, block_size=128, attention_chunk_size=512)
    groups = vg.group_layouts(kv_config(swa, full, chunked), 128)
    assert [g.reach for g in groups] == [vg.SLIDING, vg.FULL, vg.CHUNKED]
    assert vg.primary_group(groups) == 1
    s, f, c = groups
    # a hit at boundary 10 needs the 255 tokens before it: blocks 8 and 9 (cdiv(255, 128) = 2)
    assert s.first_needed(10) == 8 and s.first_needed(1) == 0 and f.first_needed(10) == 0
    # chunks of 4 blocks: a hit at 10 needs the chunk it is in, blocks [8, 10)
    assert c.first_needed(10) == 8 and c.first_needed(8) == 8 and c.first_needed(7) == 4
    assert f.block_bytes == 128 and "window=256" in s.describe(3) and s.describe(3) != f.describe(3)
    # saves: every block of a full group; of the window group, those some anchor needs
    kept = [j for j in range(40) if s.anchors_needing(j, 16, prompt_anchor=37)]
    assert kept == [14, 15, 30, 31, 35, 36]
    assert all(f.anchors_needing(j, 16, 37) for j in range(40))


def test_state_groups_are_refused_in_one_line_naming_the_group():
    full = SimpleNamespace(page_size_bytes=64, block_size=128)
    with pytest.raises(vg.UnsupportedKVCacheGroup, match=r"KV cache group 1 of 2 \(MambaSpec") as e:
        vg.group_layouts(kv_config(full, MambaSpec(page_size_bytes=64, block_size=128)), 128)
    assert "\n" not in str(e.value)
    with pytest.raises(vg.UnsupportedKVCacheGroup, match="block size 64"):
        vg.group_layouts(kv_config(SimpleNamespace(page_size_bytes=64, block_size=64)), 128)


@pytest.mark.parametrize(
    "mixer, shapes, dtypes",
    [  # one TP=1 layer of each tiny hybrid (python/cxlkv/testing/models.py): the shapes vLLM derives
        ("MAMBA2", ((3, 288), (4, 64, 16)), (torch.bfloat16, torch.bfloat16)),  # Nemotron-H, Granite 4
        ("MAMBA1", ((2, 256), (256, 16)), (torch.bfloat16, torch.bfloat16)),  # Jamba
        ("GDN_ATTN", ((3, 384), (1, 128, 128)), (torch.bfloat16, torch.float32)),  # Qwen3-Next
    ],
)
def test_real_state_specs_describe_their_layout_and_count_their_bytes(mixer, shapes, dtypes):
    """vLLM's own MambaSpec for each mixer cxlkv serves: its bytes are the states' (not the padded
    page) and its identity names shapes, dtypes, mixer and conv orientation."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    spec = VllmMambaSpec(
        block_size=128,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=1 << 20,
        mamba_type=MambaAttentionBackendEnum[mixer],
        mamba_cache_mode="align",
    )
    full = SimpleNamespace(page_size_bytes=1 << 20, block_size=128)
    state, _ = vg.group_layouts(kv_config(spec, full), 128, conv_layout="SD")
    assert state.reach == vg.STATE and state.block_bytes == 2 * spec.state_content_size_bytes
    parts = "+".join(
        "x".join(map(str, s)) + ":" + str(d).removeprefix("torch.")
        for s, d in zip(shapes, dtypes, strict=True)
    )
    assert f"state={parts} mixer={mixer} conv=SD" in state.describe(2)
    with pytest.raises(vg.UnsupportedKVCacheGroup, match="tensor_parallel_size 2"):
        vg.group_layouts(kv_config(spec, full), 128, tp_size=2, conv_layout="SD")
