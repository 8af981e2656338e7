"""One block layout for every TP size (integrations/heads.py): per-KV-head entries that a rank of
any TP size reads exactly, MLA latents stored once, corruption a miss for the rank that reads it.

The KV arrays have vLLM CPU's per-layer layout, [num_blocks, kv_heads, block_size, 2 * head_size]
(a TP rank's array holds its heads only), and flash attention's [2, num_blocks, block_size,
kv_heads, head_size] for the strided case."""

import numpy as np
import pytest

import cxlkv
from cxlkv.integrations.heads import HeadNamespace, HeadPlan, head_dim_of, head_key, head_views

LAYERS, HEADS, BS, HS, NB = 3, 4, 16, 8, 6


def layout(kind="dense"):
    if kind == "mla":
        return cxlkv.KVLayout(
            model_id="test/heads-mla",
            dtype="fp16",
            num_layers=LAYERS,
            num_kv_heads=1,
            head_size=2 * HS,
            tokens_per_block=BS,
            kind="mla",
        )
    return cxlkv.KVLayout(
        model_id="test/heads",
        dtype="fp16",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HS,
        tokens_per_block=BS,
        heads_per_entry=1,
    )


def full_cache(seed):
    """The model's whole KV (every head): what a TP=1 engine holds."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((NB, HEADS, BS, 2 * HS)).astype(np.float16) for _ in range(LAYERS)]


def rank_slice(cache, plan):
    """The arrays TP rank ``plan.tp_rank`` holds: its heads, in its own (contiguous) arrays."""
    return [np.ascontiguousarray(a[:, plan.local]) for a in cache]


def keys_of(n, tag="p"):
    return [bytes([i]) * 16 + tag.encode().ljust(16, b"_") for i in range(n)]


def ns_for(pool, plan, kind="dense"):
    return HeadNamespace(pool.namespace(layout(kind)), plan, None if kind == "mla" else 1)


def test_head_plan_follows_vllm():
    assert HeadPlan(4, 2, 1).local == [2, 3] and HeadPlan(4, 2, 1).writes == [0, 1]
    assert HeadPlan(4, 1, 0).local == [0, 1, 2, 3]
    # more ranks than KV heads: vLLM replicates each head on tp_size // heads consecutive ranks
    assert [HeadPlan(2, 4, r).local for r in range(4)] == [[0], [0], [1], [1]]
    assert [HeadPlan(2, 4, r).writes for r in range(4)] == [[0], [], [0], []]
    mla = HeadPlan.replicated(2, 1)
    assert mla.local == [0] and mla.writes == [] and HeadPlan.replicated(2, 0).writes == [0]
    assert mla.keys([b"k" * 32], 0) == [b"k" * 32]  # the latent: the block key itself
    with pytest.raises(ValueError, match="cannot be split"):
        HeadPlan(6, 4, 0)
    assert head_key(b"k" * 32, 0) != head_key(b"k" * 32, 1)


def test_head_views_of_both_vllm_layouts():
    cpu = np.zeros((NB, 2, BS, 2 * HS), np.float16)
    assert head_dim_of(cpu, 0, 2) == 1
    views, bd = head_views([cpu], 0, 1, 1)
    assert bd == 0 and views[0].shape == (NB, BS, 2 * HS)  # one contiguous run per block
    flash = np.zeros((2, NB, BS, 2, HS), np.float16)
    assert head_dim_of(flash, 1, 2) == 3
    views, bd = head_views([flash], 1, 3, 1)
    assert bd == 2 and views[0].shape == (2, BS, NB, HS)  # K/V and tokens outer: runs of a head
    views[0][1, 3, 5] = 7
    assert (flash[1, 5, 3, 1] == 7).all()  # a view, not a copy
    with pytest.raises(ValueError, match="kv_head_dim"):
        head_dim_of(np.zeros((NB, 2, 2, 2 * HS)), 0, 2)


@pytest.mark.parametrize("writer_tp,reader_tp", [(1, 2), (2, 1), (2, 4), (4, 1)])
def test_any_tp_reads_what_any_tp_wrote(make_pool, writer_tp, reader_tp):
    pool = make_pool()
    truth = full_cache(1)
    keys, ids = keys_of(4), [5, 0, 3, 2]
    for r in range(writer_tp):
        plan = HeadPlan(HEADS, writer_tp, r)
        assert ns_for(pool, plan).store(keys, rank_slice(truth, plan), ids) == 4
    # a scheduler (TP-agnostic) sees every head present
    assert ns_for(pool, HeadPlan(HEADS)).match_prefix(keys) == 4
    for r in range(reader_tp):
        plan = HeadPlan(HEADS, reader_tp, r)
        got = [np.zeros_like(a) for a in rank_slice(truth, plan)]
        dst = [1, 2, 4, 5]
        assert ns_for(pool, plan).load(keys, got, dst) == 4
        want = rank_slice(truth, plan)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g[dst], w[ids])  # exactly this rank's heads
            assert not g[[0, 3]].any()  # nothing else touched


def test_flash_layout_round_trip_and_matches_cpu_bytes(make_pool):
    """A strided (flash-attention) layout stores its heads too; its entries are its own bytes,
    which its identity's device_layout keeps apart from the CPU layout's."""
    pool = make_pool()
    rng = np.random.default_rng(2)
    flash = [rng.standard_normal((2, NB, BS, HEADS, HS)).astype(np.float16) for _ in range(LAYERS)]
    ns = HeadNamespace(pool.namespace(layout(), name="flash"), HeadPlan(HEADS), 3)
    keys = keys_of(2, "f")
    assert ns.store(keys, flash, [1, 4], block_dim=1) == 2
    plan = HeadPlan(HEADS, 2, 1)
    mine = [np.ascontiguousarray(a[:, :, :, plan.local]) for a in flash]
    got = [np.zeros_like(a) for a in mine]
    assert (
        HeadNamespace(pool.namespace(layout(), name="flash"), plan, 3).load(keys, got, [0, 2], block_dim=1)
        == 2
    )
    for g, w in zip(got, mine, strict=True):
        np.testing.assert_array_equal(g[:, [0, 2]], w[:, [1, 4]])


def test_half_written_block_is_no_hit(make_pool):
    """A TP=2 writer whose second rank never saved: the scheduler's hit stops there, and a reader
    of the missing heads misses while a reader of the present ones loads."""
    pool = make_pool()
    truth = full_cache(3)
    keys = keys_of(3)
    r0 = HeadPlan(HEADS, 2, 0)
    ns_for(pool, r0).store(keys, rank_slice(truth, r0), [0, 1, 2])
    r1 = HeadPlan(HEADS, 2, 1)
    ns_for(pool, r1).store(keys[:1], rank_slice(truth, r1), [0])
    assert ns_for(pool, HeadPlan(HEADS)).match_prefix(keys) == 1
    with ns_for(pool, HeadPlan(HEADS)).acquire(keys) as lease:
        assert len(lease) == 1
    got = [np.zeros_like(a) for a in rank_slice(truth, r1)]
    assert ns_for(pool, r1).load(keys, got, [0, 1, 2]) == 1
    got = [np.zeros_like(a) for a in rank_slice(truth, r0)]
    assert ns_for(pool, r0).load(keys, got, [0, 1, 2]) == 3


def test_corrupt_head_is_a_miss_for_its_readers_only(make_pool):
    pool = make_pool()
    truth = full_cache(4)
    keys = keys_of(2)
    ns_for(pool, HeadPlan(HEADS)).store(keys, truth, [0, 1])
    raw = pool.namespace(layout())
    victim = head_key(keys[1], 3)  # head 3 of block 1: rank 1 of TP=2 reads it
    where = raw.locate(victim)
    off, length = where["offset"], where["length"]
    view = pool.transfer_view()
    view[off + length // 2] ^= 0xFF
    r0, r1 = HeadPlan(HEADS, 2, 0), HeadPlan(HEADS, 2, 1)
    got1 = [np.zeros_like(a) for a in rank_slice(truth, r1)]
    assert ns_for(pool, r1).load(keys, got1, [0, 1]) == 1  # the corrupt head: a miss
    for g, w in zip(got1, rank_slice(truth, r1), strict=True):
        np.testing.assert_array_equal(g[0], w[0])
    got0 = [np.zeros_like(a) for a in rank_slice(truth, r0)]
    assert ns_for(pool, r0).load(keys, got0, [0, 1]) == 2  # its heads are intact
    for g, w in zip(got0, rank_slice(truth, r0), strict=True):
        np.testing.assert_array_equal(g[:2], w[:2])
    assert ns_for(pool, HeadPlan(HEADS)).match_prefix(keys) == 1  # and no longer a hit


def test_mla_latent_once_for_every_rank(make_pool):
    pool = make_pool()
    rng = np.random.default_rng(5)
    latent = [rng.standard_normal((NB, BS, 2 * HS)).astype(np.float16) for _ in range(LAYERS)]
    keys = keys_of(2, "m")
    puts = pool.stats()["puts"]
    for r in range(2):  # both ranks save; only rank 0 writes
        assert ns_for(pool, HeadPlan.replicated(2, r), "mla").store(keys, latent, [2, 3]) == 2
    assert pool.stats()["puts"] - puts == 2  # one entry per block, not one per rank
    for r in range(2):
        got = [np.zeros_like(a) for a in latent]
        assert ns_for(pool, HeadPlan.replicated(2, r), "mla").load(keys, got, [0, 1]) == 2
        for g, w in zip(got, latent, strict=True):
            np.testing.assert_array_equal(g[[0, 1]], w[[2, 3]])
    # a replica that saves before rank 0 wrote finds nothing, writes nothing
    assert ns_for(pool, HeadPlan.replicated(2, 1), "mla").store(keys_of(1, "n"), latent, [0]) == 0
    assert ns_for(pool, HeadPlan.replicated(1, 0), "mla").match_prefix(keys_of(1, "n")) == 0


def test_bench_tp_runs():
    """`cxlkv bench tp` (BENCHMARKS.md), on a tiny geometry: every load checked."""
    from cxlkv.tools import bench_tp

    r = bench_tp.run(layers=2, heads=4, hs=8, bs=16, blocks=8, iters=1, copy_threads=None)
    assert r["tp2_rank_from_tp1_heads"]["bytes"] * 2 == r["tp1_from_heads"]["bytes"]
    assert r["ratio_tp2_from_tp1_vs_same_tp"] > 0
