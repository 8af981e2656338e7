"""cxlkv as SGLang's HiCache storage, against SGLang's real classes on CPU.

The backend is created by SGLang's own ``StorageBackendFactory`` from the ``dynamic`` config
(what ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config ...`` does), and
copies pages straight into a real ``MHATokenToKVPoolHost`` (SGLang's host pool, built on CPU from
CPU "device" buffers) in every layout cxlkv maps. Two backends on one pool stand for two SGLang
servers. What cannot run here: SGLang's engine (CUDA), so the cache controller's threads that
call these methods are not exercised; the threads below stand in for them.
Needs ``pip install --no-deps sglang==0.5.23 orjson IPython torchvision`` (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang not installed (pip install --no-deps sglang==0.5.23 orjson IPython torchvision)",
    exc_type=ImportError,
)
import torch

from cxlkv.testing import sglang_host

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 2, 2, 8, 4, 64
LAYOUTS = sglang_host.HOST_LAYOUTS


def _fake_model(path, seed: int) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {"w": rng.standard_normal((32, 32)).astype(np.float32)}, os.path.join(path, "model.safetensors")
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_key_value_heads": HEADS}, f)
    return str(path)


def _host_pool(layout: str, heads: int = HEADS):
    return sglang_host.host_pool(
        layout, layers=LAYERS, heads=heads, head_dim=HEAD_DIM, page=PAGE, tokens=DEVICE_TOKENS, ratio=2.0
    )


def _backend(pool_path: str, model: str | None, host, tp_rank: int = 0, tp_size: int = 1):
    return sglang_host.hicache_backend(pool_path, host, model=model, tp_rank=tp_rank, tp_size=tp_size)


_page_bytes = sglang_host.page_bytes
_logical = sglang_host.logical_view


def _indices(pages: list[int]) -> torch.Tensor:
    return sglang_host.page_indices(pages, PAGE)


@pytest.fixture
def sg_pool(make_pool, pool_path):
    make_pool(size=32 << 20, chunk_size=1 << 20)
    return pool_path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_real_host_pools(sg_pool, tmp_path, layout):
    model = _fake_model(tmp_path / "m", 1)
    host_a, host_b = _host_pool(layout), _host_pool(layout)
    a, b = _backend(sg_pool, model, host_a), _backend(sg_pool, model, host_b)
    host_a.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.from_numpy(
            np.random.default_rng(3).integers(0, 256, host_a.kv_buffer.numel() * 2, dtype=np.uint8)
        )
    )
    keys = [f"{i:064x}" for i in range(1, 6)]
    assert a.batch_set_v1(keys[:4], _indices([3, 5, 6, 9])) == [True] * 4
    assert b.batch_exists(keys) == 4  # the leading run
    assert b.batch_exists([keys[4], *keys[:4]]) == 0
    assert b.batch_get_v1(keys[:4], _indices([0, 1, 2, 7])) == [True] * 4
    for src, dst in zip([3, 5, 6, 9], [0, 1, 2, 7], strict=True):
        assert _page_bytes(host_b, dst) == _page_bytes(host_a, src)
    assert _page_bytes(host_b, 8) == bytes(len(_page_bytes(host_b, 8)))  # nothing else written
    assert b.batch_get_v1([keys[4], keys[0]], _indices([10, 11])) == [False, False]
    a.close()
    b.close()


def test_identity_weights_rank_and_layout(sg_pool, tmp_path):
    model = _fake_model(tmp_path / "m", 1)
    import shutil

    copy = shutil.copytree(model, tmp_path / "copy")
    other = _fake_model(tmp_path / "other", 2)
    a = _backend(sg_pool, model, _host_pool("page_first"))
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert a.batch_set_v1(keys, _indices([1, 2])) == [True, True]
    # layer_first shares with page_first (both convert to the engine-neutral per-head entries)
    expected = {(str(copy), "page_first"): 2, (other, "page_first"): 0, (model, "layer_first"): 2,
                (model, "page_head"): 2}  # fmt: skip
    for (weights, layout), hits in expected.items():
        b = _backend(sg_pool, weights, _host_pool(layout))
        assert b.batch_exists(keys) == hits, (weights, layout)
        b.close()
    a.close()


def test_a_tp2_rank_reads_its_head_of_pages_a_tp1_server_wrote(sg_pool, tmp_path):
    """One entry per page and KV head: rank 1 of a TP=2 server (one KV head) finds the pages a
    TP=1 server (both heads) stored, and loads exactly head 1's K and V."""
    model = _fake_model(tmp_path / "m", 1)
    host_a, host_b = _host_pool("layer_first"), _host_pool("page_head", heads=1)
    a = _backend(sg_pool, model, host_a)
    b = _backend(sg_pool, model, host_b, tp_rank=1, tp_size=2)
    host_a.kv_buffer.copy_(torch.randn(host_a.kv_buffer.shape).to(torch.bfloat16))
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert a.batch_set_v1(keys, _indices([1, 2])) == [True, True]
    assert b.batch_exists(keys) == 2
    assert b.batch_get_v1(keys, _indices([5, 6])) == [True, True]
    ka, kb = _logical(host_a), _logical(host_b)  # [2, layer, token, head, dim]
    for src, dst in ((1, 5), (2, 6)):
        want = ka[:, :, src * PAGE : (src + 1) * PAGE, 1]
        assert torch.equal(kb[:, :, dst * PAGE : (dst + 1) * PAGE, 0], want)
    a.close()
    b.close()


def vid_layout(identity):
    import cxlkv

    return cxlkv.KVLayout(
        model_id=identity.model_id(), dtype=identity.dtype, num_layers=identity.num_layers,
        num_kv_heads=identity.num_kv_heads, head_size=identity.head_size,
        tokens_per_block=identity.block_size, kind=identity.kind,
        heads_per_entry=identity.heads_per_entry, block_bytes=identity.block_bytes,
        source=identity.source(),
    )  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_entries_are_engine_neutral(sg_pool, tmp_path, layout):
    """Each page is stored as one entry per KV head: per layer, the head's K rows of the page's
    tokens then its V rows (what the vLLM connector stores), whatever SGLang's host layout."""
    import cxlkv
    from cxlkv.integrations.heads import head_key

    host = _host_pool(layout)
    storage = _backend(sg_pool, _fake_model(tmp_path / "m", 1), host)
    assert storage.shared and storage.identity.heads_per_entry == 1
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(torch.bfloat16))
    page_hash = "ab" * 32
    assert storage.batch_set_v1([page_hash], _indices([3])) == [True]
    name = storage.identity.namespace_name()
    logical = _logical(host)
    storage.close()
    with cxlkv.Pool.open(sg_pool) as pool:  # a plain handle on the namespace: the raw entries
        plain = pool.namespace(vid_layout(storage.identity), name)
        for h in range(HEADS):
            got = plain.get_bytes(head_key(bytes.fromhex(page_hash), h))
            want = logical[:, :, 3 * PAGE : 4 * PAGE, h].permute(1, 0, 2, 3).contiguous()
            assert got == want.view(-1).view(torch.uint8).numpy().tobytes(), (layout, h)


def test_threads_share_one_backend(sg_pool, tmp_path):
    """SGLang's prefetch and backup threads call one backend at once."""
    model = _fake_model(tmp_path / "m", 1)
    host = _host_pool("page_first")
    storage = _backend(sg_pool, model, host)
    pages_per_thread, threads_n = 3, 4
    host.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.from_numpy(
            np.random.default_rng(5).integers(0, 256, host.kv_buffer.numel() * 2, dtype=np.uint8)
        )
    )
    expected = {p: _page_bytes(host, p) for p in range(threads_n * pages_per_thread)}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            src = list(range(t * pages_per_thread, (t + 1) * pages_per_thread))
            dst = [p + 16 for p in src]
            keys = [f"{t:032x}{p:032x}" for p in src]
            for _ in range(5):
                assert storage.batch_set_v1(keys, _indices(src)) == [True] * len(keys)
                assert storage.batch_exists(keys) == len(keys)
                assert storage.batch_get_v1(keys, _indices(dst)) == [True] * len(keys)
                for s, d in zip(src, dst, strict=True):
                    assert _page_bytes(host, d) == expected[s]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    storage.close()
    assert not errors, errors


def test_a_model_name_that_names_no_weights_is_refused(sg_pool):
    """SGLang's model_name ("served-alias" here) is not identity: without weights, no backend."""
    from cxlkv.integrations.external_identity import UnresolvableModelError

    with pytest.raises(UnresolvableModelError, match="served-alias"):
        _backend(sg_pool, None, _host_pool("page_first"))


def test_close_is_idempotent_and_a_call_after_it_is_a_closed_error(sg_pool, tmp_path):
    """Red-team finding: a call after close() touched a torn-down session (AttributeError on
    None, or "register_mem_pool_host was not called"). Now: ClosedError, whatever the call."""
    from cxlkv.errors import ClosedError

    host = _host_pool("page_first")
    storage = _backend(sg_pool, _fake_model(tmp_path / "m", 1), host)
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert storage.batch_set_v1(keys, _indices([1, 2])) == [True, True]
    storage.close()
    storage.close()  # idempotent
    page = host.kv_buffer.view(-1)[:8]
    calls = {
        "batch_exists": lambda: storage.batch_exists(keys),
        "batch_get_v1": lambda: storage.batch_get_v1(keys, _indices([3, 4])),
        "batch_set_v1": lambda: storage.batch_set_v1(keys, _indices([3, 4])),
        "get": lambda: storage.get(keys[0], page),
        "set": lambda: storage.set(keys[0], page),
        "register_mem_pool_host": lambda: storage.register_mem_pool_host(host),
    }
    for name, call in calls.items():
        with pytest.raises(ClosedError, match="after close"):
            call()
            pytest.fail(f"{name} after close() did not raise")


def test_calls_racing_close_see_the_open_backend_or_a_closed_error(sg_pool, tmp_path):
    """SGLang's prefetch/backup threads may still call while the server shuts the backend down:
    each call either completes or raises ClosedError, never anything else."""
    from cxlkv.errors import ClosedError

    storage = _backend(sg_pool, _fake_model(tmp_path / "m", 1), _host_pool("page_first"))
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert storage.batch_set_v1(keys, _indices([1, 2])) == [True, True]
    started, unexpected = threading.Barrier(5), []

    def caller() -> None:
        started.wait(30)
        for _ in range(100_000):  # bounded; ends at the first ClosedError
            try:
                storage.batch_exists(keys)
                storage.batch_get_v1(keys, _indices([3, 4]))
            except ClosedError:
                return
            except BaseException as e:  # noqa: BLE001 - reported below
                unexpected.append(e)
                return
        unexpected.append(AssertionError("close() never took effect"))

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for th in threads:
        th.start()
    started.wait(30)
    storage.close()
    for th in threads:
        th.join(60)
    assert not unexpected, unexpected


def test_vllm_keys_chain_sglangs_page_hashes():
    """The vLLM connector's keys (keys.py) are SGLang's own page hashes of the same token ids
    (``get_hash_str``, seeded as SGLang seeds a request with a cache_salt), so the SGLang
    backend, which sees only those hashes, stores and finds the same pool keys."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    from cxlkv.integrations.keys import block_keys, page_key, root_key, sglang_seed

    toks = [int(x) for x in np.random.default_rng(7).integers(0, 50_000, 5 * PAGE + 3)]
    for salt in (None, "tenant-a", ""):
        seed = storage_namespace_seed(None, salt)
        mine_seed = sglang_seed(None, salt)
        assert (seed, mine_seed) == (None, None) or (mine_seed is not None and mine_seed.hex() == seed)
        theirs = get_hash_str(toks[: 5 * PAGE], seed, page_size=PAGE)
        assert block_keys(toks, PAGE, "kv2-x", cache_salt=salt) == [page_key(h) for h in theirs]
    # a LoRA request never chains like a base-model or an SGLang request, nor another adapter
    base = block_keys(toks, PAGE, "kv2-x")
    lora_a = block_keys(toks, PAGE, "kv2-x", lora="lora:aaaa")
    lora_b = block_keys(toks, PAGE, "kv2-x", lora="lora:bbbb")
    assert len({base[0], lora_a[0], lora_b[0]}) == 3
    assert root_key("kv2-x", "lora:aaaa") != sglang_seed("lora:aaaa", None)
    assert page_key("not-a-page-hash") not in base


def _mla_host(layout: str):
    return sglang_host.mla_host_pool(layout, layers=LAYERS, latent=(12, 4), page=PAGE, tokens=DEVICE_TOKENS)


def test_mla_pages_shared_across_host_layouts(sg_pool, tmp_path):
    """An MLA host pool's pages go to the engine-neutral namespace as one latent entry per page
    (vLLM CPU's MLA block: per layer the page's rows): a page stored from one layout loads
    byte-equal into every other, and a TP=2 rank's replica finds what rank 0 wrote."""
    model = _fake_model(tmp_path / "m", 1)
    src = _mla_host("page_first")
    src.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.from_numpy(np.random.default_rng(5).integers(0, 256, src.kv_buffer.numel() * 2, dtype=np.uint8))
    )
    a = _backend(sg_pool, model, src)
    assert a.shared and a.identity.kind == "mla" and a.identity.num_kv_heads == 1
    keys = [f"{i:064x}" for i in range(1, 4)]
    assert a.batch_set_v1(keys, _indices([2, 4, 7])) == [True] * 3
    want = sglang_host.mla_logical_view(src)
    for layout in sglang_host.MLA_HOST_LAYOUTS:
        host = _mla_host(layout)
        b = _backend(sg_pool, model, host, tp_rank=1, tp_size=2)
        assert b.identity.namespace_name() == a.identity.namespace_name(), layout
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, _indices([0, 1, 5])) == [True] * 3
        got = sglang_host.mla_logical_view(host)
        for s, d in zip([2, 4, 7], [0, 1, 5], strict=True):
            mine, theirs = (x[:, i * PAGE : (i + 1) * PAGE].contiguous() for x, i in ((got, d), (want, s)))
            assert mine.view(torch.uint8).numpy().tobytes() == theirs.view(torch.uint8).numpy().tobytes(), (
                layout
            )
        assert b.batch_set_v1(keys[:1], _indices([3])) == [True]  # a replica writes nothing: finds rank 0's
        b.close()
    a.close()


def test_mla_page_unified_is_refused_in_one_line(sg_pool, tmp_path):
    from cxlkv.integrations.sglang import UnsupportedHostPoolError

    with pytest.raises(UnsupportedHostPoolError, match="layout 'page_unified' is not supported"):
        _backend(sg_pool, _fake_model(tmp_path / "m", 1), _mla_host("page_unified"))
