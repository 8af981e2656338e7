"""The connector on a hybrid model in real vLLM CPU engines: the tiny random Llama with a 256-token
sliding window on every other layer (python/cxlkv/testing/models.py ``tiny_swa_llama``), which
vLLM's hybrid KV cache manager splits into two KV cache groups (sliding window, full attention).

Three engines, one process each, reused across the cases: a reference without the connector, a
prefill instance (kv_producer) on a cold pool, and a fresh instance on the warm pool (kv_both, as
the decode side of prefill/decode through the pool and as a shared prefix cache; vLLM's own prefix
cache off, so that each of its rounds loads from the pool; its second round after every block in
the pool was corrupted). Then an SSM hybrid (the tiny Nemotron-H, two more engines: see below),
a Gated DeltaNet hybrid (the tiny Qwen3-Next, one engine) and a short-conv hybrid (the tiny
LFM2, one engine)."""

from __future__ import annotations

import pytest

from conftest import BLOCK, LOGPROB_TOL, run_engine, unique_pool, words

pytestmark = pytest.mark.timeout(900)

WINDOW = 256
LONG = words(11, 900)  # ~1,200 tokens: far longer than the window
PROMPTS = [LONG, LONG + " " + words(12, 150), words(13, 40)]


def plain(prompts):
    return [{"prompt": p} for p in prompts]


@pytest.fixture(scope="module")
def pool():
    yield from unique_pool("hybrid")


@pytest.fixture(scope="module")
def reference():
    return run_engine({"model": "tiny-swa", "connector": False, "rounds": [{"prompts": plain(PROMPTS)}]})[0]


@pytest.fixture(scope="module")
def producer(pool):
    log: list = []
    out = run_engine(
        {"model": "tiny-swa", "pool": pool, "role": "kv_producer", "rounds": [{"prompts": plain(PROMPTS)}]},
        log=log,
    )
    return out[0], log[0]


@pytest.fixture(scope="module")
def consumer(pool, producer):
    log: list = []
    out = run_engine(
        {
            "model": "tiny-swa",
            "pool": pool,
            "prefix_caching": False,
            "stats": True,
            "rounds": [{"prompts": plain(PROMPTS)}, {"prompts": plain(PROMPTS), "before": "corrupt_pool"}],
        },
        log=log,
    )
    return out, log[0]


def test_hybrid_manager_stays_on_with_two_groups(producer):
    result, log = producer
    assert result["hybrid"] is True
    assert "Turning off hybrid kv cache manager" not in log
    assert "KV layers registered in 2 group(s)" in log


def test_cold_pool_is_token_identical_to_no_connector(reference, producer):
    for r, o in zip(reference["outputs"], producer[0]["outputs"], strict=True):
        assert o["tokens"] == r["tokens"]


def test_prefill_to_decode_through_the_pool_hits_past_the_window_and_matches(reference, consumer):
    warm = consumer[0][0]
    assert warm["hybrid"] is True
    longest = max(warm["outputs"], key=lambda o: o["len"])
    # every full block of the prompt but the last token's (a hit at the prompt's last boundary)
    assert longest["cached"] == (longest["len"] - 1) // BLOCK * BLOCK > WINDOW
    for r, o in zip(reference["outputs"], warm["outputs"], strict=True):
        assert o["tokens"] == r["tokens"]
    stats = warm["cxlkv"]
    assert stats.get("vllm:cxlkv_hit_tokens", 0) > 0


def test_corrupt_pool_mid_load_is_recompute_never_wrong_tokens(reference, consumer):
    faulty = consumer[0][1]
    assert faulty["corrupted"] > 0
    for r, o in zip(reference["outputs"], faulty["outputs"], strict=True):
        assert o["tokens"] == r["tokens"]


# ------------------------------------------------------------------------------------------------
# An SSM hybrid: the tiny random Nemotron-H (a Mamba-2 layer and an attention layer; vLLM's Mamba
# state group in "align" mode and a full-attention group). Two engines: a producer on a cold pool
# and a fresh consumer that runs its own cold reference (another cache_salt: another prefix), the
# same prompts warm from the pool, then, after every pool entry was corrupted, prompts the
# producer stored under a third salt (each load fails its checksum: recomputed). vLLM CPU's
# Mamba-2 prefill fails on its in-pass checkpoint path, so prefills run in one-block chunks
# (max_num_batched_tokens = the block size: every chunk ends on a block boundary).
SSM_PROMPTS = [words(21, 560), words(22, 420)]  # no shared prefix: the cold round is cold
SSM_SPEC = {"model": "tiny-nemotron-h", "max_num_batched_tokens": BLOCK, "stats": True}


def salted(prompts, salt):
    return [{"prompt": p, "cache_salt": salt} for p in prompts]


@pytest.fixture(scope="module")
def ssm_pool():
    yield from unique_pool("ssm")


@pytest.fixture(scope="module")
def ssm_producer(ssm_pool):
    log: list = []
    rounds = [{"prompts": salted(SSM_PROMPTS, "warm") + salted(SSM_PROMPTS, "fault")}]
    out = run_engine({**SSM_SPEC, "pool": ssm_pool, "rounds": rounds}, log=log)
    return out[0], log[0]


@pytest.fixture(scope="module")
def ssm_consumer(ssm_pool, ssm_producer):
    rounds = [
        {"prompts": salted(SSM_PROMPTS, "cold")},
        {"prompts": salted(SSM_PROMPTS, "warm")},
        {"prompts": salted(SSM_PROMPTS, "fault"), "before": "corrupt_pool"},
    ]
    return run_engine({**SSM_SPEC, "pool": ssm_pool, "rounds": rounds})


def test_ssm_hybrid_stores_the_state_group_at_block_boundaries(ssm_producer):
    result, log = ssm_producer
    assert result["hybrid"] is True
    assert "Turning off hybrid kv cache manager" not in log
    assert "KV layers registered in 2 group(s)" in log
    assert "UnsupportedKVCacheGroup" not in log
    stats = result["cxlkv"]
    # each prompt's last block boundary, per salt (the prompts are shorter than a checkpoint)
    assert stats["vllm:cxlkv_group_blocks{group=0,outcome=stored}"] == 2 * len(SSM_PROMPTS)
    assert stats["vllm:cxlkv_group_blocks{group=0,outcome=skipped}"] > 0


def test_ssm_hybrid_fresh_engine_resumes_from_the_pools_state_token_identical(ssm_consumer):
    cold, warm = ssm_consumer[0], ssm_consumer[1]
    for c, w in zip(cold["outputs"], warm["outputs"], strict=True):
        assert c["cached"] == 0
        # the state and the KV at the prompt's last block boundary came from the pool
        assert w["cached"] == (w["len"] - 1) // BLOCK * BLOCK >= 2 * BLOCK
        assert w["tokens"] == c["tokens"]
        # Equal on CPUs without AMX; with AMX-BF16 (oneDNN's bf16 matmuls round by the batch's
        # rows) the warm run, which computes only the prompt's tail, differs by up to one bf16 ulp
        # of the logits (0.016 measured on a Xeon with amx_bf16, 2026-11-28). A wrong state moves
        # them far more, and its tokens (the tiny model's weights are scaled for that).
        assert max(abs(a - b) for a, b in zip(w["logprobs"], c["logprobs"], strict=True)) <= LOGPROB_TOL
    assert warm["cxlkv"]["vllm:cxlkv_group_blocks{group=0,outcome=loaded}"] >= len(SSM_PROMPTS)


def test_ssm_hybrid_corrupt_state_is_recompute_never_wrong_tokens(ssm_consumer):
    cold, faulty = ssm_consumer[0], ssm_consumer[2]
    assert faulty["corrupted"] > 0
    for c, f in zip(cold["outputs"], faulty["outputs"], strict=True):
        assert f["tokens"] == c["tokens"] and f["logprobs"] == c["logprobs"]
    assert faulty["cxlkv"].get("vllm:cxlkv_load_failed_blocks{cause=missing_or_corrupt}", 0) > 0


# ------------------------------------------------------------------------------------------------
# A Gated DeltaNet hybrid: the tiny random Qwen3-Next (a Gated DeltaNet layer, a gated-attention
# layer, sparse MoE MLPs; vLLM CPU's own GDN kernels, an fp32 SSM state). One engine: a cold round
# that stores, then vLLM's own prefix cache emptied before each later round, so that its hits come
# from the pool alone: the same prompts warm, then again after every pool entry was corrupted (each
# load fails its checksum: recomputed). vLLM's default chunking (unlike Mamba-2's, its GDN path
# runs whole prompts; align mode ends a chunk at the prompt's last block boundary, where a state is
# stored). Saves wait in their step: vLLM frees a finished request's blocks at once, so that its
# prefix cache can be reset between rounds (with async saves it holds them until a later step has
# reported their copies done, a step an idle engine may never take).
GDN_SPEC = {"model": "tiny-qwen3-next", "stats": True, "async_saves": False}


def cold_warm_corrupt(spec: dict, tag: str) -> tuple[list, str]:
    """One engine on a fresh pool: SSM_PROMPTS cold (stored), then warm and then on a corrupted
    pool, vLLM's own prefix cache emptied before each; its RESULT records and its log."""
    log: list = []
    rounds = [
        {"prompts": plain(SSM_PROMPTS)},
        {"prompts": plain(SSM_PROMPTS), "reset_prefix_cache": True},
        {"prompts": plain(SSM_PROMPTS), "reset_prefix_cache": True, "before": "corrupt_pool"},
    ]
    pool = next(gen := unique_pool(tag))
    try:
        return run_engine({**spec, "pool": pool, "rounds": rounds}, log=log), log[0]
    finally:
        next(gen, None)  # removes the pool file


@pytest.fixture(scope="module")
def gdn_rounds():
    return cold_warm_corrupt(GDN_SPEC, "gdn")


def test_gated_deltanet_hybrid_resumes_from_the_pools_state_token_identical(gdn_rounds):
    (cold, warm, _), log = gdn_rounds
    assert cold["hybrid"] is True and "KV layers registered in 2 group(s)" in log
    for c, w in zip(cold["outputs"], warm["outputs"], strict=True):
        assert c["cached"] == 0
        assert w["cached"] == (w["len"] - 1) // BLOCK * BLOCK >= 2 * BLOCK
        assert w["tokens"] == c["tokens"]
        # Equal on CPUs without AMX; with AMX-BF16 (oneDNN's bf16 matmuls round by the batch's
        # rows) the warm run, which computes only the prompt's tail, differs by up to one bf16 ulp
        # of the logits (0.016 measured on a Xeon with amx_bf16, 2026-11-28). A wrong state moves
        # them far more, and its tokens (the tiny model's weights are scaled for that).
        assert max(abs(a - b) for a, b in zip(w["logprobs"], c["logprobs"], strict=True)) <= LOGPROB_TOL
    assert warm["cxlkv"]["vllm:cxlkv_group_blocks{group=0,outcome=loaded}"] >= len(SSM_PROMPTS)


def test_gated_deltanet_hybrid_corrupt_state_is_recompute_never_wrong_tokens(gdn_rounds):
    (cold, _, faulty), _ = gdn_rounds
    assert faulty["corrupted"] > 0
    for c, f in zip(cold["outputs"], faulty["outputs"], strict=True):
        assert f["tokens"] == c["tokens"] and f["logprobs"] == c["logprobs"]
    assert faulty["cxlkv"].get("vllm:cxlkv_load_failed_blocks{cause=missing_or_corrupt}", 0) > 0


# ------------------------------------------------------------------------------------------------
# A short-conv hybrid: the tiny random LFM2 (a short-conv layer, an attention layer with two KV
# heads). Its conv state is stored as one entry per KV head at every TP size (state_shards.py
# short_conv_shards; TP=2 by hand: README "Hybrid models"). One engine, as the Gated DeltaNet's:
# cold, then warm and corrupt with vLLM's own prefix cache emptied before each.
@pytest.fixture(scope="module")
def lfm2_rounds():
    return cold_warm_corrupt({**GDN_SPEC, "model": "tiny-lfm2"}, "lfm2")


def test_short_conv_hybrid_resumes_from_the_pools_state_and_recomputes_a_corrupt_one(lfm2_rounds):
    (cold, warm, faulty), log = lfm2_rounds
    assert cold["hybrid"] is True and "KV layers registered in 2 group(s)" in log
    for c, w, f in zip(cold["outputs"], warm["outputs"], faulty["outputs"], strict=True):
        assert c["cached"] == 0
        assert w["cached"] == (w["len"] - 1) // BLOCK * BLOCK >= 2 * BLOCK
        assert w["tokens"] == c["tokens"] and w["logprobs"] == c["logprobs"]
        assert f["tokens"] == c["tokens"] and f["logprobs"] == c["logprobs"]
    assert warm["cxlkv"]["vllm:cxlkv_group_blocks{group=0,outcome=loaded}"] >= len(SSM_PROMPTS)
    assert faulty["corrupted"] > 0
    assert faulty["cxlkv"].get("vllm:cxlkv_load_failed_blocks{cause=missing_or_corrupt}", 0) > 0
