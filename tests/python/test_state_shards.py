"""One state layout for every TP size (integrations/state_shards.py): a Gated DeltaNet (Qwen3-Next)
state group stored as one entry per key head, so that a TP rank of any size stores and loads
exactly its slice, checked byte for byte against vLLM's own sharding math: the per-rank shapes of
``MambaStateShapeCalculator.gated_delta_net_state_shape`` and the channel split of
``mamba_v2_sharded_weight_loader`` (what vLLM's GDN layer shards its conv weights with; the conv
state holds the conv's input channels in the same order, the SSM state is split by value head).

A TP=1 state read by TP=2 and TP=4 ranks, TP=2 ranks' states read at TP=1 and at TP=4, a block
present only once every rank's part is, and a corrupt unit a miss for the ranks that read it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import cxlkv  # noqa: E402
from cxlkv.integrations import state_shards as ss  # noqa: E402
from cxlkv.integrations import vllm_state_groups as vsg  # noqa: E402
from cxlkv.integrations.heads import head_key  # noqa: E402
from cxlkv.testing.layouts import state_units_layout  # noqa: E402

# A small GDN layer with enough heads for TP=4: 4 key heads, 8 value heads (2 per key head).
NK, NV, HK, HV, KERNEL = 4, 8, 6, 5, 4
LAYERS, NB = 2, 5
CONV_DT, SSM_DT = torch.bfloat16, torch.float32


def vllm_shapes(tp):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator.gated_delta_net_state_shape(tp, NK, NV, HK, HV, KERNEL)


def shards(layout="SD"):
    return ss.gdn_shards(NK, NV, HK, HV, KERNEL, layout)


def vllm_rank_state(full, tp, rank, layout="SD", segments=(NK * HK, NK * HK, NV * HV)):
    """What vLLM's rank ``rank`` of ``tp`` holds of a TP=1 layer state (conv, ssm), each
    ``[NB, ...]``: the conv channels split by vLLM's own conv loader (a GDN's segments by
    default; a Mamba-2's ``[x | B | C]``, the output sizes its ``MergedColumnParallelLinear``
    conv splits alike), the SSM state by head with the same loader (one segment)."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader

    conv, ssm = full
    # the loader shards dim 0: channels first ([C, blocks * state_len])
    chans = conv.transpose(1, 2) if layout == "SD" else conv  # [NB, C, L]
    c_first = chans.permute(1, 0, 2).reshape(chans.shape[1], -1)
    part = torch.empty(c_first.shape[0] // tp, c_first.shape[1], dtype=conv.dtype)
    mamba_v2_sharded_weight_loader([(n, 0, False) for n in segments], tp, rank)(part, c_first)
    local = part.reshape(part.shape[0], NB, -1).permute(1, 0, 2)  # [NB, C/tp, L]
    local_conv = (local.transpose(1, 2) if layout == "SD" else local).contiguous()
    heads = ssm.shape[1]
    s_first = ssm.permute(1, 0, 2, 3).reshape(heads, -1)
    s_part = torch.empty(heads // tp, s_first.shape[1], dtype=ssm.dtype)
    mamba_v2_sharded_weight_loader([(heads, 0, False)], tp, rank)(s_part, s_first)
    local_ssm = s_part.reshape(heads // tp, NB, *ssm.shape[2:]).permute(1, 0, 2, 3).contiguous()
    return local_conv, local_ssm


def full_state(seed, layout="SD"):
    """A TP=1 engine's state arrays: per layer conv then SSM state, [NB, *shape]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        conv_shape, ssm_shape = shards(layout).tensors[0].shape, shards(layout).tensors[1].shape
        out.append(torch.randn((NB, *conv_shape), generator=g).to(CONV_DT))
        out.append(torch.randn((NB, *ssm_shape), generator=g).to(SSM_DT))
    return out


def rank_arrays(full, tp, rank, layout="SD"):
    out = []
    for i in range(0, len(full), 2):
        out.extend(vllm_rank_state((full[i], full[i + 1]), tp, rank, layout))
    return out


def layout_of(sh, model_id="test/gdn-state", itemsizes=(2, 4)):
    return cxlkv.KVLayout(
        **state_units_layout(model_id, sh.units, ss.unit_bytes(sh, itemsizes, LAYERS), LAYERS)
    )


def ns_for(pool, tp, rank, layout="SD"):
    sh = shards(layout)
    return ss.StateNamespace(pool.namespace(layout_of(sh)), sh.plan(tp, rank), sh)


def keys_of(n, tag="s"):
    return [bytes([i + 1]) * 16 + tag.encode().ljust(16, b"_") for i in range(n)]


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shapes_are_vllms(tp, layout):
    conv, ssm = vllm_shapes(tp)  # vLLM's default orientation here: SD
    want = [tuple(conv) if layout == "SD" else tuple(reversed(conv)), tuple(ssm)]
    assert shards(layout).local_shapes(tp) == want
    assert shards(layout).plan(tp, tp - 1).local == list(range(NK - NK // tp, NK))


def test_shards_follow_the_spec_vllm_gave_the_rank():
    """vllm_state_groups.shards_of: derived from the model's config, checked against the rank's
    own shapes (a mismatch or an unknown mixer is no cut: refused at TP > 1)."""
    cfg = SimpleNamespace(
        linear_num_key_heads=NK,
        linear_num_value_heads=NV,
        linear_key_head_dim=HK,
        linear_value_head_dim=HV,
        linear_conv_kernel_dim=KERNEL,
    )
    gdn = SimpleNamespace(name="GDN_ATTN")
    for tp in (1, 2, 4):
        spec = SimpleNamespace(shapes=vllm_shapes(tp), mamba_type=gdn, mamba_cache_mode="align")
        assert vsg.shards_of(spec, cfg, "SD", tp) == shards()
        assert vsg.unservable(spec, tp, shards()) is None
    spec = SimpleNamespace(shapes=vllm_shapes(2), mamba_type=gdn, mamba_cache_mode="align")
    assert vsg.shards_of(spec, cfg, "SD", 4) is None  # the rank holds other shapes than described
    assert vsg.shards_of(spec, None, "SD", 2) is None
    m2 = SimpleNamespace(
        shapes=vllm_shapes(2), mamba_type=SimpleNamespace(name="MAMBA2"), mamba_cache_mode="align"
    )
    assert vsg.shards_of(m2, cfg, "SD", 2) is None
    assert "MAMBA2 state" in (vsg.unservable(m2, 2, None) or "")
    sd, ds = shards("SD").describe(), shards("DS").describe()
    assert sd != ds and "units=4" in sd and "tp" not in sd  # the model's total state, not the TP size


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_tp1_state_is_read_by_tp2_and_tp4_ranks_byte_for_byte(make_pool, layout):
    pool = make_pool()
    full = full_state(1, layout)
    keys = keys_of(3)
    assert ns_for(pool, 1, 0, layout).store(keys, full, [0, 2, 4]) == 3
    for tp in (2, 4):
        for rank in range(tp):
            want = rank_arrays(full, tp, rank, layout)
            got = [torch.zeros_like(a) for a in want]
            assert ns_for(pool, tp, rank, layout).load(keys, got, [0, 2, 4]) == 3
            for g, w in zip(got, want, strict=True):
                for b in (0, 2, 4):
                    assert torch.equal(g[b], w[b]), (tp, rank, b)
                assert not g[1].any() and not g[3].any()  # nothing else written


def test_tp2_ranks_states_are_read_at_tp1_and_tp4(make_pool):
    pool = make_pool()
    full = full_state(2)
    keys = keys_of(2, "r")
    r0, r1 = rank_arrays(full, 2, 0), rank_arrays(full, 2, 1)
    ns0, ns1 = ns_for(pool, 2, 0), ns_for(pool, 2, 1)
    assert ns0.store(keys, r0, [1, 3]) == 2
    # rank 1's part is not there yet: the block is not a hit for anyone
    assert ns0.match_prefix(keys) == 0 and ns_for(pool, 1, 0).match_prefix(keys) == 0
    assert ns1.store(keys, r1, [1, 3]) == 2
    assert ns_for(pool, 1, 0).match_prefix(keys) == 2
    got = [torch.zeros_like(a) for a in full]
    assert ns_for(pool, 1, 0).load(keys, got, [1, 3]) == 2
    for g, w in zip(got, full, strict=True):
        assert torch.equal(g[1], w[1]) and torch.equal(g[3], w[3])
    for rank in range(4):
        want = rank_arrays(full, 4, rank)
        got = [torch.zeros_like(a) for a in want]
        assert ns_for(pool, 4, rank).load(keys, got, [1, 3]) == 2
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g[1], w[1]) and torch.equal(g[3], w[3])


def test_corrupt_unit_is_a_miss_for_its_readers_only(make_pool):
    pool = make_pool()
    full = full_state(3)
    keys = keys_of(2, "c")
    ns_for(pool, 1, 0).store(keys, full, [0, 1])
    sh = shards()
    where = pool.namespace(layout_of(sh)).locate(head_key(keys[1], 3))  # unit 3: TP=2 rank 1
    pool.transfer_view()[where["offset"] + where["length"] // 2] ^= 0xFF
    want1 = rank_arrays(full, 2, 1)
    got1 = [torch.zeros_like(a) for a in want1]
    assert ns_for(pool, 2, 1).load(keys, got1, [0, 1]) == 1  # the corrupt unit: a miss
    for g, w in zip(got1, want1, strict=True):
        assert torch.equal(g[0], w[0])
    want0 = rank_arrays(full, 2, 0)
    got0 = [torch.zeros_like(a) for a in want0]
    assert ns_for(pool, 2, 0).load(keys, got0, [0, 1]) == 2  # its units are intact
    for g, w in zip(got0, want0, strict=True):
        assert torch.equal(g[:2], w[:2])
    assert ns_for(pool, 1, 0).match_prefix(keys) == 1  # and no longer a hit


def test_raw_state_pages_are_unpacked_as_the_mixer_binds_them():
    """vLLM 0.32 hands the connector each state layer's raw ``[blocks, 1, 1, page]`` int8 pages;
    vllm_state_groups.state_arrays views them as the mixer's own ``bind_kv_cache`` does."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    shapes = [tuple(s) for s in vllm_shapes(2)]
    spec = SimpleNamespace(shapes=shapes, dtypes=(CONV_DT, SSM_DT))
    page = sum(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
        for s, d in zip(shapes, spec.dtypes, strict=True)
    )
    raw = torch.randint(-128, 127, (NB, 1, 1, page + 64), dtype=torch.int8)  # a padded page
    mixer = SimpleNamespace(get_state_shape=lambda: shapes, get_state_dtype=lambda: spec.dtypes)
    MambaBase.bind_kv_cache(mixer, raw)
    ours = vsg.state_arrays(raw, spec)
    assert len(ours) == 2
    for a, b in zip(ours, mixer.kv_cache, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr()
        assert a.stride() == b.stride()


# -------------------------------------------------------------------------------------------------
# Mamba-2 (Nemotron-H, Granite 4): one unit per group, checked against vLLM's mamba2_state_shape
# and its conv loader's split of [x | B | C]; a one-group model (vLLM replicates its group on every
# rank) is no cut at TP > 1.
G, H, P, N = 4, 8, 3, 5  # groups, heads (2 per group), head dim, state size


def m2_shards(layout="SD", groups=G):
    return ss.mamba2_shards(groups, H, P, N, KERNEL, layout)


def m2_vllm_shapes(tp, groups=G):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator.mamba2_state_shape(tp, H * P, groups, H, P, N, KERNEL)


def m2_spec(tp, groups=G):
    return SimpleNamespace(
        shapes=m2_vllm_shapes(tp, groups), mamba_type=SimpleNamespace(name="MAMBA2"), mamba_cache_mode="align"
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba2_rank_shapes_are_vllms_and_follow_the_config(tp):
    assert m2_shards().local_shapes(tp) == [tuple(s) for s in m2_vllm_shapes(tp)]
    for cfg in (SimpleNamespace(n_groups=G), SimpleNamespace(mamba_n_groups=G)):  # Nemotron-H, Granite 4
        assert vsg.shards_of(m2_spec(tp), cfg, "SD", tp) == m2_shards()
        assert vsg.unservable(m2_spec(tp), tp, m2_shards()) is None
    assert "units=4" in m2_shards().describe()


def test_mamba2_with_one_group_is_no_cut_at_tp2():
    """vLLM gives each rank of a one-group model a copy of the group (extra_groups_for_head_shards):
    not one unit per group, so refused at TP > 1; at TP=1 the one group is one unit."""
    one = SimpleNamespace(n_groups=1)
    assert vsg.shards_of(m2_spec(1, 1), one, "SD", 1) == m2_shards(groups=1)
    assert vsg.shards_of(m2_spec(2, 1), one, "SD", 2) is None
    assert "MAMBA2 state" in (vsg.unservable(m2_spec(2, 1), 2, None) or "")
    assert vsg.shards_of(m2_spec(2), SimpleNamespace(), "SD", 2) is None  # no groups in the config


def m2_ns(pool, tp, rank, layout="SD"):
    sh = m2_shards(layout)
    return ss.StateNamespace(pool.namespace(layout_of(sh, "test/mamba2-state")), sh.plan(tp, rank), sh)


def m2_rank_arrays(full, tp, rank, layout="SD"):
    out = []
    for i in range(0, len(full), 2):
        out.extend(vllm_rank_state((full[i], full[i + 1]), tp, rank, layout, (H * P, G * N, G * N)))
    return out


def cross_tp_both_ways(full, ns_of, rank_arrays, tag):
    """TP=1 stores ``full`` (blocks 0 and 3), every rank of TP=2 and TP=4 reads exactly its slice;
    TP=2 ranks store theirs (blocks 1 and 2), TP=1 reads the whole back. ``ns_of(tp, rank)``: the
    rank's StateNamespace; ``rank_arrays(full, tp, rank)``: what vLLM gives that rank."""
    keys, other = keys_of(2, tag + "1"), keys_of(2, tag + "2")
    assert ns_of(1, 0).store(keys, full, [0, 3]) == 2
    for tp in (2, 4):
        for rank in range(tp):
            want = rank_arrays(full, tp, rank)
            got = [torch.zeros_like(a) for a in want]
            assert ns_of(tp, rank).load(keys, got, [0, 3]) == 2
            for x, w in zip(got, want, strict=True):
                assert torch.equal(x[0], w[0]) and torch.equal(x[3], w[3]), (tp, rank)
    for rank in range(2):
        assert ns_of(2, rank).store(other, rank_arrays(full, 2, rank), [1, 2]) == 2
    got = [torch.zeros_like(a) for a in full]
    assert ns_of(1, 0).load(other, got, [1, 2]) == 2
    for x, w in zip(got, full, strict=True):
        assert torch.equal(x[1:3], w[1:3])


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_mamba2_states_cross_tp_sizes_both_ways_byte_for_byte(make_pool, layout):
    pool = make_pool()
    g = torch.Generator().manual_seed(5)
    conv_shape, ssm_shape = (t.shape for t in m2_shards(layout).tensors)
    full = []
    for _ in range(LAYERS):
        full.append(torch.randn((NB, *conv_shape), generator=g).to(CONV_DT))
        full.append(torch.randn((NB, *ssm_shape), generator=g).to(SSM_DT))
    cross_tp_both_ways(
        full, lambda tp, r: m2_ns(pool, tp, r, layout), lambda f, tp, r: m2_rank_arrays(f, tp, r, layout), "m"
    )


# -------------------------------------------------------------------------------------------------
# Short conv (LFM2): one conv state over the channels, which vLLM splits by rank in one contiguous
# piece (the conv is a ColumnParallelLinear), cut into the model's KV heads; checked against vLLM's
# short_conv_state_shape. A model whose KV heads a TP size does not divide is no cut there.
KV, D = 4, 24  # the model's KV heads (the units), conv channels


def sc_shards(layout="SD"):
    return ss.short_conv_shards(KV, D, KERNEL, layout)


def sc_vllm_shapes(tp):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator.short_conv_state_shape(tp, D, KERNEL)


def sc_spec(tp):
    return SimpleNamespace(
        shapes=sc_vllm_shapes(tp), mamba_type=SimpleNamespace(name="SHORT_CONV"), mamba_cache_mode="align"
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_short_conv_rank_shapes_are_vllms_and_follow_the_config(tp):
    assert sc_shards().local_shapes(tp) == [tuple(s) for s in sc_vllm_shapes(tp)]
    cfg = SimpleNamespace(num_key_value_heads=KV)
    assert vsg.shards_of(sc_spec(tp), cfg, "SD", tp) == sc_shards()
    assert vsg.unservable(sc_spec(tp), tp, sc_shards()) is None
    assert "units=4" in sc_shards().describe()


def test_short_conv_with_fewer_kv_heads_than_ranks_is_no_cut():
    one = SimpleNamespace(num_key_value_heads=1)  # vLLM replicates the one KV head on every rank
    assert vsg.shards_of(sc_spec(1), one, "SD", 1) == ss.short_conv_shards(1, D, KERNEL, "SD")
    assert vsg.shards_of(sc_spec(2), one, "SD", 2) is None
    assert "SHORT_CONV state" in (vsg.unservable(sc_spec(2), 2, None) or "")


def sc_ns(pool, tp, rank, layout="SD"):
    sh = sc_shards(layout)
    return ss.StateNamespace(
        pool.namespace(layout_of(sh, "test/short-conv-state", (2,))), sh.plan(tp, rank), sh
    )


def sc_rank_arrays(full, tp, rank, layout="SD"):
    """What vLLM's rank ``rank`` of ``tp`` holds: the ``rank``-th ``1/tp`` of the channels."""
    dim, n = (2 if layout == "SD" else 1), D // tp  # [NB, L, D] or [NB, D, L]
    return [a.narrow(dim, rank * n, n).contiguous() for a in full]


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_short_conv_states_cross_tp_sizes_both_ways_byte_for_byte(make_pool, layout):
    pool = make_pool()
    g = torch.Generator().manual_seed(7)
    (conv_shape,) = (t.shape for t in sc_shards(layout).tensors)
    full = [torch.randn((NB, *conv_shape), generator=g).to(CONV_DT) for _ in range(LAYERS)]
    cross_tp_both_ways(
        full, lambda tp, r: sc_ns(pool, tp, r, layout), lambda f, tp, r: sc_rank_arrays(f, tp, r, layout), "c"
    )
