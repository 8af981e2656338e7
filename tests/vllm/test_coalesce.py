"""A new prefix requested from two real vLLM engines (separate processes, one pool), the second
while the first is still computing and saving it, is computed once: the first takes the chain's
intents and publishes its clock, the second finds waiting clearly shorter than computing, waits
for the blocks and loads them (integrations/coalesce.py). And a writer killed with kill -9 while it holds
the marker: the waiter notices (the dead node's entry is reclaimed), recomputes, and still answers
what plain vLLM answers.

Each engine also computes the prompt once more under its own cache_salt (other keys: no pool hit,
no local hit, no coalescing): that is the plain-compute reference its coalesced answer must equal.
The writers' saves are slowed (CXLKV_TEST_SAVE_DELAY_S, transfer.py) so that the writer holds its
marker for seconds, as a long prefill on a loaded CPU does, whatever the machine's load."""

from __future__ import annotations

import json
import time

import pytest

import cxlkv
from conftest import BLOCK, words
from engine_proc import EngineProc

pytestmark = pytest.mark.timeout(900)

PROMPT_BLOCKS = 12  # full blocks the writer computes and the waiter loads


def prompt(seed: int) -> str:
    return words(seed, PROMPT_BLOCKS * BLOCK + 60)  # about one token per word: 12 full blocks


def spec(model: str, pool: str, rounds: list[tuple[str, str, str]], tps: float, wait_s: float = 120) -> dict:
    """rounds: (prompt, the file that starts it or "", cache_salt or ""). tps: the engine's fixed
    prefill rate (a writer publishes it; a waiter compares its own time with the writer's)."""
    return {
        "model": model,
        "pool": pool,
        "stats": True,
        "max_tokens": 8,
        # The writers' saves are slowed on purpose; the waiter's fixed slow rate keeps its bound
        # (the estimated time to compute the 12 blocks itself) above those delays, and the
        # writers' fast one says their blocks are due at once: waiting is clearly shorter.
        "extra_config": {"coalesce": True, "coalesce_wait_s": wait_s, "coalesce_prefill_tokens_per_s": tps},
        "rounds": [
            {
                "prompts": [{"prompt": p, **({"cache_salt": salt} if salt else {})}],
                **({"wait_for": go} if go else {}),
            }
            for p, go, salt in rounds
        ],
    }


def used_blocks(pool: str) -> int:
    with cxlkv.Pool.open(pool) as p:
        return int(p.stats()["used_blocks"])


def same_answer(coalesced: dict, ref: dict) -> None:
    a, b = coalesced["outputs"][0], ref["outputs"][0]
    assert a["len"] > PROMPT_BLOCKS * BLOCK
    assert a["tokens"] == b["tokens"]  # greedy: what plain vLLM computes
    assert all(abs(x - y) < 0.1 for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_new_prefix_computed_once_across_engines_and_a_killed_writer(tiny_model, pool_path, tmp_path):
    """Three engines start together (one start-up cost). Phase 1: A computes prompt 1 (its saves
    take >= 8 s), B gets it once A holds its intents. Phase 2: C (whose saves never finish) computes
    prompt 2 and holds its intents, B waits for it, C is killed with kill -9, B recovers. (Two
    engines of one speed that begin a prefix at the same moment both compute it: that decision
    is test_coalesce_unit.py's.)"""
    go1, go1b, go_c, go_b, never = (str(tmp_path / n) for n in ("go1", "go1b", "go-c", "go-b", "never"))
    p1, p2 = prompt(1600), prompt(1601)
    slow_saves = {**ENV, "CXLKV_TEST_SAVE_DELAY_S": "8"}  # the writer holds its intents >= 8 s
    a = EngineProc(spec(tiny_model, pool_path, [(p1, go1, ""), (p1, "", "ref-a")], tps=1e6), slow_saves)
    # B's references come last: their saves land after phase 2's count of the pool's blocks.
    b = EngineProc(
        spec(
            tiny_model,
            pool_path,
            [(p1, go1b, ""), (p2, go_b, ""), (p1, "", "ref-b"), (p2, "", "ref-b")],
            tps=2,
        ),
        {**ENV, "CXLKV_TEST_SAVE_DELAY_S": "3"},
    )
    # C computes prompt 2, then idles in a round that never starts: alive, its saves still pending,
    # so it still holds the marker when B looks prompt 2 up.
    c = EngineProc(
        spec(tiny_model, pool_path, [(p2, go_c, ""), (p2, never, "")], tps=1e6),
        {**ENV, "CXLKV_TEST_SAVE_DELAY_S": "600"},
    )
    engines = (a, b, c)
    try:
        for e in engines:
            e.wait_for("WAITING 0")
        # Phase 1: A takes prompt 1's intents (its two clock records are the first entries in the
        # pool; its saves come >= 8 s after its prefill) ...
        empty = used_blocks(pool_path)
        open(go1, "w").close()
        deadline = time.monotonic() + 120
        while used_blocks(pool_path) < empty + 2:
            assert time.monotonic() < deadline and a.p.poll() is None, a.tail()
            time.sleep(0.02)
        open(go1b, "w").close()  # ... B gets it while A computes or saves it
        res_a = a.results()
        b.wait_for("WAITING 1")
        # Phase 2: C computes prompt 2 and holds its intents (an intent takes no pool block, so
        # the evidence is C's own counter; its clock records are two entries), its saves pending ...
        base = used_blocks(pool_path)
        open(go_c, "w").close()
        c_round = json.loads(c.expect("RESULT ")[7:])
        assert c_round["cxlkv"]["vllm:cxlkv_coalesce_intents"] == 1, c_round["cxlkv"]
        c.wait_for("WAITING 1")
        assert c.p.poll() is None and used_blocks(pool_path) == base + 2  # nothing of prompt 2 saved
        # ... B misses there and waits for C; C is killed while B waits.
        open(go_b, "w").close()
        b.wait_for("being computed by another engine; waiting")
        c.kill()
        res_b = b.results()
    finally:
        for e in engines:
            e.kill()

    # Phase 1: B waited; the prompt's blocks were computed once (by A, stored by it) and loaded
    # by B; both answers are plain vLLM's.
    writer, waiter = res_a[0]["cxlkv"], res_b[0]["cxlkv"]
    assert waiter.get("vllm:cxlkv_coalesce_waits", 0) == 1 and writer.get("vllm:cxlkv_coalesce_waits", 0) == 0
    assert waiter.get("vllm:cxlkv_coalesce_declined", 0) == 0
    blocks = (res_a[0]["outputs"][0]["len"] - 1) // BLOCK
    assert writer["vllm:cxlkv_coalesce_intents"] == 1
    # The writer's stored count may lag its round (async saves report a store in a later step, and
    # its saves are delayed 3 s here): at most the prompt's blocks. That the blocks were computed
    # once shows on the waiter: it loaded every one of them from the pool and stored none.
    assert writer.get("vllm:cxlkv_store_outcome_blocks{outcome=stored}", 0) <= blocks
    assert waiter["vllm:cxlkv_coalesced_blocks"] == blocks
    assert waiter["vllm:cxlkv_load_blocks"] == blocks
    assert waiter.get("vllm:cxlkv_store_outcome_blocks{outcome=stored}", 0) == 0
    assert waiter.get("vllm:cxlkv_coalesce_recomputed_blocks", 0) == 0
    same_answer(res_a[0], res_a[1])
    same_answer(res_b[0], res_b[2])

    # Phase 2: B gave up because the writer was gone (its dead node's marker is absent to the
    # core), not at the deadline; it recomputed every block and answers as plain vLLM does.
    d = delta(res_b[1]["cxlkv"], res_b[0]["cxlkv"])
    blocks = (res_b[1]["outputs"][0]["len"] - 1) // BLOCK
    assert d["vllm:cxlkv_coalesce_waits"] == 1, d
    assert d["vllm:cxlkv_coalesce_fallbacks{cause=writer_gone}"] == 1, d
    assert "vllm:cxlkv_coalesce_fallbacks{cause=deadline}" not in d
    assert d["vllm:cxlkv_coalesce_recomputed_blocks"] == blocks
    assert "vllm:cxlkv_coalesced_blocks" not in d
    same_answer(res_b[1], res_b[3])
