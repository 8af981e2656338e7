"""``cxlkv sim`` (issue 9): the multi-host proof from the command line, and the multihost backend
through the Python API. The emulator's own proof (many seeds, every negative control) runs in the
C++ suite (tests/cpp/test_multihost.cpp); here each CLI path runs once, as a real subprocess."""

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
# No skip: every install builds cxlkv-sim beside _core (CMakeLists.txt); a missing one is a bug.
SIM_KEYS = {"ops", "verified_reads", "violations", "crashes", "pauses", "violation_kinds"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    assert CXLKV, "the cxlkv executable is not installed"
    return subprocess.run([CXLKV, *args], capture_output=True, text=True, timeout=120)


def test_sim_clean_run_has_no_violations():
    r = _cli("sim", "--hosts", "3", "--seconds", "3", "--seed", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.keys() >= SIM_KEYS
    assert out["violations"] == 0, out
    assert out["ops"] > 0 and out["verified_reads"] > 0


def test_sim_negative_control_is_caught():
    # exit 0 means: the broken discipline WAS caught (violations > 0). Hosts are threads: a seed
    # fixes the workload, not the interleaving, so a loaded machine gets a few seeds to show it.
    for seed in ("5", "6", "7", "8"):
        r = _cli("sim", "--hosts", "3", "--seconds", "3", "--seed", seed, "--break", "invalidate", "--json")
        if r.returncode == 0:
            assert json.loads(r.stdout)["violations"] > 0
            return
        assert r.returncode == 1, r.stderr  # not caught with this seed: exit 1, one line
    pytest.fail("skipped invalidations were caught by none of 4 seeds")


def test_sim_seconds_bound_the_whole_run():
    """--seconds 4 --lease-ms 60000 used to run for minutes (the final check waits up to three leases).
    Now a lease that does not fit is refused at once, naming the shortest --seconds that fits;
    a lease that fits runs, and ends (the subprocess timeout is the assertion, not a speed)."""
    r = subprocess.run(
        [CXLKV, "sim", "--seconds", "4", "--lease-ms", "60000"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "give --seconds >= 181" in r.stderr, r.stderr
    r = subprocess.run(
        [CXLKV, "sim", "--hosts", "2", "--seconds", "4", "--lease-ms", "700", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["violations"] == 0 and out["ops"] > 0 and not out["check_incomplete"], out


def test_sim_bad_arguments_exit_2():
    r = _cli("sim", "--hosts", "0")
    assert r.returncode == 2
    assert "hosts" in r.stderr


def test_multihost_pool_put_get(pool_path, monkeypatch):
    monkeypatch.setenv("CXLKV_HOST_SLOT", "2")
    p = cxlkv.Pool.create(pool_path, 16 * MiB, backend="multihost")
    try:
        assert p.info()["backend"] == "multihost"
        assert p.info()["host_slot"] == 2
        # A second handle of this host shares its slot (tier 1 across processes and handles)...
        with cxlkv.Pool.open(pool_path) as q:
            assert q.info()["host_slot"] == 2
        # ...another host on it is refused: two coherence domains would write one row.
        monkeypatch.setenv("CXLKV_HOST_ID", "another-host")
        with pytest.raises(cxlkv.HostSlotBusyError):
            cxlkv.Pool.open(pool_path)
    finally:
        p.close()
