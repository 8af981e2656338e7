"""Fast tests of the vLLM connector's state machine, without an engine (as vLLM tests its own
connectors in tests/v1/kv_connector/unit): a fake scheduler drives the scheduler-side and
worker-side connectors of one process through alloc / meta / load / save / output / finish, on a
real pool; a fake "model" computes each block's KV from the previous block's bytes, so KV computed
on top of a block that never arrived is wrong, exactly as in a real forward pass.

Also the identity module (no vLLM needed for those tests)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest

import cxlkv
from cxlkv.integrations import identity as ident
from cxlkv_testutil import make_model

BS = 4  # tokens per block
NUM_BLOCKS = 64
LAYERS = 2
HEAD = 8  # one KV head of 8 bf16 values: 2 * 4 * 8 * 2 = 128 bytes per layer and block


# -------------------------------------------------------------------------------------------------
# identity (no vLLM)
def published(pool_path: str, model_dir: str, req_id: str, toks: list) -> Engine:
    """An engine that has computed and saved the prompt `toks` (request `req_id`, finished)."""
    e = Engine(pool_path, model_dir)
    e.add(req_id, toks)
    e.step({req_id: len(toks)})
    e.finish(req_id)
    return e


def test_identity_same_bytes_other_path_same_id(tmp_path):
    a = make_model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    b.parent.mkdir()
    os.system(f"cp -r {a} {b}")
    assert ident.weights_digest(a).digest == ident.weights_digest(b).digest


def test_identity_one_byte_in_sampled_region_changes_id(tmp_path):
    a = make_model(tmp_path / "a")
    b = make_model(tmp_path / "b")
    ref = ident.weights_digest(a).digest
    assert ident.weights_digest(b).digest == ref
    p = b / "model.safetensors"
    data = bytearray(p.read_bytes())
    hlen = struct.unpack("<Q", data[:8])[0]
    first_tensor = json.loads(data[8 : 8 + hlen])["a.weight"]["data_offsets"][0] + 8 + hlen
    data[first_tensor + 5] ^= 0x01  # inside the first sample window of a.weight
    p.write_bytes(bytes(data))
    os.utime(p, ns=(1, 1))  # a new stamp even on coarse-mtime filesystems
    assert ident.weights_digest(b).digest != ref


def test_identity_perturbed_checkpoint_differs(tmp_path):
    """Two checkpoints of one architecture (same header, same shapes) are told apart."""
    assert (
        ident.weights_digest(make_model(tmp_path / "a", 1)).digest
        != ident.weights_digest(make_model(tmp_path / "b", 2)).digest
    )


def test_identity_cache_is_used_and_invalidated(tmp_path, monkeypatch):
    a = make_model(tmp_path / "a")
    first = ident.weights_digest(a).digest
    assert (a / ident.CACHE_FILE).exists()
    calls = []
    monkeypatch.setattr(ident, "file_digest", lambda p, suffix=None: calls.append(p) or "00" * 32)
    assert ident.weights_digest(a).digest == first and calls == []  # served from the cache
    os.utime(a / "model.safetensors", ns=(5, 5))
    ident.weights_digest(a)
    assert len(calls) == 1  # the stamp changed: recomputed


def test_identity_cache_in_home_when_model_dir_read_only(tmp_path, monkeypatch):
    a = make_model(tmp_path / "a")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    os.chmod(a, 0o555)
    try:
        if os.access(a, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        ident.weights_digest(a)
        assert list((tmp_path / "home" / ".cache" / "cxlkv" / "identity").glob("*.json"))
    finally:
        os.chmod(a, 0o755)


def test_identity_gguf_tensors_sampled(tmp_path):
    """A GGUF file: tensor table parsed, every tensor sampled; one byte of a tensor changes it."""

    def gguf(path, payload: bytes):
        def s(x: bytes):
            return struct.pack("<Q", len(x)) + x

        head = b"GGUF" + struct.pack("<IQQ", 3, 2, 1)
        head += s(b"general.name") + struct.pack("<I", 8) + s(b"tiny")
        t1, t2 = (
            s(b"t1") + struct.pack("<IQIQ", 1, len(payload) // 2, 0, 0),
            s(b"t2") + struct.pack("<IQIQ", 1, len(payload) // 2, 0, len(payload) // 2),
        )
        body = head + t1 + t2
        body += b"\0" * ((-len(body)) % 32)
        path.write_bytes(body + payload)
        return len(body)

    rng = np.random.default_rng(3)
    payload = bytearray(rng.bytes(1 << 20))
    a = tmp_path / "m.gguf"
    start = gguf(a, bytes(payload))
    ref = ident.file_digest(a)
    assert ident.file_digest(a) == ref
    f = open(a, "rb")
    _table, ranges = ident._gguf_tensor_ranges(f, a.stat().st_size)
    f.close()
    assert ranges == [(start, len(payload) // 2), (start + len(payload) // 2, len(payload) // 2)]
    payload[len(payload) // 2 + 1] ^= 1  # start of t2: a sampled window
    gguf(a, bytes(payload))
    assert ident.file_digest(a) != ref


def test_identity_dtype_aliases_same_namespace():
    base = dict(weights="w", kind="dense", num_layers=2, num_kv_heads=1, head_size=8, block_size=4)
    names = {
        ident.KVIdentity(dtype=d, **base).namespace_name() for d in ("bf16", "bfloat16", "torch.bfloat16")
    }
    assert len(names) == 1
    assert ident.KVIdentity(dtype="fp16", **base).namespace_name() not in names
    with pytest.raises(ValueError):
        ident.KVIdentity(dtype="float7", **base)


def test_identity_every_field_separates():
    base = dict(
        weights="w", dtype="bf16", kind="dense", num_layers=2, num_kv_heads=1, head_size=8, block_size=4
    )
    ref = ident.KVIdentity(**base).namespace_name()
    for k, v in (
        ("weights", "w2"),
        ("block_size", 8),
        ("heads_per_entry", 1),
        ("quantization", "awq"),
        ("kv_scales", "x"),
        ("device_layout", "cuda"),
        ("compute_dtype", "fp16"),
    ):
        kw = dict(base, **{k: v})
        assert ident.KVIdentity(**kw).namespace_name() != ref, k
    # the source is display text, not identity
    assert ident.KVIdentity(**base, weights_source="elsewhere").namespace_name() == ref


def test_long_names_hashed_not_truncated():
    a, b = "m" * 200 + "a", "m" * 200 + "b"
    assert ident.short_name(a) != ident.short_name(b)
    assert len(ident.short_name(a)) <= ident.MAX_NAME
    assert ident.short_name("short") == "short"
    assert "\n" not in ident.short_name("x\ny")


# -------------------------------------------------------------------------------------------------
# the connector's state machine (needs vLLM's connector base classes, no engine)
vllm_base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
torch = pytest.importorskip("torch")
from cxlkv.integrations import vllm as conn  # noqa: E402

Role = vllm_base.KVConnectorRole


def fake_configs(pool_path: str, model_dir: str, role: str = "kv_both", **extra):
    tc = SimpleNamespace(
        kv_connector_extra_config={
            "pool_path": pool_path,
            "pool_size": "16MiB",
            "chunk_size": "1MiB",
            **extra,
        },
        is_kv_producer=role == "kv_producer",
        is_kv_consumer=role == "kv_consumer",
        kv_load_failure_policy="fail",
    )
    vc = SimpleNamespace(
        kv_transfer_config=tc,
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        model_config=SimpleNamespace(
            model=model_dir, dtype=torch.bfloat16, quantization=None, hf_overrides={}
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        attention_config=SimpleNamespace(backend=None),
    )
    spec = SimpleNamespace(
        dtype=torch.bfloat16, num_kv_heads=1, head_size=HEAD, page_size_bytes=2 * BS * HEAD * 2
    )
    kc = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(LAYERS)])],
        num_blocks=NUM_BLOCKS,
    )
    return vc, kc


class Req(SimpleNamespace):
    pass


def make_req(rid: str, tokens: list, n_prompt: int | None = None) -> Req:
    n_prompt = len(tokens) if n_prompt is None else n_prompt
    return Req(
        request_id=rid,
        prompt_token_ids=list(tokens[:n_prompt]),
        all_token_ids=list(tokens),
        num_prompt_tokens=n_prompt,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
        prompt_embeds=None,
    )


def clean_block(tokens: list, j: int) -> bytes:
    """What a correct forward pass writes into block j (depends on every earlier token)."""
    return hashlib.sha256(repr(tokens[: (j + 1) * BS]).encode()).digest() * 8  # 256 bytes


class Engine:
    """One process's scheduler + worker connectors and a fake model over real KV arrays."""

    def __init__(self, pool_path: str, model_dir: str, role: str = "kv_both", **extra):
        vc, kc = fake_configs(pool_path, model_dir, role, **extra)
        self.sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
        self.worker = conn.CxlKVConnector(vc, Role.WORKER, kc)
        self.kv = [torch.zeros((NUM_BLOCKS, 2, BS, 1, HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.worker.register_kv_caches({f"l{i}": a for i, a in enumerate(self.kv)})
        self.free = list(range(NUM_BLOCKS))
        self.reqs: dict = {}  # rid -> dict(req, blocks, computed)
        self.fail_next_load = None  # (rid, index): the worker's load of that block fails once
        self.stats = conn.CxlKVStats()

    # the model: block j = f(block j-1's bytes as found in the KV cache, tokens of block j)
    def block_bytes(self, bid: int) -> bytes:
        return b"".join(a[bid].contiguous().view(torch.uint8).numpy().tobytes() for a in self.kv)

    def write_block(self, bid: int, data: bytes) -> None:
        half = len(data) // LAYERS
        for i, a in enumerate(self.kv):
            a[bid].view(-1).view(torch.uint8)[:] = torch.frombuffer(
                bytearray(data[i * half : (i + 1) * half]), dtype=torch.uint8
            )

    def compute(self, rid: str, start: int, end: int) -> None:
        r = self.reqs[rid]
        toks = r["req"].all_token_ids
        for t in range(start, end):
            if (t + 1) % BS:
                continue
            j = t // BS
            prev = self.block_bytes(r["blocks"][j - 1]) if j else b""
            ok = j == 0 or prev == clean_block(toks, j - 1)
            self.write_block(r["blocks"][j], clean_block(toks, j) if ok else b"\x66" * 256)

    def add(self, rid: str, tokens: list, n_prompt=None, local: int = 0):
        req = make_req(rid, tokens, n_prompt)
        ext, async_ = self.sched.get_num_new_matched_tokens(req, local)
        assert async_ is False
        need = -(-len(tokens) // BS)
        blocks = [self.free.pop(0) for _ in range(need)]
        self.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), ext)
        self.reqs[rid] = {"req": req, "blocks": blocks, "computed": local + ext, "new": True}
        return ext

    def step(self, budget: dict, wait_saves: bool = True) -> conn.CxlKVConnectorMetadata:
        """Schedules budget[rid] tokens of each request, runs the step, applies vLLM's reaction
        to load errors (num_computed truncated at the first invalid block)."""
        new, cached = (
            [],
            SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
        )
        for rid in budget:
            r = self.reqs[rid]
            if r["new"]:
                new.append(
                    SimpleNamespace(
                        req_id=rid, block_ids=(list(r["blocks"]),), num_computed_tokens=r["computed"]
                    )
                )
                r["new"] = False
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r["computed"])
        out = SimpleNamespace(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=dict(budget)
        )
        meta = self.sched.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        if self.fail_next_load is not None:
            self._inject_load_failure(meta)
        self.worker.start_load_kv(None)
        for rid, n in budget.items():
            r = self.reqs[rid]
            self.compute(rid, r["computed"], r["computed"] + n)
        self.worker.wait_for_save()
        if wait_saves:  # as if the step outlasted its saves: the tests check the pool next
            self.worker.worker._saves.wait_all()
        errors = self.worker.get_block_ids_with_load_errors()
        s = self.worker.get_kv_connector_stats()
        if s is not None:
            self.stats.aggregate(s)
        self.worker.clear_connector_metadata()
        for rid, n in budget.items():
            r = self.reqs[rid]
            before = r["computed"]
            r["computed"] += n
            bad = [i for i, b in enumerate(r["blocks"][: -(-before // BS)]) if b in errors]
            if bad:
                r["computed"] = bad[0] * BS
        self.sched.update_connector_output(SimpleNamespace(invalid_block_ids=errors))
        return meta

    def _inject_load_failure(self, meta) -> None:
        rid, idx = self.fail_next_load
        for op in meta.loads:
            if op.req_id == rid:
                real = self.worker._session.ns

                class Failing:
                    block_bytes = real.block_bytes

                    def load(_, keys, arrays, ids, block_dim=0):
                        n = real.load(keys[:idx], arrays, ids[:idx], block_dim=block_dim)  # noqa: B023 - one load op per request and step
                        for b in ids[idx:]:
                            self.write_block(b, b"\x00" * 256)  # what vLLM's buffer held
                        return n

                    def __getattr__(_, name):
                        return getattr(real, name)  # noqa: B023 - one load op per request and step

                self.worker._session.ns = Failing()
                self.fail_next_load = None
                self._restore = real

    def finish(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.sched.request_finished(r["req"], r["blocks"])
        self.free.extend(r["blocks"])
        if hasattr(self, "_restore"):
            self.worker._session.ns = self._restore

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def tokens(seed: int, n: int) -> list:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 30000, n)]


def pool_blocks(pool_path: str, ns_name: str, toks: list) -> dict:
    """depth -> bytes of every block of toks' chain that the pool holds."""
    from cxlkv.integrations.heads import head_key
    from cxlkv.integrations.keys import block_keys

    with cxlkv.Pool.open(pool_path) as pool:
        d = next(n for n in pool.namespaces() if n["name"] == ns_name)
        lay = cxlkv.KVLayout.from_info(d)
        ns = pool.namespace(lay, name=ns_name)
        out = {}
        assert lay.heads_per_entry == 1 and lay.num_kv_heads == 1  # one entry per block and head
        for i, k in enumerate(block_keys(toks, BS, ns_name)):
            b = ns.get_bytes(head_key(k, 0))
            if b is not None:
                out[i] = bytes(b)
        return out


def test_saves_and_loads_roundtrip(pool_path, model_dir):
    toks = tokens(1, 10 * BS + 1)
    a = Engine(pool_path, model_dir)
    assert a.add("r1", toks) == 0
    a.step({"r1": len(toks)})
    a.finish("r1")
    blocks = pool_blocks(pool_path, a.sched._ns_name, toks)
    assert sorted(blocks) == list(range(10))
    assert all(blocks[j] == clean_block(toks, j) for j in blocks)
    b = Engine(pool_path, model_dir)
    assert b.add("r2", toks) == 10 * BS
    meta = b.step({"r2": 1})
    assert len(meta.loads) == 1 and not meta.saves
    assert b.block_bytes(b.reqs["r2"]["blocks"][9]) == clean_block(toks, 9)
    b.finish("r2")
    a.close(), b.close()


def test_tenant_key_charges_the_engines_saves_to_its_tenant(pool_path, model_dir):
    """kv_connector_extra_config "tenant" reaches the namespace: the engine's saves are charged to
    it (docs/ARCHITECTURE.md "Quotas"), and a second tenant reads them (not part of the key)."""
    toks = tokens(7, 4 * BS + 1)
    a = Engine(pool_path, model_dir, tenant="team-a")
    a.add("r1", toks)
    a.step({"r1": len(toks)})
    a.finish("r1")
    with cxlkv.Pool.open(pool_path) as pool:
        (q,) = [q for q in pool.quotas() if q["tenant"] == "team-a"]
        assert q["usage_bytes"] >= 4 * LAYERS * 2 * BS * HEAD * 2
    b = Engine(pool_path, model_dir, tenant="team-b")
    assert b.add("r2", toks) == 4 * BS
    a.close(), b.close()


def test_lease_lifetime_alloc_meta_output_finish(pool_path, model_dir):
    toks = tokens(2, 6 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    ns = b.sched._session.ns
    key0 = b.sched.scheduler._keys_for(make_req("x", toks)).extend(toks)[0]
    b.add("r", toks)
    st = b.sched.scheduler._reqs["r"]
    assert len(st.lease) == 1 and len(st.lease[0]) == 6  # one group: one lease
    assert ns.delete(key0) is False  # pinned from lookup on...
    meta = b.sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id="r", block_ids=(b.reqs["r"]["blocks"],), num_computed_tokens=6 * BS)
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
            ),
            num_scheduled_tokens={"r": 1},
        )
    )
    assert len(meta.loads) == 1 and st.lease  # ...through the step that loads them...
    b.sched.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
    assert not st.lease  # ...and released once that step completed
    assert ns.delete(key0) is True
    b.sched.request_finished(b.reqs["r"]["req"], [])
    a.close(), b.close()


def test_lease_released_when_request_finishes_before_its_load(pool_path, model_dir):
    toks = tokens(3, 5 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    b.add("r", toks)
    st = b.sched.scheduler._reqs["r"]
    assert st.lease
    b.sched.request_finished(b.reqs["r"]["req"], [])  # aborted before being scheduled
    assert not st.lease and "r" not in b.sched.scheduler._reqs
    with cxlkv.Pool.open(pool_path) as p:
        assert p.check()["orphan_pins"] == 0
    a.close(), b.close()


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_f2_no_save_on_top_of_failed_load_and_resave_after_recompute(pool_path, model_dir, fail_at):
    """F2: engine B loads 5 blocks of P, the load fails at block `fail_at`, and the same step
    computes Q's blocks on top of the missing KV. Nothing computed on top of it may reach the
    pool; after vLLM recomputes, the blocks are saved again: the pool ends byte-identical to a
    clean run (every block equals the clean computation)."""
    p = tokens(4, 5 * BS + 2)
    pq = p + tokens(5, 4 * BS)
    a = published(pool_path, model_dir, "a", p)
    b = Engine(pool_path, model_dir)
    assert b.add("b", pq) == 5 * BS
    b.fail_next_load = ("b", fail_at)
    meta = b.step({"b": len(pq) - 5 * BS})  # loads 0-4 (fails at fail_at), computes 5-8
    assert meta.loads and not meta.saves  # saves of a step with a load in flight are held
    assert b.reqs["b"]["computed"] == fail_at * BS  # vLLM's reaction to the invalid blocks
    assert b.stats.data["load_failed_blocks"] == 5 - fail_at
    # vLLM recomputes from the failed block on; the connector saves what it recomputes.
    b.step({"b": len(pq) - fail_at * BS})
    b.step({"b": 1})  # a decode step
    b.finish("b")
    blocks = pool_blocks(pool_path, b.sched._ns_name, pq)
    assert sorted(blocks) == list(range(len(pq) // BS))
    bad = [j for j, v in blocks.items() if v != clean_block(pq, j)]
    assert bad == [], f"poisoned blocks at depths {bad}"
    a.close(), b.close()


def test_held_saves_go_out_after_a_successful_load(pool_path, model_dir):
    p = tokens(6, 3 * BS + 2)
    pq = p + tokens(7, 3 * BS)
    a = published(pool_path, model_dir, "a", p)
    b = Engine(pool_path, model_dir)
    b.add("b", pq)
    meta = b.step({"b": len(pq) - 3 * BS})
    assert meta.loads and not meta.saves
    meta = b.step({"b": 1})
    assert [(op.start_depth, len(op.keys)) for op in meta.saves] == [(3, 3)]
    b.finish("b")
    blocks = pool_blocks(pool_path, b.sched._ns_name, pq)
    assert all(blocks[j] == clean_block(pq, j) for j in range(6))
    a.close(), b.close()


def test_preemption_drops_held_saves_and_resaves(pool_path, model_dir):
    p = tokens(8, 3 * BS + 2)
    pq = p + tokens(9, 3 * BS)
    a = published(pool_path, model_dir, "a", p)
    b = Engine(pool_path, model_dir)
    b.add("b", pq)
    b.step({"b": len(pq) - 3 * BS})
    st = b.sched.scheduler._reqs["b"]
    # Preempted before the held saves went out, resumed with new blocks and recomputed from 0.
    r = b.reqs["b"]
    b.free.extend(r["blocks"])
    for bid in r["blocks"]:
        b.write_block(bid, b"\x55" * 256)  # another request reused them
    r["blocks"] = [b.free.pop() for _ in r["blocks"]]
    r["computed"] = 0
    cached = SimpleNamespace(
        req_ids=["b"], new_block_ids=[(list(r["blocks"]),)], resumed_req_ids={"b"}, num_computed_tokens=[0]
    )
    meta = b.sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"b": len(pq)}
        )
    )
    assert not st.held
    b.worker.bind_connector_metadata(meta)
    b.worker.start_load_kv(None)
    b.compute("b", 0, len(pq))
    b.worker.wait_for_save()
    b.worker.worker._saves.wait_all()
    b.worker.clear_connector_metadata()
    b.sched.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
    b.finish("b")
    blocks = pool_blocks(pool_path, b.sched._ns_name, pq)
    assert sorted(blocks) == list(range(6))
    assert all(blocks[j] == clean_block(pq, j) for j in range(6))
    a.close(), b.close()


def test_f5_failed_saves_counted_and_logged_once(pool_path, model_dir, caplog):
    a = Engine(pool_path, model_dir)
    toks = tokens(10, 6 * BS + 1)
    a.add("r", toks)
    real = a.worker._session.ns

    class Full:
        block_bytes = real.block_bytes

        def store(_, keys, arrays, ids, block_dim=0, start_depth=0):
            return real.store(keys[:2], arrays, ids[:2], block_dim=block_dim, start_depth=start_depth)

        def __getattr__(_, name):
            return getattr(real, name)

    a.worker._session.ns = Full()
    a.step({"r": len(toks)})
    assert a.stats.data["store_failed_blocks"] == 4
    toks2 = tokens(16, 6 * BS + 1)
    a.add("r2", toks2)
    a.step({"r2": len(toks2)})
    assert a.stats.data["store_failed_blocks"] == 8
    msgs = [r.getMessage() for r in caplog.records if "could not be saved" in r.getMessage()]
    assert len(msgs) == 1 and pool_path in msgs[0]  # once per cause, not per request
    a.worker._session.ns = real
    a.finish("r"), a.finish("r2")
    a.close()


def test_f7_pin_capped_hit_counted_and_logged(pool_path, model_dir, caplog):
    """A hit that stops because the node's pin slots ran out (the next blocks are in the pool)
    is counted and said once, not a silent partial hit."""
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", pin_slots=4).close()
    toks = tokens(17, 8 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    got = b.add("r", toks)
    # The lease stops at the pool's lease cap (pin_slots less the gets' reserve, set by the core).
    assert 0 < got < 8 * BS and got % BS == 0
    b.step({"r": len(toks) - got})
    assert b.stats.data["pin_capped_requests"] == 1
    assert b.stats.data["pin_capped_blocks"] == 8 - got // BS
    assert any("pin slots are exhausted" in r.getMessage() for r in caplog.records)
    b.finish("r")
    a.close(), b.close()


def test_f1_long_model_ids_never_collide(pool_path, model_dir):
    """ns_name_truncation.py: ids that share their first 90 characters are different namespaces
    (hashed, not truncated), and neither engine fails to start."""
    base = "org/" + "x" * 120
    a = Engine(pool_path, model_dir, model_id=base + "-a")
    b = Engine(pool_path, model_dir, model_id=base + "-b")
    assert a.sched._ns_name != b.sched._ns_name
    assert a.sched.identity.model_id() != b.sched.identity.model_id()
    a.close(), b.close()


def test_f6_pool_file_deleted_degrades_to_no_cache(pool_path, model_dir, caplog):
    toks = tokens(11, 6 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    os.unlink(pool_path)
    import time

    time.sleep(0.01)  # the guard's stat interval (1 ms)
    assert a.add("r2", toks) == 0  # no hit from a pool that is not at the path any more
    meta = a.step({"r2": len(toks)})
    assert not meta.saves and not meta.loads
    a.finish("r2")
    assert a.stats.data["pool_disabled"] == 1
    assert not a.worker._session.usable() and "deleted" in a.worker._session.guard.cause
    a.close()


def test_f6_pool_file_replaced_is_noticed(pool_path, model_dir, caplog):
    """F6: another pool renamed over the path: this process stops using the old (orphaned) one
    instead of silently splitting from the engines that open the new one."""
    toks = tokens(15, 4 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    cxlkv.Pool.create(pool_path + ".new", "16MiB", chunk_size="1MiB").close()
    os.rename(pool_path + ".new", pool_path)
    import time

    time.sleep(0.01)
    assert a.add("r2", toks) == 0
    a.step({"r2": len(toks)})
    a.finish("r2")
    msgs = [r.getMessage() for r in caplog.records if "no longer usable" in r.getMessage()]
    assert len(msgs) == 1 and "replaced" in msgs[0]
    a.close()
    with cxlkv.Pool.open(pool_path) as p:
        assert p.namespaces() == []  # nothing was written into the new pool by the old engine


def test_f3_pool_file_truncated_no_sigbus(pool_path, model_dir, caplog):
    """F3: the pool file truncated between two steps: the next hook sees it before touching the
    mapping (a touch would be SIGBUS and kill this test process), leases and the pool are never
    released into the truncated mapping, and the engine goes on without the cache."""
    toks = tokens(14, 6 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    assert b.add("r", toks) == 6 * BS  # holds a lease (pins in the node area)
    os.truncate(pool_path, 4096)
    import time

    time.sleep(0.01)
    b.step({"r": 1})  # the promised load is reported invalid: vLLM recomputes
    assert b.reqs["r"]["computed"] == 0
    b.step({"r": len(toks)})
    assert b.add("r2", toks) == 0
    b.finish("r")
    a.close(), b.close()  # must not touch the mapping
    msgs = [r.getMessage() for r in caplog.records if "no longer usable" in r.getMessage()]
    assert len(msgs) == 1 and "truncated to 4096 bytes" in msgs[0] and pool_path in msgs[0]


def test_f3_engine_starts_on_a_damaged_pool_without_cache(pool_path, model_dir, caplog):
    """pool_truncate_live.sh's engine B: a new engine on a truncated pool file serves without the
    cache (one log line naming the pool and why) instead of failing to start."""
    with open(pool_path, "wb") as f:
        f.write(b"\0" * 4096)
    e = Engine(pool_path, model_dir)
    toks = tokens(18, 3 * BS + 1)
    assert e.add("r", toks) == 0
    meta = e.step({"r": len(toks)})
    assert not meta.saves and not meta.loads
    e.finish("r")
    e.close()
    msgs = [r.getMessage() for r in caplog.records if "no longer usable" in r.getMessage()]
    assert len(msgs) == 1 and pool_path in msgs[0] and "opening it failed" in msgs[0]
    vc, kc = fake_configs(pool_path, model_dir, on_pool_error="fail")
    with pytest.raises(cxlkv.CxlkvError):
        conn.CxlKVConnector(vc, Role.SCHEDULER, kc)


def test_pool_failure_after_lookup_makes_vllm_recompute(pool_path, model_dir):
    """The pool breaks between the lookup and the load: the worker reports every block of the
    load as invalid, so vLLM recomputes instead of using empty KV."""
    toks = tokens(12, 6 * BS + 1)
    a = published(pool_path, model_dir, "r", toks)
    b = Engine(pool_path, model_dir)
    assert b.add("r", toks) == 6 * BS
    b.worker._session.guard.fail("test: pool broken")
    b.step({"r": 1})
    assert b.reqs["r"]["computed"] == 0
    assert b.stats.data["load_failed_blocks"] == 6
    b.finish("r")
    a.close(), b.close()


def test_f1_namespace_follows_weights_not_alias(pool_path, tmp_path):
    a = Engine(pool_path, make_model(tmp_path / "a", 1))
    b = Engine(pool_path, make_model(tmp_path / "b", 2))
    os.system(f"cp -r {tmp_path / 'a'} {tmp_path / 'c'}")
    c = Engine(pool_path, str(tmp_path / "c"))
    assert a.sched._ns_name != b.sched._ns_name
    assert a.sched._ns_name == c.sched._ns_name
    d = Engine(pool_path, str(tmp_path / "b"), model_id="operator-says-same")
    e = Engine(pool_path, str(tmp_path / "a"), model_id="operator-says-same")
    assert d.sched._ns_name == e.sched._ns_name
    for x in (a, b, c, d, e):
        x.close()


def test_prompt_embeds_keyed_by_content(pool_path, model_dir):
    e = Engine(pool_path, model_dir)
    n = 3 * BS + 1
    reqs = []
    for seed in (1, 1, 2):
        r = make_req(f"e{len(reqs)}", [0] * n)
        r.prompt_token_ids = None
        r.prompt_embeds = torch.from_numpy(
            np.random.default_rng(seed).standard_normal((n, 4)).astype("float32")
        )
        reqs.append(e.sched.scheduler._keys_for(r).extend([0] * n))
    plain = e.sched.scheduler._keys_for(make_req("t", [0] * n)).extend([0] * n)
    assert reqs[0] == reqs[1] and reqs[0][0] != reqs[2][0] and plain[0] != reqs[0][0]
    e.close()


def test_lora_keyed_by_adapter_content(pool_path, model_dir, tmp_path):
    e = Engine(pool_path, model_dir)
    toks = tokens(13, 2 * BS)
    ad1, ad2 = make_model(tmp_path / "ad1", 5), make_model(tmp_path / "ad2", 6)
    os.system(f"cp -r {ad1} {tmp_path / 'ad1copy'}")

    def key(path, name):
        r = make_req("x", toks)
        r.lora_request = SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))
        return e.sched.scheduler._keys_for(r).extend(toks)[0]

    assert key(ad1, "same-name") != key(ad2, "same-name")
    assert key(ad1, "one-name") == key(tmp_path / "ad1copy", "other-name")
    r = make_req("x", toks)
    r.lora_request = SimpleNamespace(lora_name="gone", lora_int_id=2, lora_path=str(tmp_path / "missing"))
    assert e.sched.scheduler._keys_for(r) is None  # unreadable adapter: not cached at all
    e.close()


def test_coalesce_next_turn_waits_only_for_the_turn_in_flight(pool_path, model_dir):
    """Issue 24 item 2 through the connector: turn 2 (13 prompt blocks) arrives on engine B while
    turn 1 (its first 10 blocks) is in flight on A: B offers vLLM those 10 blocks as an
    asynchronous load, not its whole miss, and holds the intents of the 3 it computes at once. A's
    prefill steps give its prefill rate (the bound of the waits it plans)."""
    turn1 = tokens(40, 10 * BS + 1)
    turn2 = turn1 + tokens(41, 3 * BS)
    a, b = Engine(pool_path, model_dir), Engine(pool_path, model_dir)
    assert a.add("t1", turn1) == 0  # a new prefix: A computes it and takes its intents
    rate = a.sched.scheduler._coalesce.rate
    assert not rate.measured
    req = make_req("t2", turn2)
    # B's own prefill is far slower than A's (published with A's intents): waiting is clearly
    # shorter. (At the same speed, both starting now, B would compute: test_coalesce_unit.py.)
    b.sched.scheduler._coalesce.rate.tps = 1.0
    assert b.sched.get_num_new_matched_tokens(req, 0) == (10 * BS, True)
    assert b.sched.scheduler._coalesce.held_blocks("t2") == (10, 13)
    a.step({"t1": len(turn1)})
    assert rate.measured and rate.tps > 0
    b.sched.request_finished(req, [])
    a.finish("t1")
    a.close(), b.close()
