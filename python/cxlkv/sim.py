"""``cxlkv sim``: re-run the multi-host proof (issue 9) on this machine.

The C++ emulator (``src/sim``, installed beside the extension module as ``cxlkv-sim``) runs N
simulated hosts, each a real :class:`Pool` over its own non-coherent cache of one shared region,
with random evictions, host crashes and pauses past the lease, and counts every violation (lost
update, dirty line dropped, lock overlap, wrong or stale payload accepted, ``pool check`` errors).

Exit status: 0 when the run says what it should (no violation without ``--break``; at least one
with ``--break``, i.e. the negative control was caught), 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BREAKS = ("flush", "invalidate", "lock")
FAULTS = ("insert.claimed", "insert.copied", "evict.claimed", "alloc.claimed", "alloc.carving", "lock.held")


def sim_binary() -> Path:
    """The ``cxlkv-sim`` executable: $CXLKV_SIM_BIN, else the one installed beside ``_core``."""
    env = os.environ.get("CXLKV_SIM_BIN")
    if env:
        return Path(env)
    from cxlkv import _core

    return Path(_core.__file__).resolve().parent / "cxlkv-sim"


def run(hosts: int = 3, seconds: float = 2.0, seed: int = 1, brk: str | None = None,
        lease_ms: int = 500, backend: str = "multihost", crashes: bool = True,
        pauses: bool = True, fault: str | None = None) -> dict[str, Any]:
    """Runs one simulation and returns its result (ops, verified_reads, violations, ...)."""
    exe = sim_binary()
    if not exe.exists():
        raise FileNotFoundError(f"{exe}: the emulator was not built (reinstall cxlkv, or set CXLKV_SIM_BIN)")
    cmd = [str(exe), "--hosts", str(hosts), "--seconds", str(seconds), "--seed", str(seed),
           "--lease-ms", str(lease_ms), "--backend", backend]
    if brk:
        cmd += ["--break", brk]
    if not crashes:
        cmd.append("--no-crashes")
    if not pauses:
        cmd.append("--no-pauses")
    if fault:
        cmd += ["--fault", fault]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 120)
    if out.returncode == 2:
        raise ValueError(out.stderr.strip().removeprefix("cxlkv-sim: "))
    if out.returncode != 0:
        raise RuntimeError(f"cxlkv-sim failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


def add_parser(sub: Any) -> None:
    """Registers ``cxlkv sim`` on the CLI's subcommand table."""
    s = sub.add_parser("sim", help="multi-host proof: simulated hosts without coherence, checked")
    s.add_argument("--hosts", type=int, default=3, help="simulated hosts (default 3, at most 59)")
    s.add_argument("--seconds", type=float, default=2.0, help="run time (default 2)")
    s.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    s.add_argument("--break", dest="brk", choices=BREAKS, default=None,
                   help="negative control: flushes as no-ops, invalidations skipped, or the "
                        "lock's ticket write-backs dropped; the run must then find violations")
    s.add_argument("--backend", choices=("multihost", "flush"), default="multihost",
                   help="pool backend under test (flush: the one-host discipline, not multi-host safe)")
    s.add_argument("--lease-ms", type=int, default=500, help="heartbeat lease (default 500)")
    s.add_argument("--no-crashes", action="store_true", help="no random host crashes")
    s.add_argument("--no-pauses", action="store_true", help="no pauses past the lease")
    s.add_argument("--fault", choices=FAULTS, default=None,
                   help="crash hosts at this named fault point instead of at random calls")
    s.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    r = run(args.hosts, args.seconds, args.seed, args.brk, args.lease_ms, args.backend,
            not args.no_crashes, not args.no_pauses, args.fault)
    expect_clean = args.brk is None and args.backend == "multihost"
    ok = (r["violations"] == 0) if expect_clean else (r["violations"] > 0)
    if args.json:
        print(json.dumps(r))
    else:
        kinds = ", ".join(f"{k} {v}" for k, v in r["violation_kinds"].items() if v) or "none"
        print(f"{r['hosts']} hosts, {r['seconds']} s, seed {r['seed']}, backend {r['backend']}, "
              f"break {r['break'] or '-'}")
        print(f"ops {r['ops']}  verified reads {r['verified_reads']}  crashes {r['crashes']}  "
              f"pauses {r['pauses']}  fenced {r['fenced']}  lock skips {r['lock_skips']}")
        print(f"violations {r['violations']} ({kinds})")
        for n in r.get("notes", [])[:6]:
            print(f"  {n}")
        if not ok:
            what = "violations found" if expect_clean else "the negative control was NOT caught"
            print(f"FAILED: {what}", file=sys.stderr)
    return 0 if ok else 1
