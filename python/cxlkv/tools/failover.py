"""``bench failover``: the cost of a host failure in a ``multihost`` pool (issue 9), measured with
real processes: the time from ``kill -9`` of a host's process to its node being reclaimed (its
pins released, its half-written entries and claimed blocks freed) by a surviving host.

Each lease value gets its own pool (``--lease-ms`` is fixed at creation). The survivor is this
process, attached as a host of its own (``CXLKV_HOST_ID``, host slot 0). Per trial a victim process
attaches as another host (host slot 1), stores and pins a few blocks, reports ready and sleeps;
the survivor watches it for a random part of a lease (so the kill lands at a random phase of the
victim's heartbeat), SIGKILLs it and polls ``reap_dead_nodes`` every millisecond until the
victim's slot is free. Then it checks that the victim's pins are gone (a pinned block can be
deleted) and that the pool checks clean; a failure of either is exit 1.

Expectation from the protocol (docs/ARCHITECTURE.md §3, §11): a victim's last beat is at most
``lease/4`` old when it dies and a judge needs a whole lease of silence from when it first saw that
beat, so reclaimed_ms / lease_ms lies in about [0.75, 1] plus the polling and reclaim work.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import cxlkv
from cxlkv.errors import CommandError, ExitCode
from cxlkv.testing.layouts import opaque_layout

from ._common import PERCENTILE_METHOD, block_key, machine, percentile, progress

LAYOUT = opaque_layout("bench-failover")
PINNED_BLOCKS = 8
POOL_BYTES = 16 << 20
POLL_S = 0.001
READY_TIMEOUT_S = 60.0


class FailoverCheckFailed(CommandError):
    """The victim's pins or blocks were not freed, or the pool did not check clean: exit 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=ExitCode.CHECK_FAILED)


@contextlib.contextmanager
def _as_host(host_id: str, slot: int) -> Iterator[None]:
    """Attachments made inside act as host `host_id` on lock row `slot` (read by the core at
    attach; the environment is restored after)."""
    saved = {k: os.environ.get(k) for k in ("CXLKV_HOST_ID", "CXLKV_HOST_SLOT")}
    os.environ.update(CXLKV_HOST_ID=host_id, CXLKV_HOST_SLOT=str(slot))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _key(i: int) -> bytes:
    return block_key("failover", i)


def victim(pool_path: str) -> int:
    """The victim's body (``python -m cxlkv.tools.failover victim POOL``): attach, store and pin
    PINNED_BLOCKS blocks, print ``ready NODE``, sleep until killed."""
    with cxlkv.Pool.open(pool_path) as pool:
        ns = pool.namespace(cxlkv.KVLayout(**LAYOUT))
        keys = [_key(i) for i in range(PINNED_BLOCKS)]
        for k in keys:
            ns.put(k, k * 32)
        lease = ns.acquire(keys)
        print(f"ready {pool.node_id} {len(lease)}", flush=True)
        while True:
            time.sleep(3600)


def _one_trial(
    pool: cxlkv.Pool, ns: Any, pool_path: str, lease_ms: int, trial: int, rng: random.Random
) -> float:
    env = dict(os.environ, CXLKV_HOST_ID=f"failover-victim-{lease_ms}-{trial}", CXLKV_HOST_SLOT="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "cxlkv.tools.failover", "victim", pool_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline().split() if p.stdout else []
        if len(line) != 3 or line[0] != "ready":
            p.kill()
            raise CommandError(f"bench failover: the victim did not start: {p.stderr.read()[-2000:]}")
        node, pinned = int(line[1]), int(line[2])
        if pinned != PINNED_BLOCKS:
            raise CommandError(f"bench failover: the victim pinned {pinned} of {PINNED_BLOCKS} blocks")
        # The survivor watches the victim beat for a while (a judge needs history), then the kill
        # lands at a random phase of the victim's heartbeat (every lease/4).
        watch_until = time.monotonic() + lease_ms / 1000 * rng.uniform(0.5, 1.0)
        while time.monotonic() < watch_until:
            pool.reap_dead_nodes()
            time.sleep(POLL_S)
        if ns.delete(_key(0)):
            raise FailoverCheckFailed("a block pinned by a live host was deleted")
        t0 = time.monotonic_ns()
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20 * lease_ms / 1000
        while True:
            pool.reap_dead_nodes()
            if not any(n["node"] == node and n["state"] != "free" for n in pool.nodes()):
                break
            if time.monotonic() > deadline:
                raise FailoverCheckFailed(f"node {node} not reclaimed within 20 leases")
            time.sleep(POLL_S)
        reclaimed_ms = (time.monotonic_ns() - t0) / 1e6
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    # Its pins are gone (the pinned block can be deleted), and nothing it held is stuck or leaked.
    if not ns.delete(_key(0)):
        raise FailoverCheckFailed("the dead host's pin survived its reclaim")
    report = pool.check()
    bad = [f"{k}={report[k]}" for k in ("stuck_entries", "orphan_pins") if report.get(k)] + [
        f"leaked={report['blocks']['leaked']}"
    ] * bool(report["blocks"]["leaked"])
    if not report["ok"] or bad:
        raise FailoverCheckFailed(f"pool check after the reclaim: {report['errors'] + bad}")
    return reclaimed_ms


def _summary(lease_ms: int, samples: list[float]) -> dict[str, Any]:
    p50, p99, mx = percentile(samples, 50), percentile(samples, 99), max(samples)
    return {
        "lease_ms": lease_ms,
        "trials": len(samples),
        "reclaimed_p50_ms": round(p50, 2),
        "reclaimed_p99_ms": round(p99, 2),
        "reclaimed_max_ms": round(mx, 2),
        "reclaimed_min_ms": round(min(samples), 2),
        "p50_over_lease": round(p50 / lease_ms, 3),
        "p99_over_lease": round(p99 / lease_ms, 3),
        "max_over_lease": round(mx / lease_ms, 3),
        "samples_ms": [round(s, 2) for s in samples],
    }


def bench_failover(
    leases_ms: list[int],
    trials: int,
    pool_dir: str = "/dev/shm",
    seed: int | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    say = progress(quiet)
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    results = []
    tmp = tempfile.mkdtemp(prefix="cxlkv-bench-failover-", dir=pool_dir)
    try:
        for lease_ms in leases_ms:
            path = os.path.join(tmp, f"pool-{lease_ms}")
            cxlkv.Pool.create(path, POOL_BYTES, backend="multihost", lease_ms=lease_ms).close()
            samples = []
            try:
                with _as_host(f"failover-survivor-{lease_ms}", 0):
                    pool = cxlkv.Pool.open(path)
                with pool:
                    ns = pool.namespace(cxlkv.KVLayout(**LAYOUT))
                    for t in range(trials):
                        samples.append(_one_trial(pool, ns, path, lease_ms, t, rng))
                        say(
                            f"lease {lease_ms} ms: trial {t + 1}/{trials}: reclaimed after {samples[-1]:.1f} ms"
                        )
            finally:
                cxlkv.Pool.destroy(path, ignore_attached=True)
            results.append(_summary(lease_ms, samples))
    finally:
        for name in os.listdir(tmp):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    return {
        "bench": "failover",
        "backend": "multihost",
        "seed": seed,
        "pinned_blocks": PINNED_BLOCKS,
        "poll_ms": POLL_S * 1000,
        "percentile_method": PERCENTILE_METHOD,
        "leases": results,
        "machine": machine(),
        "notes": "time from SIGKILL of a host's process to its node reclaimed (pins and blocks freed) "
        "by a surviving host polling every poll_ms; expected ratio to the lease: about 0.75..1 plus "
        "polling and reclaim work",
    }


def print_result(console: Any, result: dict[str, Any]) -> None:
    console.print(
        f"host failure cost (multihost; kill -9 to reclaimed by a survivor; poll {result['poll_ms']:.0f} ms)"
    )
    console.print(
        f"{'lease ms':>9}{'trials':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'p50/lease':>11}{'max/lease':>11}"
    )
    for r in result["leases"]:
        console.print(
            f"{r['lease_ms']:>9}{r['trials']:>8}{r['reclaimed_p50_ms']:>10.1f}{r['reclaimed_p99_ms']:>10.1f}"
            f"{r['reclaimed_max_ms']:>10.1f}{r['p50_over_lease']:>11.2f}{r['max_over_lease']:>11.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "victim":
        sys.exit(victim(sys.argv[2]))
    sys.exit("usage: python -m cxlkv.tools.failover victim POOL")
