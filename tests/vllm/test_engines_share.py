"""vLLM and SGLang share a prefix when their KV bytes agree (docs/IDENTITY.md, "Across engines").

One real vLLM CPU engine (the tiny random-weight model) and SGLang's own MHA host pool class
reading and writing through cxlkv's HiCache backend, on one pool. SGLang's engine needs CUDA, so
SGLang's side is its host pool and its own page hash (``get_hash_str``) of the token ids vLLM
reports: what SGLang's cache controller hands the backend. One engine start for both directions:

1. vLLM serves P cold and stores its blocks (per KV head entries);
2. SGLang's backend, on host pools of every MHA layout, finds every page of P by SGLang's page
   hashes and loads it: per layer and head, K and V equal byte for byte what vLLM wrote;
3. the entries are deleted and SGLang's backend stores the pages again from its own host pool;
4. vLLM serves P again (no local prefix cache): it loads every block SGLang wrote, and its
   greedy output equals the cold run's.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang not installed (pip install --no-deps sglang==0.5.23 orjson IPython torchvision)",
    exc_type=ImportError,
)
import torch
from sglang.srt.mem_cache.utils import get_hash_str

from conftest import BLOCK, parted_at_tie, words
from cxlkv.integrations.namespace_kinds import kv_namespaces
from cxlkv.testing import sglang_host
from engine_proc import EngineProc

pytestmark = pytest.mark.timeout(900)

LAYOUTS = sglang_host.HOST_LAYOUTS
PAGES = 8  # host pool pages (of BLOCK tokens: SGLang's page size is vLLM's block size)


def _host_pool(layout: str, cfg: dict):
    return sglang_host.host_pool(
        layout, layers=cfg["num_hidden_layers"], heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        page=BLOCK, tokens=PAGES * BLOCK,
    )  # fmt: skip


def stored_by_vllm(eng: EngineProc, pool: str, page: int, entries) -> tuple[dict, list, dict, dict]:
    """After the engine's cold round: (its output, SGLang's page hashes of the prompt's whole
    pages, the pool's one namespace, {label: bytes} of ``entries(hashes)``'s (label, key)s),
    once every entry is in the pool (the engine's saves may still be in flight)."""
    import cxlkv

    cold = json.loads(eng.expect("RESULT ", timeout=900)[7:])["outputs"][0]
    eng.expect("WAITING", timeout=300)
    ids = cold["ids"]
    n = len(ids) // page
    assert n >= 3, len(ids)
    hashes = get_hash_str(ids[: n * page], None, page_size=page)  # SGLang's page keys
    deadline = time.monotonic() + 120
    while True:
        with cxlkv.Pool.open(pool) as p:
            (d,) = kv_namespaces(p)
            plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
            written = {label: bytes(plain.get_bytes(key) or b"") for label, key in entries(hashes)}
        if all(written.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    present = sorted(k for k, v in written.items() if v)
    assert all(written.values()), f"vLLM's entries under SGLang's page hashes: {present} ({d['source']})"
    return cold, hashes, d, written


def sglang_loads(pool: str, host, model: str, d: dict, hashes: list, page: int, backends: list):
    """SGLang's backend over ``host`` (kept in ``backends`` to close): it derives vLLM's namespace
    ``d``, finds every page of ``hashes`` and loads them into the host pool's first pages."""
    sg = sglang_host.hicache_backend(pool, host, model=model)
    backends.append(sg)
    assert sg.shared and sg.identity.namespace_name() == d["name"], (d["source"], sg.identity.source())
    assert sg.batch_exists(hashes) == len(hashes)
    assert sg.batch_get_v1(hashes, torch.arange(len(hashes) * page)) == [True] * len(hashes)
    return sg


def _indices(n: int) -> torch.Tensor:
    return torch.arange(n * BLOCK)


def test_vllm_and_sglang_share_a_prefix_both_ways(tmp_path, tiny_model):
    import cxlkv
    from cxlkv.integrations.heads import head_key

    cfg = json.load(open(os.path.join(tiny_model, "config.json")))
    heads = cfg["num_key_value_heads"]
    pool = f"/dev/shm/cxlkv-share-{uuid.uuid4().hex[:12]}"
    go = tmp_path / "sglang-stored"
    prompt = words(31, 700)
    spec = {
        "pool": pool, "ids": True, "prefix_caching": False, "max_tokens": 8,
        "rounds": [{"prompts": [{"prompt": prompt}]}, {"prompts": [{"prompt": prompt}], "wait_for": str(go)}],
    }  # fmt: skip
    eng = EngineProc(spec, env={})
    backends: list = []
    try:
        cold, hashes, d, written = stored_by_vllm(
            eng,
            pool,
            BLOCK,
            lambda hs: [
                ((i, h), head_key(bytes.fromhex(hx), h)) for i, hx in enumerate(hs) for h in range(heads)
            ],
        )
        n = len(hashes)
        # 2. SGLang reads vLLM's blocks, in every host layout
        loaded = {}
        for layout in LAYOUTS:
            host = _host_pool(layout, cfg)
            sg = sglang_loads(pool, host, tiny_model, d, hashes, BLOCK, backends)
            kv = sglang_host.logical_view(host)
            for (i, h), raw in written.items():
                mine = kv[:, :, i * BLOCK : (i + 1) * BLOCK, h].permute(1, 0, 2, 3).contiguous()
                assert mine.view(-1).view(torch.uint8).numpy().tobytes() == raw, (layout, i, h)
            loaded[layout] = (host, sg)
        # 3. the pool forgets vLLM's entries; SGLang stores the pages from its own host pool
        with cxlkv.Pool.open(pool) as p:
            plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
            for hx in hashes:
                for h in range(heads):
                    assert plain.delete(head_key(bytes.fromhex(hx), h))
        host, sg = loaded["page_head"]  # the layout farthest from vLLM's
        assert sg.batch_exists(hashes) == 0
        assert sg.batch_set_v1(hashes, _indices(n)) == [True] * n
        with cxlkv.Pool.open(pool) as p:
            plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
            for (i, h), raw in written.items():
                assert bytes(plain.get_bytes(head_key(bytes.fromhex(hashes[i]), h))) == raw
        # 4. vLLM loads what SGLang stored: output equal to the cold run
        go.write_text("go")
        warm = eng.results(bound_s=600)[1]["outputs"][0]
        assert warm["cached"] >= n * BLOCK, warm["cached"]
        assert warm["tokens"] == cold["tokens"]
    finally:
        for sg in backends:
            sg.close()
        eng.kill()
        if os.path.exists(pool):
            os.unlink(pool)


def test_vllm_and_sglang_share_mla_latents_both_ways(tmp_path):
    """The same for an MLA model (models.tiny_deepseek_v2 on vLLM CPU's CPU_MLA backend, 16-token
    blocks = SGLang pages): one latent entry per block, SGLang's MLA host pool in each layout."""
    import cxlkv
    from cxlkv.testing import models

    model = models.tiny_deepseek_v2()
    cfg = json.load(open(os.path.join(model, "config.json")))
    page, latent = 16, (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
    pool = f"/dev/shm/cxlkv-share-{uuid.uuid4().hex[:12]}"
    go = tmp_path / "sglang-stored"
    prompt = words(33, 200)
    spec = {
        "model": "tiny-deepseek-v2", "attention_backend": "CPU_MLA", "block_size": page, "kv_bytes": 32 << 20,
        "pool": pool, "ids": True, "max_tokens": 8, "top_logprobs": 5,
        "rounds": [{"prompts": [{"prompt": prompt}]}, {"prompts": [{"prompt": prompt}], "wait_for": str(go)}],
    }  # fmt: skip
    eng = EngineProc(spec, env={})
    backends: list = []
    try:
        cold, hashes, d, by_page = stored_by_vllm(
            eng, pool, page, lambda hs: [(i, bytes.fromhex(hx)) for i, hx in enumerate(hs)]
        )
        n, written = len(hashes), [by_page[i] for i in range(len(hashes))]
        assert d["kind"] == "mla", d
        for layout in sglang_host.MLA_HOST_LAYOUTS:
            host = sglang_host.mla_host_pool(
                layout, layers=cfg["num_hidden_layers"], latent=latent, page=page, tokens=n * page
            )
            sglang_loads(pool, host, model, d, hashes, page, backends)
            rows = sglang_host.mla_logical_view(host)
            for i, raw in enumerate(written):
                mine = rows[:, i * page : (i + 1) * page].contiguous()
                assert mine.view(-1).view(torch.uint8).numpy().tobytes() == raw, (layout, i)
        # the pool forgets vLLM's latents; SGLang stores its pages (page_first: farthest from vLLM's)
        sg = backends[1]
        with cxlkv.Pool.open(pool) as p:
            plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
            assert all(plain.delete(bytes.fromhex(hx)) for hx in hashes)
        assert sg.batch_exists(hashes) == 0
        assert sg.batch_set_v1(hashes, torch.arange(n * page)) == [True] * n
        with cxlkv.Pool.open(pool) as p:
            plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
            assert [bytes(plain.get_bytes(bytes.fromhex(hx))) for hx in hashes] == written
        go.write_text("go")
        warm = eng.results(bound_s=600)[1]["outputs"][0]
        assert warm["cached"] == (warm["len"] - 1) // page * page >= n * page - page, warm["cached"]
        print("parted at", parted_at_tie(cold, warm))  # a 16-token batch rounds as the cold one did not
    finally:
        for sg in backends:
            sg.close()
        eng.kill()
        if os.path.exists(pool):
            os.unlink(pool)
