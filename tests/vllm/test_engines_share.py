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
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from conftest import BLOCK, words
from engine_proc import EngineProc

pytestmark = pytest.mark.timeout(900)

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
PAGES = 8  # host pool pages (of BLOCK tokens: SGLang's page size is vLLM's block size)


def _host_pool(layout: str, cfg: dict) -> MHATokenToKVPoolHost:
    layers, heads, dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    tokens = PAGES * BLOCK
    k = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(layers))

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=BLOCK, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    with host_memory_budget_scope(1 << 30):  # a few MiB; SGLang's free-memory check is for servers
        return MHATokenToKVPoolHost(
            info, 1.0, 0, BLOCK, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
        )  # fmt: skip


def _backend(pool: str, model: str, host):
    extra = {
        "backend_name": "cxlkv", "module_path": "cxlkv.integrations.sglang",
        "class_name": "CxlKVHiCacheStorage", "interface_v1": 1, "pool_path": pool, "model_path": model,
    }  # fmt: skip
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=host.layout == "page_first",
        model_name="served-alias", extra_config=extra,
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    storage.register_mem_pool_host(host)
    return storage


def _logical(host, cfg: dict) -> torch.Tensor:
    """[k/v, layer, token, head, dim] from SGLang's documented dims of each layout."""
    buf, layers, heads, dim = (
        host.kv_buffer,
        cfg["num_hidden_layers"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    if host.layout == "layer_first":
        return buf
    if host.layout == "page_first":
        return buf.permute(0, 2, 1, 3, 4)
    if host.layout == "page_first_direct":  # [2, page, layer, token, head, dim]
        return buf.permute(0, 2, 1, 3, 4, 5).reshape(2, layers, -1, heads, dim)
    return buf.permute(0, 4, 1, 3, 2, 5).reshape(2, layers, -1, heads, dim)  # page_head


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
        cold = json.loads(eng.expect("RESULT ", timeout=900)[7:])["outputs"][0]
        eng.expect("WAITING", timeout=300)
        ids = cold["ids"]
        n = len(ids) // BLOCK
        assert n >= 3, len(ids)
        hashes = get_hash_str(ids[: n * BLOCK], None, page_size=BLOCK)  # SGLang's page keys
        deadline = time.monotonic() + 120  # the engine's saves may still be in flight
        while True:
            with cxlkv.Pool.open(pool) as p:
                (d,) = p.namespaces()
                plain = p.namespace(cxlkv.KVLayout.from_info(d), name=d["name"])
                written = {
                    (i, h): bytes(plain.get_bytes(head_key(bytes.fromhex(hx), h)) or b"")
                    for i, hx in enumerate(hashes)
                    for h in range(heads)
                }
            if all(written.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        present = sorted(k for k, v in written.items() if v)
        assert all(written.values()), f"vLLM's entries under SGLang's page hashes: {present} ({d['source']})"
        # 2. SGLang reads vLLM's blocks, in every host layout
        loaded = {}
        for layout in LAYOUTS:
            host = _host_pool(layout, cfg)
            sg = _backend(pool, tiny_model, host)
            backends.append(sg)
            assert sg.shared and sg.identity.namespace_name() == d["name"], (
                d["source"],
                sg.identity.source(),
            )
            assert sg.batch_exists(hashes) == n
            assert sg.batch_get_v1(hashes, _indices(n)) == [True] * n
            kv = _logical(host, cfg)
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
