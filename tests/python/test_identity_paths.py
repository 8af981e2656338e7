"""Which files the weights digest reads (red-team finding: ``_weight_files`` followed symlinks out
of the model directory, so a link planted in a model directory made the connector read, hash and
cache the digest of any file its user can read, or block forever on a FIFO).

The rule (docs/IDENTITY.md, "Which files"): a weight or config file may be a symlink, but its
target must be a regular file inside the model's own tree or, for a Hugging Face hub snapshot
(``<repo>/snapshots/<commit>``), inside ``<repo>/blobs``; otherwise WeightPathError. Real files,
no mocks; milliseconds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cxlkv.errors import WeightPathError
from cxlkv.integrations import identity as ident
from cxlkv.integrations.external_identity import weights_of
from test_identity_cache import make_model


def _hub_snapshot(cache: Path, plain: Path) -> Path:
    """``plain``'s files laid out as huggingface_hub does: blobs named by hash, the snapshot's
    files symlinks into them (relative, as the hub writes them)."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hub_snapshot_links_into_blobs_are_followed(tmp_path):
    plain = make_model(tmp_path / "plain", seed=1)
    snap = _hub_snapshot(tmp_path / "hub", plain)
    assert ident.weights_digest(snap).digest == ident.weights_digest(plain).digest
    assert weights_of(str(snap))[0] == weights_of(str(plain))[0]


def test_link_inside_the_model_tree_is_followed(tmp_path):
    model = make_model(tmp_path / "m", seed=1)
    (model / "shards").mkdir()
    (model / "model.safetensors").rename(model / "shards" / "w.safetensors")
    (model / "model.safetensors").symlink_to("shards/w.safetensors")
    assert ident.weights_digest(model).files == 3  # the link and its target, each by its name


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "extra.bin"])
def test_link_out_of_the_model_is_refused(tmp_path, name):
    """A planted link to a file outside (here another model's weights, standing for /etc/...)."""
    model = make_model(tmp_path / "m", seed=1)
    outside = make_model(tmp_path / "elsewhere", seed=2)
    target = outside / ("config.json" if name == "config.json" else "model.safetensors")
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(target)
    with pytest.raises(WeightPathError, match="outside"):
        ident.weights_digest(model)
    with pytest.raises(WeightPathError):
        ident.weight_files(model)
    with pytest.raises(WeightPathError):
        weights_of(str(model))


def test_hub_snapshot_link_out_of_its_repo_is_refused(tmp_path):
    plain = make_model(tmp_path / "plain", seed=1)
    snap = _hub_snapshot(tmp_path / "hub", plain)
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(tmp_path / "plain" / "config.json")  # not the repo's blobs
    with pytest.raises(WeightPathError, match="outside"):
        ident.weights_digest(snap)


def test_directory_link_out_of_the_model_is_refused(tmp_path):
    model = make_model(tmp_path / "m", seed=1)
    make_model(tmp_path / "elsewhere", seed=2)
    (model / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(WeightPathError, match="outside"):
        ident.weights_digest(model)


def test_directory_link_to_an_ancestor_is_walked_once(tmp_path):
    """``sub -> .`` used to be walked until the path length limit, hashing the weights once per
    level (another digest, and hundreds of reads)."""
    model = make_model(tmp_path / "m", seed=1)
    plain = ident.weights_digest(model)
    (model / "sub").symlink_to(".")
    looped = ident.weights_digest(model)
    assert (looped.digest, looped.files) == (plain.digest, plain.files)


def test_fifo_is_refused_not_waited_on(tmp_path):
    model = make_model(tmp_path / "m", seed=1)
    os.mkfifo(model / "model-00002.bin")
    with pytest.raises(WeightPathError, match="not a regular file"):
        ident.weights_digest(model)
