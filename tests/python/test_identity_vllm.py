"""The connector's side of "identity follows the bytes" (issue 14 item 5): the workers name the
namespace by the weights as loaded and the scheduler side adopts it through vLLM's handshake;
the config vLLM reads from another directory (``hf_config_path``) is hashed. vLLM's own classes
(the connector base, ModelConfig); no engine (tests/vllm runs real engines)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import cxlkv

vllm_base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
torch = pytest.importorskip("torch")
from cxlkv.integrations import vllm as conn  # noqa: E402
from test_connector_unit import fake_configs  # noqa: E402
from test_loaded_weights import ROWS, model, rome_edit, save  # noqa: E402

Role = vllm_base.KVConnectorRole


class Runner:
    """Stands where vLLM's worker stands: it holds the loaded model and builds the worker-side
    connector (vLLM does so in Worker.initialize_from_config, after load_model)."""

    def __init__(self, module):
        self.module = module

    def get_model(self):
        return self.module

    def build(self, vc, kc):
        return conn.CxlKVConnector(vc, Role.WORKER, kc)


def engine(pool_path, model_dir, module=None, **extra):
    """(scheduler, worker) connectors of one engine, the handshake done as vLLM's engine core
    does it (after the workers registered their KV caches)."""
    vc, kc = fake_configs(pool_path, str(model_dir), **extra)
    sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
    worker = Runner(module).build(vc, kc) if module is not None else conn.CxlKVConnector(vc, Role.WORKER, kc)
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    return sched, worker


@pytest.fixture
def pool_path(tmp_path):
    return str(tmp_path / "pool")


def test_namespace_named_by_weights_as_loaded_rome_edit_separates(pool_path, tmp_path):
    m = model()
    d = save(m, tmp_path / "m")
    sched, worker = engine(pool_path, d, m)
    assert sched._ns_name == worker._ns_name
    assert worker.identity.source().startswith("weights as loaded sha256~")
    with cxlkv.Pool.open(pool_path) as pool:
        [ns] = pool.namespaces()  # the scheduler opened no namespace of its own
    assert ns["name"] == worker._ns_name and ns["source"].startswith("weights as loaded")

    # Same files on disk (the sampled digest cannot tell), 20 rows edited in memory.
    edited = model()
    rome_edit(edited)
    assert engine(pool_path, d, edited)[1]._ns_name != worker._ns_name
    # Same bytes in another instance: the same namespace (engines share KV).
    assert engine(pool_path, d, model())[0]._ns_name == worker._ns_name


def test_sampled_when_the_model_is_unreachable_or_asked_for(pool_path, tmp_path):
    m = model()
    d = save(m, tmp_path / "m")
    loaded = engine(pool_path, d, m)[1]
    sched, worker = engine(pool_path, d)  # no runner on the stack
    assert sched._ns_name == worker._ns_name != loaded._ns_name
    assert worker.identity.source().startswith("weights sampled sha256~")
    asked = engine(pool_path, d, m, weights_identity="sampled")[1]
    assert asked._ns_name == worker._ns_name
    with pytest.raises(ValueError, match="weights_identity"):
        engine(pool_path, d, m, weights_identity="fast")


def test_scheduler_and_workers_that_disagree_serve_without_the_cache(pool_path, tmp_path):
    m = model()
    d = save(m, tmp_path / "m")
    vc, kc = fake_configs(pool_path, str(d))
    sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
    meta = Runner(m).build(vc, kc).get_handshake_metadata()
    sched.set_xfer_handshake_metadata(
        {0: conn.CxlKVHandshake("kv1-" + "0" * 48, meta.weights, meta.weights_source)}
    )
    assert not sched._session.guard.usable()


def test_hf_config_path_is_hashed(tmp_path):
    """A config taken from another directory (vLLM's hf_config_path) is part of the identity:
    another config, another namespace; the same bytes elsewhere, the same one."""
    from vllm.config import ModelConfig

    from cxlkv.testing import models

    tiny = models.tiny_llama()
    config = json.loads((Path(tiny) / "config.json").read_text())
    dirs = {}
    for name, theta in (("a", None), ("a2", None), ("b", 5e5)):
        d = tmp_path / name
        d.mkdir()
        c = dict(config)
        if theta is not None:
            c["rope_theta"] = theta
            c["rope_parameters"] = {**(c.get("rope_parameters") or {}), "rope_theta": theta}
        (d / "config.json").write_text(json.dumps(c))
        dirs[name] = d
    dirs["none"] = None

    def namespace(cfg_dir):
        mc = ModelConfig(model=tiny, hf_config_path=str(cfg_dir) if cfg_dir else None)
        vc, _ = fake_configs("unused", tiny)
        vc.model_config = mc
        spec = SimpleNamespace(dtype=torch.bfloat16, num_kv_heads=1, head_size=8)
        return conn.derive_identity(vc, spec, 2, 256, "dense", 0, 1, {}).namespace_name()

    names = {k: namespace(v) for k, v in dirs.items()}
    assert names["a"] == names["a2"]
    assert names["b"] != names["a"]
    assert names["none"] != names["b"]


def test_weights_repacked_out_of_reach_hash_every_byte_of_the_files(pool_path, tmp_path):
    """What vLLM CPU does (a oneDNN handle holds the projection, `weight` is emptied): the
    worker hashes every byte of the weight files instead, and the source says so."""

    def repacked(m):
        m[1].weight = torch.nn.Parameter(torch.empty(0, dtype=torch.float16), requires_grad=False)
        return m

    m = model()
    a = save(m, tmp_path / "a")
    sched, worker = engine(pool_path, a, repacked(model()))
    assert sched._ns_name == worker._ns_name
    assert worker.identity.source().startswith("weights file bytes sha256~")
    assert (
        engine(pool_path, save(model(), tmp_path / "copy"), repacked(model()))[1]._ns_name == worker._ns_name
    )
    rome_edit(m)
    b = save(m, tmp_path / "b")  # the edit the sampled digest misses, on disk this time
    assert engine(pool_path, b, repacked(model()))[1]._ns_name != worker._ns_name


def test_pipeline_stages_beyond_the_first_do_not_stop_the_engine(pool_path, tmp_path):
    """vLLM's default handshake handler raises on a pipeline stage > 0; the first stage names it."""
    m = model()
    d = save(m, tmp_path / "m")
    vc, kc = fake_configs(pool_path, str(d))
    sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
    first = Runner(m).build(vc, kc).get_handshake_metadata()
    later = conn.CxlKVHandshake("kv1-" + "1" * 48, "loaded:other", "another stage")
    sched.set_xfer_handshake_metadata_pp_aware({(0, 0): first, (1, 0): later})
    assert sched._ns_name == first.namespace and sched._session.guard.usable()


def test_weights_that_cannot_be_hashed_fall_back_to_sampled(pool_path, tmp_path):
    m = model()
    d = save(m, tmp_path / "m")
    m[2].weight = torch.nn.Parameter(torch.empty(ROWS, device="meta"), requires_grad=False)  # no bytes
    sched, worker = engine(pool_path, d, m)
    assert worker.identity.source().startswith("weights sampled") and sched._ns_name == worker._ns_name


def test_engine_neutral_namespace_and_its_opt_out(pool_path, tmp_path):
    """vLLM CPU with one full-attention group and auto 16-bit KV names its namespace the way
    SGLang's HiCache backend does (identity.shared_identity: no engine, no parsed config, the
    per-head entry order); ``share_engines: false`` keeps the engine's own; both sides agree;
    another spec class (here vLLM's duck-typed test spec) is not shared."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cxlkv.integrations import identity as ident

    m = model()
    d = save(m, tmp_path / "m")

    def pair(**extra):
        vc, kc = fake_configs(pool_path, str(d), **extra)
        old = kc.kv_cache_groups[0].kv_cache_spec
        kc.kv_cache_groups[0].kv_cache_spec = FullAttentionSpec(
            block_size=vc.cache_config.block_size, num_kv_heads=old.num_kv_heads, head_size=old.head_size,
            dtype=torch.bfloat16,
        )  # fmt: skip
        sched = conn.CxlKVConnector(vc, Role.SCHEDULER, kc)
        worker = Runner(m).build(vc, kc)
        sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        return sched, worker

    sched, shared = pair()
    own = pair(share_engines=False)[1]
    assert shared.identity.device_layout.startswith(ident.SHARED_ENTRY_LAYOUT), shared.identity
    assert shared.identity.compute_dtype == shared.identity.dtype and shared.identity.heads_per_entry == 1
    assert sched._ns_name == shared._ns_name
    assert own._ns_name != shared._ns_name
    assert not own.identity.device_layout.startswith(ident.SHARED_ENTRY_LAYOUT)
    duck = engine(pool_path, d, m)[1]
    assert not duck.identity.device_layout.startswith(ident.SHARED_ENTRY_LAYOUT)
