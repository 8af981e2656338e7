"""Identity of the weights as loaded, in a real vLLM engine (issue 14 item 5): the worker finds
the model it loaded, names the namespace by every byte of it, and the scheduler side adopts that
name through vLLM's handshake, so that its lookups hit what the worker saved."""

from __future__ import annotations

import cxlkv
from conftest import BLOCK, run_engine, words


def test_engine_names_its_namespace_by_the_weights_as_loaded(pool_path, tiny_model):
    prompt = words(11, 400)
    log: list = []
    rounds = run_engine(
        {
            "pool": pool_path,
            "prefix_caching": False,  # a second-round hit can only come from the pool
            "rounds": [{"prompts": [{"prompt": prompt}]}, {"prompts": [{"prompt": prompt}]}],
        },
        log=log,
    )
    [out] = rounds[1]["outputs"]
    assert out["cached"] == (out["len"] - 1) // BLOCK * BLOCK > 0, out
    assert rounds[1]["outputs"][0]["tokens"] == rounds[0]["outputs"][0]["tokens"]
    with cxlkv.Pool.open(pool_path) as pool:
        [ns] = pool.namespaces()  # the scheduler side opened no namespace of its own
    assert ns["source"].startswith("weights as loaded sha256~"), ns
    assert "weights as loaded: sha256~" in log[0] and "reported by the workers" in log[0]
