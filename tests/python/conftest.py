"""Fixtures of the cxlkv Python test suite.

Pools live in /dev/shm (real shared-memory files, as in production), each under a unique name
that is removed after the test, including leftovers such as ``<path>.init-*`` temporaries.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cxlkv_testutil as tu

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"

# coherent (default) | flush (the non-coherent discipline, one host) | multihost (no CAS across
# hosts: the bakery lock; every handle and process of this host shares its host slot).
TEST_BACKEND = os.environ.get("CXLKV_TEST_BACKEND", "coherent")

MiB = 1 << 20
KiB = 1 << 10


def _remove(path: str) -> None:
    for p in [path] + glob.glob(path + ".*"):
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError:
            pass


@pytest.fixture
def pool_path():
    """A unique, not yet existing pool path under /dev/shm; removed afterwards."""
    path = os.path.join(SHM_DIR, f"cxlkv-test-{uuid.uuid4().hex}")
    yield path
    _remove(path)


@pytest.fixture
def model_dir(tmp_path):
    """A model directory of random bytes (``cxlkv_testutil.make_model``): what the connector's
    identity reads, for tests that build connectors without loading a model."""
    return tu.make_model(tmp_path / "model")


@pytest.fixture
def scratch_dir(tmp_path):
    return tmp_path


@pytest.fixture
def make_pool(pool_path):
    """Factory: ``make_pool(size=64 MiB, chunk_size=1 MiB, **create_kwargs)`` creates a pool at
    ``pool_path`` (or at ``path=``) and closes every pool it made after the test."""
    import cxlkv

    made = []
    extra_paths = []

    def _make(size=64 * MiB, chunk_size=1 * MiB, path=None, **kwargs):
        # CXLKV_TEST_BACKEND=flush|multihost reruns tests under another backend (scripts/test.sh).
        kwargs.setdefault("backend", TEST_BACKEND)
        p = path or pool_path
        if path is not None and path != pool_path:
            extra_paths.append(path)
        pool = cxlkv.Pool.create(p, size, chunk_size=chunk_size, **kwargs)
        made.append(pool)
        return pool

    yield _make
    for pool in made:
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - a test may have left it closed or broken on purpose
            pass
    for p in extra_paths:
        _remove(p)


def small_layout(block_bytes=4 * KiB, model_id="test/small-model", **kw):
    """A KVLayout whose block size is overridden to ``block_bytes``."""
    import cxlkv

    args = dict(
        model_id=model_id, dtype="bf16", num_layers=2, num_kv_heads=2, head_size=16, tokens_per_block=4
    )
    args.update(kw)
    return cxlkv.KVLayout(block_bytes=block_bytes, **args)


@pytest.fixture
def small_ns(make_pool):
    """(pool, namespace) on a 64 MiB pool with 1 MiB chunks and 4 KiB blocks."""
    pool = make_pool()
    return pool, pool.namespace(small_layout())


@pytest.fixture
def key():
    return tu.make_key


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still run by the CI command)")


def pytest_collection_modifyitems(config, items):
    """Every Hypothesis test of the run draws from one seed, ``$CXLKV_TEST_SEED`` when set (to
    replay a failure), printed at the end of the run (the other random tests print theirs via
    tu.random_test_seed)."""
    import hypothesis

    tests = [it.obj for it in items if getattr(getattr(it, "obj", None), "is_hypothesis_test", False)]
    if not tests:
        return
    text = os.environ.get(tu.SEED_ENV, "").strip()
    seed = int(text, 0) if text else int.from_bytes(os.urandom(4), "little")
    for fn in tests:
        hypothesis.seed(seed)(fn)
    config.stash[_HYPOTHESIS_SEED] = seed


_HYPOTHESIS_SEED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    seed = config.stash.get(_HYPOTHESIS_SEED, None)
    if seed is not None:
        terminalreporter.write_line(f"hypothesis tests: seed {seed} (replay with {tu.SEED_ENV}={seed})")
