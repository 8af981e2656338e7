"""``cxlkv sim``: re-run the multi-host proof (issue 9) on this machine.

The C++ emulator (``src/sim``, installed beside the extension module as ``cxlkv-sim``) runs N
simulated hosts, each a real :class:`Pool` over its own non-coherent cache of one shared region,
with random evictions, host crashes and pauses past the lease, and row healing on each host's
chores thread, and counts every violation (lost update, dirty line dropped, lock overlap, a
holder's ticket lost from memory, wrong or stale payload accepted, ``pool check`` errors).

Exit status: 0 when the run says what it should (no violation without ``--break``; at least one
with ``--break``, i.e. the negative control was caught), 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from cxlkv.errors import CommandError

BREAKS = ("flush", "invalidate", "lock", "heal")
FAULTS = ("insert.claimed", "insert.copied", "evict.claimed", "alloc.claimed", "alloc.carving", "lock.held")


def sim_binary() -> Path:
    """The ``cxlkv-sim`` executable: $CXLKV_SIM_BIN, else the one installed beside ``_core``."""
    env = os.environ.get("CXLKV_SIM_BIN")
    if env:
        return Path(env)
    from cxlkv import _core

    return Path(_core.__file__).resolve().parent / "cxlkv-sim"


def run(
    hosts: int = 3,
    seconds: float = 4.0,
    seed: int = 1,
    brk: str | None = None,
    lease_ms: int = 500,
    backend: str = "multihost",
    crashes: bool = True,
    pauses: bool = True,
    fault: str | None = None,
) -> dict[str, Any]:
    """Runs one simulation and returns its result (ops, verified_reads, violations, ...)."""
    exe = sim_binary()
    if not exe.exists():
        raise CommandError(f"{exe}: the emulator was not built (reinstall cxlkv, or set CXLKV_SIM_BIN)")
    cmd = [
        str(exe),
        "--hosts",
        str(hosts),
        "--seconds",
        str(seconds),
        "--seed",
        str(seed),
        "--lease-ms",
        str(lease_ms),
        "--backend",
        backend,
    ]
    if brk:
        cmd += ["--break", brk]
    if not crashes:
        cmd.append("--no-crashes")
    if not pauses:
        cmd.append("--no-pauses")
    if fault:
        cmd += ["--fault", fault]
    # cxlkv-sim ends by `seconds` (its whole run); the margin is for a loaded machine only.
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 2 + 60)
    if out.returncode == 2:
        raise CommandError("sim: " + out.stderr.strip().removeprefix("cxlkv-sim: "))
    if out.returncode != 0:
        raise CommandError(f"sim: cxlkv-sim failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)
