"""One block layout for every TP size (integrations/heads.py) with real vLLM CPU engines: a
prefix stored by a TP=1 engine is a hit for a TP=2 engine, and the reverse, with greedy outputs
identical to what each engine computes without the pool (the same prompt under another
cache_salt: other keys, so computed). Then prefill -> decode across TP sizes: a TP=2 decode
instance (kv_consumer: loads, never saves) gets the prompt the TP=1 engine prefilled. The TP=1
engine waits (a file) while the TP=2 ones run, so each engine starts once."""

from __future__ import annotations

import os

import pytest

from conftest import BLOCK, parted_at_tie, words
from engine_proc import EngineProc

pytestmark = pytest.mark.timeout(900)

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
TP1_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}


def spec(pool: str, tp: int, rounds: list, role: str = "kv_both") -> dict:
    return {
        "role": role,
        "model": "tiny",
        "pool": pool,
        "tp": tp,
        "kv_bytes": 64 << 20,
        "max_tokens": 12,
        "rounds": rounds,
        "stats": True,
        "top_logprobs": 5,
    }


def one(prompt: str, salt: str | None = None) -> dict:
    return {"prompts": [{"prompt": prompt, **({"cache_salt": salt} if salt else {})}]}


def test_tp1_and_tp2_share_prefixes_both_ways(pool_path, tmp_path):
    p = words(31, 400)  # several 128-token blocks
    r = words(32, 400)
    a_go = str(tmp_path / "a-go")
    a = EngineProc(
        spec(pool_path, 1, [one(p), {**one(r, "cold-a"), "wait_for": a_go}, one(r)]),
        TP1_ENV,
    )
    b = d = None
    try:
        a.expect("RESULT ")  # P is in the pool, written by TP=1
        b = EngineProc(spec(pool_path, 2, [one(p, "cold-b"), one(p), one(r)]), TP2_ENV)
        b_res = b.results(600)
        with open(a_go, "w"):
            pass
        d = EngineProc(spec(pool_path, 2, [one(p)], role="kv_consumer"), TP2_ENV)
        a_res = a.results(600)
        d_res = d.results(600)
    finally:
        for e in (a, b, d):
            if e is not None and e.p.poll() is None:
                os.killpg(e.p.pid, 9)
                e.p.wait()
    cold_b, hit_b, store_r = (x["outputs"][0] for x in b_res)
    # TP=2 loads TP=1's blocks: every full prompt block but the last token's
    assert hit_b["cached"] >= (hit_b["len"] - 1) // BLOCK * BLOCK > 0, hit_b
    assert cold_b["cached"] == 0
    # K/V of layers > 0 computed at another TP size differ in low-order bits (the all-reduce
    # sums in another order): greedy outputs agree within a bf16 ulp or two, up to a near tie
    parted = [parted_at_tie(cold_b, hit_b)]
    _, cold_a, hit_a = (x["outputs"][0] for x in a_res)
    # TP=1 loads TP=2's blocks (both ranks' heads)
    assert hit_a["cached"] >= (hit_a["len"] - 1) // BLOCK * BLOCK > 0, hit_a
    assert cold_a["cached"] == 0
    parted.append(parted_at_tie(cold_a, hit_a))
    # P/D: the TP=2 decode instance loads the TP=1 prefill's blocks, and saves nothing
    decode = d_res[0]["outputs"][0]
    assert decode["cached"] >= (decode["len"] - 1) // BLOCK * BLOCK > 0, decode
    parted.append(parted_at_tie(cold_b, decode))
    assert not d_res[0]["cxlkv"].get("vllm:cxlkv_store_outcome_blocks{outcome=stored}"), d_res[0]["cxlkv"]
    print("parted at", parted)
    assert store_r["cached"] == 0  # R was new to the pool when TP=2 computed and stored it
