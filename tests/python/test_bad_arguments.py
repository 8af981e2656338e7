"""Arguments that used to be silently ignored or to end in a traceback (issue 14 items 1, 2, 7),
through the API and the real `cxlkv` executable on real pool files: each is one line and exit 2
(ValueError from the API), and nothing is created or destroyed for it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import cxlkv
from conftest import MiB

CXLKV = shutil.which("cxlkv", path=os.path.dirname(sys.executable))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CXLKV, *args], capture_output=True, text=True, timeout=120)


def _one_line_error(r: subprocess.CompletedProcess, text: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and text in err[-1], r.stderr


# -- stripe size (item 1) ------------------------------------------------------------------------


@pytest.mark.parametrize("stripe", [0, "0", "2MiB"])
def test_api_stripe_size_on_one_file_or_zero_is_a_value_error(pool_path, stripe):
    with pytest.raises(ValueError, match="stripe size"):
        cxlkv.Pool.create(pool_path, 16 * MiB, stripe_size=stripe)
    assert not os.path.exists(pool_path)


def test_api_stripe_size_zero_on_devices_is_a_value_error(pool_path):
    paths = [pool_path + ".a", pool_path + ".b"]
    try:
        with pytest.raises(ValueError, match="0 is not a size"):
            cxlkv.Pool.create(paths, 16 * MiB, stripe_size=0)
        with cxlkv.Pool.create(paths, 16 * MiB) as p:  # None: the default stripe
            assert p.info()["stripe_bytes"] == cxlkv.create_options()["stripe_bytes"]["default"]
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_cli_stripe_size_on_one_file_refused_and_force_destroys_nothing(pool_path):
    r = _cli("pool", "create", pool_path, "--size", "16MiB", "--stripe-size", "2MiB")
    _one_line_error(r, "--stripe-size is only meaningful for a pool of several devices")
    assert not os.path.exists(pool_path)
    cxlkv.Pool.create(pool_path, 16 * MiB).close()
    r = _cli("pool", "create", pool_path, "--size", "16MiB", "--stripe-size", "2MiB", "--force")
    _one_line_error(r, "--stripe-size is only meaningful")
    cxlkv.Pool.open(pool_path).close()  # the existing pool is still there
    _one_line_error(
        _cli("pool", "create", pool_path, "--size", "16MiB", "--stripe-size", "0"), "0 is not a stripe size"
    )


# -- node ids (item 2) ---------------------------------------------------------------------------


@pytest.mark.parametrize("node", [2**32, 2**64, 2**100, 0, -1, 65])
def test_api_node_id_out_of_range_is_a_value_error(pool_path, node):
    with cxlkv.Pool.create(pool_path, 16 * MiB, max_nodes=64) as pool:
        with pytest.raises(ValueError, match=r"out of range 1\.\.64"):
            pool.reap_node(node)
        with pytest.raises(ValueError, match=r"out of range 1\.\.64"):
            pool._core.ping(node)


@pytest.mark.parametrize("command", ["reap", "ping"])
@pytest.mark.parametrize("node, text", [(str(2**32), "out of range 1..254"), ("100", "out of range 1..64")])
def test_cli_node_id_out_of_range_exits_2(pool_path, command, node, text):
    cxlkv.Pool.create(pool_path, 16 * MiB, max_nodes=64).close()
    _one_line_error(_cli("pool", command, node, pool_path), text)


# -- lock hosts and backends (item 7) ------------------------------------------------------------


def test_cli_lock_hosts_with_multihost(pool_path):
    r = _cli(
        "pool",
        "create",
        pool_path,
        "--size",
        "16MiB",
        "--backend",
        "multihost",
        "--lock-hosts",
        "4",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backend"] == "multihost" and info["lock_hosts"] == 4


@pytest.mark.parametrize("backend", ["coherent", "flush"])
def test_lock_hosts_without_multihost_refused(pool_path, backend):
    _one_line_error(
        _cli("pool", "create", pool_path, "--size", "16MiB", "--backend", backend, "--lock-hosts", "4"),
        "--lock-hosts only goes with --backend multihost",
    )
    with pytest.raises(ValueError, match="only meaningful for the multihost backend"):
        cxlkv.Pool.create(pool_path, 16 * MiB, backend=backend, lock_hosts=4)
    with pytest.raises(ValueError, match="not a host count"):
        cxlkv.Pool.create(pool_path, 16 * MiB, backend="multihost", lock_hosts=0)
    assert not os.path.exists(pool_path)
