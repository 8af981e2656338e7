"""The connector's asynchronous saves with test_connector_unit.py's fake engine (real pool, real
transfer thread), the thread held at a gate the test opens: the step returns before the copy;
a finished request's blocks are held (request_finished is True) until get_finished reports it,
which happens only after its copy; a request without saves is freed at once; a preempted
request's copy is waited for before the next forward (handle_preemptions); stats count a save
once it is done; a prefill instance (kv_producer) ends its step once its saves are published. The
real-engine version is tests/vllm/test_async_saves.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytest.importorskip("torch")
from cxlkv.integrations.transfer import CpuTransfer
from test_connector_unit import BS, Engine, pool_blocks, tokens


class GatedSession:
    """The worker's session, whose stores wait for the test to open the gate."""

    def __init__(self, real):
        self.real, self.gate, self.stores = real, threading.Event(), 0

    def call(self, what, fn, retry=True):
        if what == "store":
            assert self.gate.wait(60), "the test never opened the gate"
            self.stores += 1
        return self.real.call(what, fn, retry=retry)


def gated(engine: Engine) -> GatedSession:
    w = engine.worker.worker
    g = GatedSession(w._session)
    w._transfer.close()
    w._transfer = CpuTransfer(g, w._kv_arrays, w._block_dim)
    return g


def finished_sending(engine: Engine, finished: set) -> set:
    """get_finished, polled (bounded) on empty steps as vLLM's engine does, until it reports."""
    deadline = time.monotonic() + 60
    while True:
        sending, _ = engine.worker.get_finished(finished)
        finished = set()
        if sending:
            return sending
        assert time.monotonic() < deadline, "the request was never reported as finished sending"
        time.sleep(0.005)


def test_finished_request_is_held_until_its_copy_is_done(pool_path, model_dir):
    a = Engine(pool_path, model_dir, async_saves=True)
    g = gated(a)
    toks = tokens(70, 4 * BS + 1)
    a.add("r", toks)
    meta = a.step({"r": len(toks)}, wait_saves=False)
    assert [len(op.keys) for op in meta.saves] == [4]
    assert pool_blocks(pool_path, a.sched._ns_name, toks) == {}  # the step returned, nothing copied
    r = a.reqs.pop("r")
    delay, _ = a.sched.request_finished(r["req"], r["blocks"])
    assert delay is True  # vLLM keeps the blocks
    for _ in range(3):  # empty steps: not reported while its copy waits at the gate
        assert a.worker.get_finished({"r"}) == (None, None)
    assert a.stats.data["store_blocks"] == 0
    g.gate.set()
    assert finished_sending(a, set()) == {"r"}  # reported once, from the earlier finished set
    assert a.worker.get_finished(set()) == (None, None)
    assert sorted(pool_blocks(pool_path, a.sched._ns_name, toks)) == [0, 1, 2, 3]
    assert a.worker.get_kv_connector_stats().data["store_blocks"] == 4
    # A request that never saved (shorter than a block) is freed at once.
    a.add("s", tokens(71, BS - 1))
    a.step({"s": BS - 1})
    s = a.reqs.pop("s")
    assert a.sched.request_finished(s["req"], s["blocks"]) == (False, None)
    a.close()


def test_preempted_request_copy_is_waited_for_before_the_next_forward(pool_path, model_dir):
    a = Engine(pool_path, model_dir, async_saves=True)
    g = gated(a)
    toks = tokens(72, 3 * BS + 1)
    a.add("p", toks)
    a.step({"p": len(toks)}, wait_saves=False)
    # The next step's schedule preempted "p": its blocks may be written by this step's forward.
    meta = SimpleNamespace(preempted={"p"})
    waiter = threading.Thread(target=a.worker.handle_preemptions, args=(meta,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "handle_preemptions returned while the preempted request's copy was pending"
    g.gate.set()
    waiter.join(60)
    assert not waiter.is_alive()
    assert sorted(pool_blocks(pool_path, a.sched._ns_name, toks)) == [0, 1, 2]
    # Other requests' copies are not waited for.
    a.worker.handle_preemptions(SimpleNamespace(preempted={"other"}))
    a.close()


def test_prefill_instance_step_ends_once_its_saves_are_published(pool_path, model_dir):
    """kv_producer: the proxy sends the request to the decode instance once the prefill answers,
    so the producer's step waits for its saves (the decode instance finds every block)."""
    a = Engine(pool_path, model_dir, role="kv_producer", async_saves=True)
    g = gated(a)
    toks = tokens(73, 3 * BS + 1)
    a.add("p", toks)
    stepper = threading.Thread(target=a.step, args=({"p": len(toks)},), kwargs={"wait_saves": False})
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "the producer's step returned before its saves were published"
    g.gate.set()
    stepper.join(60)
    assert sorted(pool_blocks(pool_path, a.sched._ns_name, toks)) == [0, 1, 2]
    a.close()


def test_async_is_the_default_and_false_opts_out(pool_path, model_dir):
    """No async_saves key: the step returns before its copy. "async_saves": false: the step waits
    for its own saves and vLLM frees a finished request at once. Anything but a bool is refused."""
    a = Engine(pool_path, model_dir)
    g = gated(a)
    toks = tokens(74, 2 * BS + 1)
    a.add("r", toks)
    a.step({"r": len(toks)}, wait_saves=False)
    assert pool_blocks(pool_path, a.sched._ns_name, toks) == {}  # returned before the copy
    g.gate.set()
    a.close()
    b = Engine(pool_path, model_dir, async_saves=False)
    g = gated(b)
    g.gate.set()
    toks = tokens(75, 2 * BS + 1)
    b.add("s", toks)
    b.step({"s": len(toks)}, wait_saves=False)
    assert sorted(pool_blocks(pool_path, b.sched._ns_name, toks)) == [0, 1]  # waited for
    s = b.reqs.pop("s")
    assert b.sched.request_finished(s["req"], s["blocks"]) == (False, None)
    b.close()
    with pytest.raises(ValueError, match="async_saves must be true or false"):
        Engine(pool_path, model_dir, async_saves="false")
