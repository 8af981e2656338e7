"""A vLLM engine paused past its lease on a `multihost` pool comes back by itself (issue 14).

Engine A (host `engine-a`, slot 0) serves prompt P, stores it and hits it from the pool. Then the
test SIGSTOPs every process of A (a GC pause, a VM migration) while it holds its nodes, and, as
another host (`reaper`, slot 2), reaps them once the lease has passed: A's nodes are reclaimed,
so A is fenced. Resumed with SIGCONT, A must go on serving without a restart: correct tokens; each
of its connectors (scheduler side, worker side) says once that its node was fenced and that it
opened the pool again; a prompt Q computed after the pause is stored by the new nodes, and Q and P
are then loaded from the pool (vLLM's prefix cache is off, so every cached token came from the
pool). The pool check is clean at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from conftest import words
from engine_proc import EngineProc
from test_connector import full_blocks

pytestmark = pytest.mark.timeout(900)

LEASE_MS = 3000  # generous for a loaded 2-core machine: a fence only after 1.5 s without a beat
STEP_TIMEOUT_S = 420  # a start-up or a round of the CPU engine, on a loaded machine


def descendants(pid: int) -> list[int]:
    """pid and every process below it (the engine core and workers are children of the driver)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class Engine(EngineProc):
    """The engine of this test: its RESULT lines read round by round, and signalled process by
    process (SIGSTOP/SIGCONT of all of it)."""

    def expect(self, prefix: str, timeout: float = STEP_TIMEOUT_S) -> str:
        return super().expect(prefix, timeout)

    def result(self, round_: int) -> dict:
        r = json.loads(self.expect("RESULT ")[7:])
        assert r["round"] == round_, r
        return r

    def signal_all(self, sig: int) -> list[int]:
        pids = descendants(self.p.pid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill(self) -> None:
        if self.p.poll() is None:
            self.signal_all(signal.SIGKILL)
            self.p.wait(timeout=60)


def reap_until_gone(pool, nodes, why: str) -> None:
    """Reaps until none of `nodes` holds its slot: each is reclaimed once this (attached) handle
    has watched its beat stand still for a lease."""
    deadline = time.monotonic() + 30 * LEASE_MS / 1000
    while True:
        pool.reap_dead_nodes()
        left = [n for n in pool.nodes() if n["node"] in nodes and not n["self"] and n["state"] != "free"]
        if not left:
            return
        assert time.monotonic() < deadline, f"{why}: never reclaimed: {left}"
        time.sleep(0.2)


def host(name: str, slot: int) -> dict:
    return {"CXLKV_HOST_ID": name, "CXLKV_HOST_SLOT": str(slot)}


def test_engine_paused_past_its_lease_recovers_without_restart(pool_path, tiny_model, monkeypatch):
    import cxlkv

    cxlkv.Pool.create(pool_path, "1GiB", backend="multihost", lease_ms=LEASE_MS).close()
    go = pool_path + ".go"
    p, q = words(70, 500), words(71, 500)
    spec = {
        "pool": pool_path,
        "on_pool_error": "fail",
        "prefix_caching": False,  # every cached token comes from the pool
        "rounds": [
            {"prompts": [{"prompt": p}]},  # 0: computes P, stores it
            {"prompts": [{"prompt": p}]},  # 1: P from the pool
            {"prompts": [{"prompt": p}], "wait_for": go},  # 2: after the pause: fenced
            {"prompts": [{"prompt": q}]},  # 3: Q computed after the pause, stored by new nodes
            {"prompts": [{"prompt": q}, {"prompt": p}]},  # 4: both from the pool
        ],
    }
    # The test process is a host of its own: it judges A by the lease alone.
    monkeypatch.setenv("CXLKV_HOST_ID", "reaper")
    monkeypatch.setenv("CXLKV_HOST_SLOT", "2")
    a = Engine(spec, host("engine-a", 0))
    try:
        r0, r1 = a.result(0), a.result(1)
        a.expect("WAITING 2")
        # Attached (an observer has no heartbeat: on multihost it is fenced itself once open
        # for half a lease, before it could judge A dead).
        with cxlkv.Pool.open(pool_path) as obs:
            before = {n["node"]: n for n in obs.nodes() if n["state"] == "alive" and not n["self"]}
            pids = set(descendants(a.p.pid))
            assert before and {n["pid"] for n in before.values()} <= pids, (before, pids)
            reclaimed0 = obs.stats()["reclaimed_nodes"]
            stopped = a.signal_all(signal.SIGSTOP)
            reap_until_gone(obs, set(before), "A's nodes, stopped")
            assert set(descendants(a.p.pid)) == set(stopped)  # all of A was stopped throughout
            assert obs.stats()["reclaimed_nodes"] - reclaimed0 >= len(before)
        a.signal_all(signal.SIGCONT)
        with open(go, "w"):
            pass
        r2, r3, r4 = a.result(2), a.result(3), a.result(4)
        assert a.p.wait(timeout=STEP_TIMEOUT_S) == 0, a.tail()
    finally:
        a.kill()
        if os.path.exists(go):
            os.unlink(go)
    log = "\n".join(a.lines)
    said = "\n".join(ln for ln in a.lines if "cxlkv" in ln.lower())[-6000:]
    (o0,), (o1,), (o2,), (o3,) = r0["outputs"], r1["outputs"], r2["outputs"], r3["outputs"]
    o4q, o4p = r4["outputs"]
    # Before the pause: P stored, then loaded from the pool.
    assert o1["cached"] == full_blocks(o1["len"]) > 0, said
    # Resumed: every answer is right (greedy: the same tokens as the first computation).
    assert o2["tokens"] == o1["tokens"] == o0["tokens"]
    assert o4p["tokens"] == o0["tokens"] and o4q["tokens"] == o3["tokens"]
    # ...and the pool is used again by the new nodes, without a restart: Q, stored after the
    # fence, and P are both loaded from it.
    assert o4q["cached"] == full_blocks(o4q["len"]) > 0, said
    assert o4p["cached"] == full_blocks(o4p["len"]), said
    # Each fenced node said so once, naming the pool, and its connector opened the pool again.
    fenced = [ln for ln in a.lines if "was fenced (seen in" in ln]
    assert fenced and all(pool_path in ln and "opened the pool again as new node" in ln for ln in fenced), (
        said
    )
    for node in before:
        assert any(f"node {node} was fenced" in ln for ln in fenced), (node, said)
    assert any("(scheduler)" in ln for ln in fenced) and any("(worker)" in ln for ln in fenced), said
    assert "no longer usable" not in log, said  # the cache was never switched off
    assert not re.search(r"Traceback|EngineDeadError", log), a.tail(120)
    # Nothing lost: A's last nodes (an engine core may exit without closing its connector)
    # are reclaimed like any dead host's, and the pool is consistent.
    with cxlkv.Pool.open(pool_path) as pool:
        reap_until_gone(pool, {n["node"] for n in pool.nodes() if not n["self"]}, "A's nodes, exited")
        report = pool.check()
    assert report["ok"], report["errors"]
    assert report["orphan_pins"] == 0 and report["blocks"]["in_flight"] == 0
