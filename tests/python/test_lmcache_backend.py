"""cxlkv as LMCache's L2 adapter, driven by LMCache's own adapter machinery in-process.

The adapter is built the way ``lmcache server --l2-adapter JSON`` builds it (LMCache's argument
parser, config registry and factory: ``native_plugin`` wrapping our connector in LMCache's
``NativeConnectorL2Adapter``), and driven through LMCache's L2AdapterInterface (submit, event
fds, completions) with real L1 memory objects. Two adapters on one pool stand for two LMCache
servers on two hosts. Needs ``lmcache`` (see docs/INTEGRATIONS.md); skipped without it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import threading
import time

import numpy as np
import pytest

lmcache = pytest.importorskip(
    "lmcache", reason="lmcache not installed (pip install --no-deps lmcache==0.5.6, docs/INTEGRATIONS.md)"
)
torch = pytest.importorskip("torch")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

import cxlkv  # noqa: E402

CHUNK_BYTES = 64 * 1024
WAIT_S = 10.0


def _fake_model(path, seed: int) -> str:
    """A model directory: a config and one safetensors file of seeded random bytes."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {"w": rng.standard_normal((64, 64)).astype(np.float32)}, os.path.join(path, "model.safetensors")
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": 2}, f)
    return str(path)


def _adapter(pool_path: str, **params):
    """What ``lmcache server --l2-adapter '<json>'`` does with our JSON."""
    spec = {
        "type": "native_plugin",
        "module_path": "cxlkv.integrations.lmcache",
        "class_name": "CxlKVL2Connector",
        "adapter_params": {"pool_path": pool_path, **params},
    }
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    (adapter_config,) = config.adapters
    return create_l2_adapter(adapter_config)


def _obj(fill: np.ndarray | None = None) -> TensorMemoryObj:
    raw = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    if fill is not None:
        raw.copy_(torch.from_numpy(fill))
    meta = MemoryObjMetadata(
        shape=torch.Size([CHUNK_BYTES]),
        dtype=torch.uint8,
        address=0,
        phy_size=CHUNK_BYTES,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw, meta, None)


def _wait(fd: int, result):
    """Waits for ``result()`` to be not None (bounded). LMCache's consumer reads its event fds;
    here nobody does, so a signalled fd stays readable and only paces the retries."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = result()
        if r is not None:
            return r
        poller.poll(50)
        time.sleep(0.002)
    raise AssertionError("the L2 adapter did not complete within the bound")


def _store(adapter, keys, objs):
    task = adapter.submit_store_task(keys, objs)
    return _wait(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task))


def _lookup(adapter, keys) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = _wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task))
    adapter.submit_unlock(keys)
    return [bitmap.test(i) for i in range(len(keys))]


def _load(adapter, keys, objs) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    bitmap = _wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return [bitmap.test(i) for i in range(len(keys))]


@pytest.fixture
def lmcache_pool(make_pool, pool_path):
    make_pool(size=32 << 20, chunk_size=1 << 20)
    return pool_path


@pytest.fixture
def servers(lmcache_pool):
    """Two adapters ("server A", "server B") on one pool."""
    made = [_adapter(lmcache_pool), _adapter(lmcache_pool)]
    yield made
    for a in made:
        a.close()


def _token(model: str, **fields) -> str:
    """What cxlkv's vLLM-side connector sends for an engine serving ``model`` (lmcache_vllm.py
    derives the weights the same way, plus vLLM's config: test_lmcache_vllm_identity.py)."""
    from cxlkv.integrations.external_identity import weights_of
    from cxlkv.integrations.lmcache_identity import model_token

    return model_token({"weights": weights_of(model)[0], **fields})


def _keys(model: str, n: int, salt: str = "", rank: int = 0, raw_name: bool = False) -> list[ObjectKey]:
    field = model if raw_name else _token(model)
    return [ObjectKey(bytes([i]) * 16, field, rank, 0, salt) for i in range(n)]


def _payload(n: int, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for _ in range(n)]


def test_store_on_a_lookup_and_load_on_b(servers, tmp_path):
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    keys, data = _keys(model, 4), _payload(4)
    result = _store(a, keys, [_obj(d) for d in data])
    assert result == 4 * CHUNK_BYTES  # L2StoreResult: bytes stored, -1 on failure

    missing = _keys(model, 6)[4:]
    assert _lookup(b, keys + missing) == [True] * 4 + [False] * 2
    outs = [_obj() for _ in keys]
    assert _load(b, keys, outs) == [True] * 4
    for out, d in zip(outs, data, strict=True):
        assert np.array_equal(out.raw_data.numpy(), d)
    assert _load(b, missing, [_obj(), _obj()]) == [False, False]


def test_identity_follows_the_weights_not_the_name(servers, tmp_path):
    """The same bytes at another path hit; other weights under the same kind of name miss; a
    tenant's salt and another KV rank are other keys."""
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    copy = shutil.copytree(model, tmp_path / "copy-of-m")
    other = _fake_model(tmp_path / "other", seed=2)
    _store(a, _keys(model, 2), [_obj(d) for d in _payload(2)])
    assert _lookup(b, _keys(str(copy), 2)) == [True, True]
    assert _lookup(b, _keys(other, 2)) == [False, False]
    assert _lookup(b, _keys(model, 2, salt="tenant-b")) == [False, False]
    assert _lookup(b, _keys(model, 2, rank=1)) == [False, False]


def test_stated_kv_dtype_is_another_namespace(servers, tmp_path, lmcache_pool):
    """LMCache's key has no KV dtype; a server told its dtype shares only with the same dtype."""
    a, _ = servers
    model = _fake_model(tmp_path / "m", seed=1)
    _store(a, _keys(model, 2), [_obj(d) for d in _payload(2)])
    fp8, alias = (
        _adapter(lmcache_pool, kv_dtype="fp8_e4m3"),
        _adapter(lmcache_pool, kv_dtype="torch.float8_e4m3fn"),
    )
    try:
        assert _lookup(fp8, _keys(model, 2)) == [False, False]
        _store(fp8, _keys(model, 1), [_obj(d) for d in _payload(1)])
        assert _lookup(alias, _keys(model, 2)) == [True, False]
    finally:
        fp8.close()
        alias.close()


@pytest.mark.parametrize("name", ["path", "hub-id", "forged-token"])
def test_a_model_name_is_never_trusted(servers, tmp_path, lmcache_pool, name):
    """Red-team finding: the server resolved the key's model *name* (what the engine's operator
    typed) to weights on its own host, which need not be what the engine loaded (another host or
    container, a hub id at another --revision). A key whose model field is not the identity the
    engine derived is never stored and never found; nothing reaches the pool."""
    a, b = servers
    field = {
        "path": _fake_model(tmp_path / "m", seed=1),  # real weights: the old server stored these
        "hub-id": "no-such-org/no-such-model",
        "forged-token": "cxlkv-kv1." + "g" * 64,
    }[name]
    keys = _keys(field, 2, raw_name=True)
    assert _store(a, keys, [_obj(d) for d in _payload(2)]) == -1
    assert _lookup(b, keys) == [False, False]
    pool = cxlkv.Pool.open(lmcache_pool)
    try:
        assert pool.namespaces() == []
    finally:
        pool.close()


def test_the_model_field_alone_separates_engines(servers, tmp_path):
    """Same weights, another engine-side field (KV dtype, overrides): another namespace."""
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    keys = [ObjectKey(bytes([i]) * 16, _token(model, kv_dtype="bf16"), 0, 0, "") for i in range(2)]
    fp8 = [ObjectKey(bytes([i]) * 16, _token(model, kv_dtype="fp8_e4m3"), 0, 0, "") for i in range(2)]
    _store(a, keys, [_obj(d) for d in _payload(2)])
    assert _lookup(b, keys) == [True, True]
    assert _lookup(b, fp8) == [False, False]


def test_evict_deletes_from_the_pool(servers, tmp_path):
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    keys = _keys(model, 3)
    _store(a, keys, [_obj(d) for d in _payload(3)])
    a.delete(keys[:2])
    assert _lookup(b, keys) == [False, False, True]


def test_corrupt_block_is_a_miss(servers, tmp_path, lmcache_pool):
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    keys = _keys(model, 2)
    _store(a, keys, [_obj(d) for d in _payload(2)])
    # find the block of keys[0] the way any process could, and flip bytes in the pool file
    pool = cxlkv.Pool.open(lmcache_pool)
    try:
        (info,) = [i for i in pool.namespaces() if i["block_bytes"] == CHUNK_BYTES]
        ns = pool.namespace(cxlkv.KVLayout.from_info(info), info["name"])
        from cxlkv.integrations.lmcache import LMCacheKey

        where = ns.locate(LMCacheKey(_token(model), 0, 0, bytes([0]) * 16, "").pool_key())
        assert where is not None
        with open(lmcache_pool, "r+b") as f:
            f.seek(where["offset"] + 100)
            old = f.read(8)
            f.seek(where["offset"] + 100)
            f.write(bytes(x ^ 0xFF for x in old))
    finally:
        pool.close()
    outs = [_obj(), _obj()]
    assert _load(b, keys, outs) == [False, True]


def test_concurrent_submits_from_threads(servers, tmp_path):
    """Submits race from several threads (LMCache's event loop and its prefetch workers); the
    completions, drained by LMCache's demux thread, each name their own task."""
    a, b = servers
    model = _fake_model(tmp_path / "m", seed=1)
    per_thread = {
        t: ([ObjectKey(bytes([t, i]) * 8, _token(model), 0, 0, "") for i in range(4)], _payload(4, t))
        for t in range(4)
    }
    # L1 keeps its objects alive until the store completes (the views do not own the memory)
    sources = {t: [_obj(d) for d in data] for t, (_, data) in per_thread.items()}
    tasks: dict[int, int] = {}
    lock = threading.Lock()

    def submit(t: int) -> None:
        task = a.submit_store_task(per_thread[t][0], sources[t])
        with lock:
            tasks[task] = t

    threads = [threading.Thread(target=submit, args=(t,)) for t in per_thread]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    done: dict = {}

    def all_done():
        done.update(a.pop_completed_store_tasks())
        return True if len(done) == len(per_thread) else None

    _wait(a.get_store_event_fd(), all_done)
    assert set(done) == set(tasks) and all(r >= 0 for r in done.values())
    for keys, data in per_thread.values():
        outs = [_obj() for _ in keys]
        assert _load(b, keys, outs) == [True] * 4
        assert all(np.array_equal(o.raw_data.numpy(), d) for o, d in zip(outs, data, strict=True))


def test_close_is_idempotent_and_a_submit_after_it_is_a_closed_error(lmcache_pool):
    """A submit after close() used to enqueue a job no worker would ever run (its completion
    never came); now it is a ClosedError, and close() may be called again."""
    from cxlkv.errors import ClosedError
    from cxlkv.integrations.lmcache import CxlKVL2Connector

    conn = CxlKVL2Connector(pool_path=lmcache_pool)
    conn.close()
    conn.close()
    assert conn.drain_completions() == []  # never reads the (closed) descriptor
    for submit in (conn.submit_batch_exists, conn.submit_batch_delete):
        with pytest.raises(ClosedError, match="after close"):
            submit(["m@0@0@00"])
