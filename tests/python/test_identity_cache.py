"""The identity cache is a hint nobody can forge (issue 14 item 5, docs/IDENTITY.md): each test
is built from the reproduction in the issue, on real files; a forged or stale cache must never
give one model another model's digest, and a corrupt one must be recomputed, never raised."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cxlkv.integrations import identity as ident
from cxlkv.integrations import identity_cache as icache
from cxlkv_testutil import write_safetensors

OTHER_UID = 54321  # a user that owns nothing here
NOBODY = 65534


def make_model(d: Path, seed: int, size: int = 200_000) -> Path:
    """A same-shape checkpoint for every seed (same file sizes), different bytes."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(d / "model.safetensors", {"a.weight": rng.bytes(size), "norm": rng.bytes(64)})
    (d / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "hidden_size": 8}))
    return d


def fresh_digest(d: Path) -> str:
    """The digest computed from the bytes, with no cache anywhere."""
    with tempfile.TemporaryDirectory() as t:
        copy = Path(t) / "m"
        copy.mkdir()
        for f in d.iterdir():
            if f.name != ident.CACHE_FILE:
                (copy / f.name).write_bytes(f.read_bytes())
        return ident.weights_digest(copy).digest


def forge(victim: Path, donor: Path) -> dict:
    """The cache an attacker would write into ``victim``: its files' real stamps, each with the
    digest of ``donor``'s file of the same name, so that victim's digest becomes donor's."""
    ident.weights_digest(donor)
    donor_files = json.loads((donor / ident.CACHE_FILE).read_text())["files"]
    files = {
        rel: {"stamp": icache.stamp((victim / rel).stat()), "digest": donor_files[rel]["digest"]}
        for rel in donor_files
    }
    return {"version": ident.IDENTITY_VERSION, "root": str(victim.resolve()), "files": files}


def plant(victim: Path, cache: dict, uid: int, mode: int) -> None:
    p = victim / ident.CACHE_FILE
    p.unlink(missing_ok=True)
    p.write_text(json.dumps(cache))
    os.chown(p, uid, -1)
    os.chmod(p, mode)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating files owned by another user needs root")


@needs_root
def test_forged_cache_owned_by_another_user_is_ignored(tmp_path):
    a, b = make_model(tmp_path / "a", 1), make_model(tmp_path / "b", 2)
    digest_a, digest_b = ident.weights_digest(a).digest, fresh_digest(b)
    assert digest_a != digest_b
    # The forged cache does work when its owner is trusted (the current user): so the test can fail.
    plant(b, forge(b, a), os.geteuid(), 0o644)
    assert ident.weights_digest(b).digest == digest_a
    # Written by someone who owns neither the process nor the model files: ignored, recomputed.
    plant(b, forge(b, a), OTHER_UID, 0o644)
    assert ident.weights_digest(b).digest == digest_b


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_forged_cache_writable_by_others_is_ignored(tmp_path, mode):
    a, b = make_model(tmp_path / "a", 1), make_model(tmp_path / "b", 2)
    digest_a, digest_b = ident.weights_digest(a).digest, fresh_digest(b)
    plant(b, forge(b, a), os.geteuid(), mode)
    assert ident.weights_digest(b).digest == digest_b != digest_a


@needs_root
def test_cache_of_the_model_files_owner_is_trusted_a_third_party_is_not(tmp_path):
    a, b = make_model(tmp_path / "a", 1), make_model(tmp_path / "b", 2)
    digest_a, digest_b = ident.weights_digest(a).digest, fresh_digest(b)
    for f in b.iterdir():
        os.chown(f, OTHER_UID, -1)  # chown moves ctime: forge() reads the stamps afterwards
    plant(b, forge(b, a), OTHER_UID, 0o644)
    assert ident.weights_digest(b).digest == digest_a  # the weights' owner could rewrite them anyway
    plant(b, forge(b, a), OTHER_UID + 1, 0o644)
    assert ident.weights_digest(b).digest == digest_b


def test_cache_symlinked_or_hard_linked_is_ignored(tmp_path):
    a, b = make_model(tmp_path / "a", 1), make_model(tmp_path / "b", 2)
    digest_b = fresh_digest(b)
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(forge(b, a)))
    os.chmod(forged, 0o644)
    (b / ident.CACHE_FILE).symlink_to(forged)
    assert ident.weights_digest(b).digest == digest_b
    (b / ident.CACHE_FILE).unlink()
    forged.write_text(json.dumps(forge(b, a)))
    os.link(forged, b / ident.CACHE_FILE)
    assert ident.weights_digest(b).digest == digest_b


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "null",
        '"files"',
        "{not json",
        "BINARY",
        '{"version": "cxlkv/identity/v1", "files": []}',
        "NONHEX",  # a well-formed cache whose digest is not hex (built below)
        "SHORTHEX",
        "BADSTAMP",
    ],
)
def test_corrupt_cache_is_recomputed_never_raised(tmp_path, content):
    a = make_model(tmp_path / "a", 1)
    ref = fresh_digest(a)
    cache = a / ident.CACHE_FILE
    ident.weights_digest(a)
    good = json.loads(cache.read_text())
    sound = json.loads(cache.read_text())["files"]
    if content in ("NONHEX", "SHORTHEX", "BADSTAMP"):
        entry = good["files"]["model.safetensors"]
        if content == "NONHEX":
            entry["digest"] = "zz" * 32
        elif content == "SHORTHEX":
            entry["digest"] = "ab"
        else:
            entry["stamp"] = {"size": 1}
        content = json.dumps(good)
    cache.write_bytes(b"\xff\xfe\x00binary" if content == "BINARY" else content.encode())
    os.chmod(cache, 0o644)
    assert ident.weights_digest(a).digest == ref
    assert json.loads(cache.read_text())["files"] == sound  # rewritten
    assert ident.weights_digest(a).digest == ref  # and the rewritten cache is sound


def test_cache_is_written_mode_0644_whatever_the_umask(tmp_path):
    a = make_model(tmp_path / "a", 1)
    old = os.umask(0o002)
    try:
        ident.weights_digest(a)
    finally:
        os.umask(old)
    assert (a / ident.CACHE_FILE).stat().st_mode & 0o777 == 0o644


def test_normalised_mtime_rewrite_in_place_is_noticed(tmp_path):
    """A file rewritten with its old size and mtime restored (what normalising tools produce):
    the ctime moved, so the cache misses."""
    a = make_model(tmp_path / "a", 1)
    os.utime(a / "model.safetensors", ns=(1, 1))
    first = ident.weights_digest(a).digest
    make_model(a, 2)
    os.utime(a / "model.safetensors", ns=(1, 1))
    assert ident.weights_digest(a).digest == fresh_digest(a) != first


def _digest_read_only(path: Path, home: Path) -> str:
    """weights_digest(path) by a user who cannot write the model directories, with HOME=home:
    root may write every directory, so root forks a child that becomes ``nobody``; another user
    computes it in-process (the directories are made read-only by the caller)."""
    if os.geteuid() != 0:
        old = os.environ.get("HOME")
        os.environ["HOME"] = str(home)
        try:
            return ident.weights_digest(path).digest
        finally:
            os.environ["HOME"] = old or ""
    uid = NOBODY
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.environ["HOME"] = str(home)
            os.write(w, ident.weights_digest(path).digest.encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, f"error: {e!r}".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


def test_read_only_symlink_repointed_to_same_shape_version_with_normalised_mtimes(tmp_path):
    """/models/current -> v1, then -> v2 (same shapes and sizes, mtimes normalised as in a Nix
    store): the cache in the home directory must not give v2 the digest of v1."""
    base = Path(tempfile.mkdtemp(prefix="cxlkv-identity-"))  # not under pytest's 0700 tmp_path
    try:
        os.chmod(base, 0o755)
        v1, v2 = make_model(base / "v1", 1), make_model(base / "v2", 2)
        for f in (*v1.iterdir(), *v2.iterdir()):
            os.utime(f, ns=(1_000_000_000, 1_000_000_000))
        assert [f.stat().st_mtime_ns for f in sorted(v1.iterdir())] == [
            f.stat().st_mtime_ns for f in sorted(v2.iterdir())
        ]
        home = base / "home"
        home.mkdir()
        if os.geteuid() == 0:
            os.chown(home, NOBODY, NOBODY)
        for d in (v1, v2):
            os.chmod(d, 0o555)  # read-only for its owner too: the cache goes to HOME
        current = base / "current"
        current.symlink_to(v1)
        d1 = _digest_read_only(current, home)
        assert list((home / ".cache" / "cxlkv" / "identity").glob("*.json"))  # the home cache was used
        assert not (v1 / ident.CACHE_FILE).exists()
        current.unlink()
        current.symlink_to(v2)
        d2 = _digest_read_only(current, home)
        assert d2 != d1
        assert d2 == fresh_digest(v2) and d1 == fresh_digest(v1)
        assert _digest_read_only(current, home) == d2  # and the cache still answers
    finally:
        for d in (base / "v1", base / "v2"):
            if d.exists():
                os.chmod(d, 0o755)
        shutil.rmtree(base)
