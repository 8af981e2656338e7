"""The connector under faults and the namespace identity, in real vLLM engines (one process each).

* F2 (pool poisoning): a load that fails (checksum mismatch of one block) in the step that also
  computes new blocks must not publish them; after the recompute the pool is byte-identical to
  a clean run's.
* F1 (identity): two checkpoints of one architecture under one served alias never share a block;
  a copy of a checkpoint at another path, under another alias, does.
* F3/F6: the pool file truncated or replaced under a serving engine: the engine keeps serving by
  recompute and says why, once.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

import pytest

from conftest import BLOCK, run_engine, words
from cxlkv.integrations.namespace_kinds import kv_namespaces

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def two_pools():
    paths = [f"/dev/shm/cxlkv-vllm-faults-{uuid.uuid4().hex}" for _ in range(2)]
    yield paths
    for p in paths:
        for q in (p, p + ".new"):
            if os.path.exists(q):
                os.unlink(q)


def pool_chain(pool_path: str, ids: list) -> dict:
    """depth -> bytes of every block of the prompt's chain that the pool holds."""
    import cxlkv
    from cxlkv.integrations.keys import block_keys

    with cxlkv.Pool.open(pool_path) as pool:
        (d,) = kv_namespaces(pool)
        lay = cxlkv.KVLayout.from_info(d)
        ns = pool.namespace(lay, name=d["name"])
        out = {}
        for i, k in enumerate(block_keys(ids, d["tokens_per_block"], d["name"])):
            b = ns.get_bytes(k)
            if b is not None:
                out[i] = bytes(b)
        return out


def test_f2_failed_load_does_not_poison_the_pool(two_pools, tiny_model):
    """poison_after_load_failure.sh as a test: one engine per pool stores P, then serves P+Q with
    the block at depth 2 corrupted (or not: the control). With one block per step (the same
    computation split in both flows), the corrupted flow's pool must equal the control's."""
    p = words(11, 900)
    pq = p + " " + words(12, 400)
    spec = {
        "max_num_batched_tokens": BLOCK,
        "max_num_seqs": 1,
        "prefix_caching": False,
        "ids": True,
        "max_tokens": 8,
    }
    runs = []
    for pool, before in zip(two_pools, (None, "corrupt_depth:2"), strict=True):
        runs.append(
            run_engine(
                {
                    **spec,
                    "pool": pool,
                    "rounds": [{"prompts": [{"prompt": p}]}, {"prompts": [{"prompt": pq}], "before": before}],
                }
            )
        )
    import cxlkv

    control, corrupted = runs
    with cxlkv.Pool.open(two_pools[1]) as pool:
        (d,) = kv_namespaces(pool)
    # The depth-2 block is one pool entry per KV head (ARCHITECTURE.md §9a): every one corrupted.
    per_block = d["num_kv_heads"] // d["heads_per_entry"] if d["heads_per_entry"] else 1
    assert corrupted[1]["corrupted"] == per_block
    ids = control[1]["outputs"][0]["ids"]
    n_full = len(ids) // BLOCK
    assert control[1]["outputs"][0]["cached"] >= 3 * BLOCK  # the depth-2 block was loaded
    assert corrupted[1]["outputs"][0]["tokens"] == control[1]["outputs"][0]["tokens"]
    clean, after = pool_chain(two_pools[0], ids), pool_chain(two_pools[1], ids)
    assert sorted(clean) == list(range(n_full))
    assert sorted(after) == sorted(clean), "blocks missing (not re-saved after the recompute)"
    differ = [d for d in clean if clean[d] != after[d]]
    assert differ == [], f"the pool holds wrong KV at depths {differ}"


def make_variant(src: str, out: str) -> None:
    """src's checkpoint with k/v projections perturbed by 5%: same architecture, other KV."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    sd = load_file(f"{src}/model.safetensors")
    g = torch.Generator().manual_seed(7)
    for k in list(sd):
        if "self_attn.v_proj" in k or "self_attn.k_proj" in k:
            sd[k] = (sd[k].float() * (1 + 0.05 * torch.randn(sd[k].shape, generator=g))).to(sd[k].dtype)
    save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})


def test_f1_checkpoints_under_one_alias_never_share(pool_path, tiny_model, tmp_path):
    variant, copy = str(tmp_path / "variant"), str(tmp_path / "copy")
    make_variant(tiny_model, variant)
    shutil.copytree(tiny_model, copy)
    prompt = [{"prompt": words(50, 500)}]
    full = None
    for model, alias, expect in (
        (tiny_model, "chat", "cold"),
        (variant, "chat", "cold"),
        (copy, "another-alias", "hit"),
    ):
        out = run_engine(
            {"model": model, "served_model_name": alias, "pool": pool_path, "rounds": [{"prompts": prompt}]}
        )[0]["outputs"][0]
        full = (out["len"] - 1) // BLOCK * BLOCK
        assert out["cached"] == (0 if expect == "cold" else full), (model, alias, out["cached"])
    import cxlkv

    with cxlkv.Pool.open(pool_path) as pool:
        assert len(kv_namespaces(pool)) == 2  # original (and its copy), variant


@pytest.mark.parametrize("fault", ["truncate_pool"])  # replace: unit test (test_connector_unit.py)
def test_f3_pool_file_broken_under_a_serving_engine(pool_path, tiny_model, fault):
    """The engine keeps answering (by recompute) after its pool file is truncated, with one log
    line naming the pool and the cause; no SIGBUS, no hang. (Replacing the file goes through the
    same code: "replace_pool" works here too, left out to keep the suite short.)"""
    prompts = [{"prompt": words(60, 300)}]
    log: list = []
    out = run_engine(
        {
            "pool": pool_path,
            "rounds": [
                {"prompts": prompts},
                {"prompts": [{"prompt": words(61, 300)}], "before": fault},
                {"prompts": prompts},
            ],
        },
        log=log,
    )
    text = log[0]
    assert len(out[1]["outputs"][0]["tokens"]) == 8 and len(out[2]["outputs"][0]["tokens"]) == 8
    assert out[2]["outputs"][0]["tokens"] == out[0]["outputs"][0]["tokens"]
    lines = [ln for ln in text.splitlines() if "is no longer usable" in ln]
    # once per process that has the pool mapped (engine core; a worker process where there is one)
    pids = {re.search(r"pid=(\d+)", ln).group(1) if "pid=" in ln else "main" for ln in lines}
    assert 1 <= len(lines) == len(pids) <= 2, "\n".join(lines)
    cause = "truncated" if fault == "truncate_pool" else "replaced"
    assert all(pool_path in ln and cause in ln for ln in lines), "\n".join(lines)
