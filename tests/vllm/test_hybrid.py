"""The connector on a hybrid model in real vLLM CPU engines: the tiny random Llama with a 256-token
sliding window on every other layer (python/cxlkv/testing/models.py ``tiny_swa_llama``), which
vLLM's hybrid KV cache manager splits into two KV cache groups (sliding window, full attention).

Three engines, one process each, reused across the cases: a reference without the connector, a
prefill instance (kv_producer) on a cold pool, and a fresh instance on the warm pool (kv_both, as
the decode side of prefill/decode through the pool and as a shared prefix cache; vLLM's own prefix
cache off, so that each of its rounds loads from the pool; its second round after every block in
the pool was corrupted)."""

from __future__ import annotations

import os
import uuid

import pytest

from conftest import BLOCK, run_engine, words

pytestmark = pytest.mark.timeout(900)

WINDOW = 256
LONG = words(11, 900)  # ~1,200 tokens: far longer than the window
PROMPTS = [LONG, LONG + " " + words(12, 150), words(13, 40)]


def plain(prompts):
    return [{"prompt": p} for p in prompts]


@pytest.fixture(scope="module")
def pool():
    path = f"/dev/shm/cxlkv-vllm-hybrid-{uuid.uuid4().hex}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


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


def test_ssm_hybrid_state_group_refused_at_start_up_in_one_line(pool):
    """Nemotron-H (Mamba-2 + attention): vLLM keeps its hybrid manager on with cxlkv configured,
    builds a Mamba state group, and the connector refuses it by name: the engine does not start."""
    log: list = []
    with pytest.raises(AssertionError, match="engine failed"):
        run_engine(
            {"model": "tiny-nemotron-h", "pool": pool, "rounds": [{"prompts": plain(["hi"])}]}, log=log
        )
    assert "Turning off hybrid kv cache manager" not in log[0]
    line = next(x for x in log[0].splitlines() if "UnsupportedKVCacheGroup: " in x)
    assert "KV cache group 0 of 2 (MambaSpec" in line and "not stored by cxlkv" in line
