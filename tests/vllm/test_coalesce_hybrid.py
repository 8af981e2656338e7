"""Coalescing a new prefix on a hybrid model in two real vLLM CPU engines (separate processes, one
pool): the tiny Llama with a 256-token sliding window on every other layer, and the tiny
Qwen3-Next (a Gated DeltaNet state group and a full-attention group). A
computes a new prompt (its saves slowed so that it holds its intents and anchor marks for
seconds); B gets the same prompt meanwhile, waits for the deepest boundary A marked as servable
in both groups (its prompt's last: A's only anchor past the checkpoints, and with a state group
the only one it marks), loads both groups' blocks (the sliding group its window's, the state
group the one state at that boundary) and answers what a cold run of B answers (the prompt under
its own cache_salt: other keys, no hit, no wait). integrations/coalesce.py; the engine-free tests
are tests/python/test_connector_groups.py."""

from __future__ import annotations

import os
import time

import pytest

from conftest import BLOCK, words
from engine_proc import EngineProc
from test_coalesce import ENV, same_answer, spec, used_blocks

pytestmark = pytest.mark.timeout(900)

# 128-token blocks: the prompt reaches far past the 2-block window, so B loads only the window's
# blocks of that group before the boundary it waits for.
PROMPT_BLOCKS = 12
MODELS = {  # model -> (its block size, the blocks B loads into the bounded group)
    "tiny-swa": (BLOCK, 2),  # the 2 blocks the 256-token window reaches back
    "tiny-qwen3-next": (BLOCK, 1),  # the state at the boundary
    "tiny-qwen3-next-tp": (2 * BLOCK, 1),  # two key heads (TP=2: a state unit a rank); 256-token blocks
}


# CXLKV_TEST_COALESCE_TP=2 runs both engines at TP=2 (a wait counts a block once every rank's
# entries are there; each rank loads its heads or state units): not in CI (four engine processes
# on two cores), run by hand (README "Hybrid models").
TP = int(os.environ.get("CXLKV_TEST_COALESCE_TP", "1"))
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"} if TP > 1 else {}


@pytest.mark.parametrize(
    "model", ["tiny-swa", "tiny-qwen3-next"] if TP == 1 else ["tiny-swa", "tiny-qwen3-next-tp"]
)
def test_new_prefix_of_a_hybrid_model_is_computed_once_and_loaded_in_every_group(pool_path, tmp_path, model):
    block, bounded_blocks = MODELS[model]
    go_a, go_b = str(tmp_path / "go-a"), str(tmp_path / "go-b")
    p = words(1700, PROMPT_BLOCKS * BLOCK + 60)
    a = EngineProc(
        {**spec(model, pool_path, [(p, go_a, "")], tps=1e6), "tp": TP},
        {**ENV, **TP_ENV, "CXLKV_TEST_SAVE_DELAY_S": "8"},  # A holds its intents >= 8 s
    )
    b = EngineProc(
        {**spec(model, pool_path, [(p, go_b, ""), (p, "", "cold")], tps=2), "tp": TP}, {**ENV, **TP_ENV}
    )
    try:
        for e in (a, b):
            e.wait_for("WAITING 0")
        empty = used_blocks(pool_path)
        open(go_a, "w").close()
        deadline = time.monotonic() + 120
        while used_blocks(pool_path) < empty + 2:  # A's two clock records: it holds the intents
            assert time.monotonic() < deadline and a.p.poll() is None, a.tail()
            time.sleep(0.02)
        open(go_b, "w").close()
        res_a, res_b = a.results(), b.results()
    finally:
        for e in (a, b):
            e.kill()
    assert res_b[0]["hybrid"] is True
    writer, waiter = res_a[0]["cxlkv"], res_b[0]["cxlkv"]
    blocks = (res_b[0]["outputs"][0]["len"] - 1) // block
    assert writer["vllm:cxlkv_coalesce_intents"] == 1
    assert waiter.get("vllm:cxlkv_coalesce_waits", 0) == 1, waiter
    assert waiter["vllm:cxlkv_coalesced_blocks"] == blocks > 0, waiter
    assert waiter.get("vllm:cxlkv_coalesce_recomputed_blocks", 0) == 0
    # every group loaded what the boundary needs: the full-attention group each block, the
    # bounded group what its reach needs there
    loaded = sorted(waiter.get(f"vllm:cxlkv_group_blocks{{group={g},outcome=loaded}}", 0) for g in (0, 1))
    assert loaded == [bounded_blocks * TP, blocks * TP], waiter  # counted per rank: its KV head each
    print("waiter:", {k: v for k, v in waiter.items() if "coalesce" in k or "load" in k})
    same_answer(res_b[0], res_b[1])  # greedy tokens of B's cold run
