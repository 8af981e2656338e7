"""One error type per condition: every condition the core reports has its own class, bound to
Python one to one, and callers (and these tests) branch on the type, never on the message."""

from __future__ import annotations

import os
import re
import struct
import time

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import small_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NS_LOCK_OFF = 4096 + 64  # SharedWords.ns_lock


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_every_core_error_type_is_bound_to_its_own_python_class():
    """errors.h's types each have a catch in the binding's translator and a Python class in
    cxlkv.errors (a new core type cannot fall through to the base class by omission)."""
    types = re.findall(r"^struct (\w+) : Error\b", _read("src/core/errors.h"), re.M)
    assert len(types) >= 17, types
    bindings = _read("src/python/bindings.cpp")
    for t in types:
        assert f"catch (const {t}& e)" in bindings, f"{t} is not translated (src/python/bindings.cpp)"
    py = {t: getattr(cxlkv.errors, t, None) or getattr(cxlkv.errors, "Pool" + t, None) for t in types}
    py.pop("OsError"), py.pop("ArgumentError")  # OSError by errno, ValueError
    missing = [t for t, c in py.items() if c is None]
    assert not missing, f"core error types without a class in cxlkv.errors: {missing}"
    classes = list(py.values())
    assert len(set(classes)) == len(classes)
    assert all(issubclass(c, cxlkv.CxlkvError) for c in classes)
    assert all(name in cxlkv.errors.__all__ for name in (c.__name__ for c in classes))


def test_core_throws_no_bare_base_error():
    """A bare `throw Error(` is for internal bugs only (message "internal: ..."): every condition a
    caller can meet has its own type."""
    bare = []
    for d, _, files in os.walk(os.path.join(ROOT, "src/core")):
        for f in files:
            text = open(os.path.join(d, f)).read()
            bare += [
                f"{f}: {m.group(0)[:60]}"
                for m in re.finditer(r"throw Error\(\s*\"?([^;]*)", text)
                if not m.group(1).startswith("internal:")
            ]
    assert not bare, bare


def test_closed_pool_raises_closed_error(pool_path):
    p = cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB")
    core = p._core
    p.close()
    for call in (core.info, core.file_replaced, lambda: core.open_namespace("x", small_layout())):
        with pytest.raises(cxlkv.ClosedError) as ei:
            call()
        assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, cxlkv.CxlkvError)
    # one class for the pool's and the Python objects' "used after close()"
    assert cxlkv.errors.ClosedError is cxlkv.ClosedError is cxlkv._core.ClosedError


@pytest.mark.parametrize("devices", [1, 2])
def test_destroy_while_attached_raises_pool_in_use(pool_path, devices):
    """One refusal for plain and striped pools: the type, and the attached processes named."""
    paths = [pool_path] if devices == 1 else [f"{pool_path}.dev{k}" for k in range(devices)]
    spec = ",".join(paths)
    extra = {} if devices == 1 else {"stripe_size": "256KiB"}
    with cxlkv.Pool.create(paths if devices > 1 else pool_path, "16MiB", chunk_size="1MiB", **extra):
        with pytest.raises(cxlkv.PoolInUseError) as ei:
            cxlkv.Pool.destroy(spec)
        assert f"(pid {os.getpid()})" in str(ei.value)  # who to stop: detail, not the condition
    assert all(os.path.exists(p) for p in paths)
    cxlkv.Pool.destroy(spec)
    assert not any(os.path.exists(p) for p in paths)


def test_read_only_and_observer_writes_raise_read_only_error(pool_path):
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB").close()
    with cxlkv.Pool.open(pool_path, read_only=True) as p:
        with pytest.raises(cxlkv.ReadOnlyError):
            p._core.open_namespace("x", small_layout())
        with pytest.raises(cxlkv.ReadOnlyError):
            p._core.transfer_view()
    with cxlkv.Pool.open(pool_path, attach=False) as obs, pytest.raises(cxlkv.ReadOnlyError):
        obs.namespace(small_layout())


def test_pool_used_in_a_forked_child_raises_forked_error(pool_path):
    with cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB") as p:
        kid = os.fork()
        if kid == 0:  # the child: exit 0 only if the inherited attachment says ForkedError
            code = 3
            try:
                p.info()
            except cxlkv.ForkedError:
                code = 0
            finally:
                os._exit(code)  # never back into pytest, whatever was raised
        _, status = os.waitpid(kid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert p.info()["path"] == pool_path  # the parent's attachment is unaffected


def test_namespace_table_lock_held_by_a_live_node_raises_lock_timeout(pool_path):
    """A live node that keeps the namespace-table lock (stalled, or a word forged to name it) makes
    a creation fail with LockTimeoutError after its bound (3 leases); nothing is created."""
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", lease_ms=200).close()
    with cxlkv.Pool.open(pool_path) as holder, cxlkv.Pool.open(pool_path) as p:
        tu.patch_file(pool_path, NS_LOCK_OFF, struct.pack("<Q", holder.node_id))
        t0 = time.monotonic()
        with pytest.raises(cxlkv.LockTimeoutError):
            p.namespace(small_layout())
        assert 0.6 <= time.monotonic() - t0 < 30
        assert p.namespaces() == []
        tu.patch_file(pool_path, NS_LOCK_OFF, struct.pack("<Q", 0))
        p.namespace(small_layout())
