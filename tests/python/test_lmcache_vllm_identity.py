"""The identity cxlkv's vLLM-side LMCache connector puts into LMCache's keys (lmcache_vllm.py).

The LMCache server cannot tie a model *name* to bytes, so the engine derives the identity from
what it loads: a hub id at another ``--revision`` is another identity even though the name is
the same (the server used to resolve the name to the hub's main snapshot on its own host, so an
engine serving revision B filled revision A's namespace). Real files and a real Hugging Face
cache layout resolved by huggingface_hub; the vLLM config is the attribute subset the connector
reads (test_connector_unit.fake_configs), since building the connector itself needs a running
LMCache server (scripts/lmcache_two_hosts.py runs that end to end).
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("lmcache", reason="lmcache not installed (scripts/setup-peers.sh)")
pytest.importorskip("vllm")

from cxlkv.integrations.lmcache_identity import weights_of_model_field
from cxlkv.integrations.lmcache_vllm import engine_identity
from test_connector_unit import fake_configs
from test_identity_cache import make_model

REV_A, REV_B = "a" * 40, "b" * 40


def _token(model: str, revision: str | None = None, **changes) -> str:
    vc, _ = fake_configs("/unused", model)
    vc.model_config.revision = revision
    for dotted, value in changes.items():
        obj_name, attr = dotted.split("__")
        setattr(getattr(vc, obj_name), attr, value)
    token, _source = engine_identity(vc, model)
    weights_of_model_field(token)  # the server accepts it
    return token


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """org/tiny in a Hugging Face cache: main -> revision A; revision B another fine-tune."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for rev, seed in ((REV_A, 1), (REV_B, 2)):
        plain = make_model(tmp_path / f"plain-{rev[0]}", seed=seed)
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for f in sorted(plain.iterdir()):
            blob = repo / "blobs" / f"{rev[0]}-{f.name}-blob"
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV_A)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return tmp_path


def test_hub_id_at_a_revision_is_that_revisions_weights(hub):
    a, b = str(hub / "plain-a"), str(hub / "plain-b")
    assert _token("org/tiny", REV_B) == _token(b)
    assert _token("org/tiny", REV_B) != _token("org/tiny")
    assert _token("org/tiny") == _token("org/tiny", "main") == _token(a)


def test_same_weights_share_and_kv_config_separates(tmp_path):
    model = str(make_model(tmp_path / "m", seed=1))
    copy = str(shutil.copytree(model, tmp_path / "copy"))
    base = _token(model)
    assert _token(copy) == base
    assert _token(model, cache_config__cache_dtype="fp8_e4m3") != base
    assert _token(model, model_config__hf_overrides={"rope_theta": 1.0}) != base
    assert _token(model, model_config__quantization="fp8") != base
    assert _token(str(make_model(tmp_path / "other", seed=2))) != base


def test_weights_that_cannot_be_read_refuse_to_start():
    from cxlkv.integrations.external_identity import UnresolvableModelError

    with pytest.raises(UnresolvableModelError, match="no-such-org/model"):
        _token("no-such-org/model")
