"""Two vLLM engines attached to one `multihost` pool as different hosts (issue 9).

Engine A runs as host `engine-a` (CXLKV_HOST_ID, host slot 0) and computes the prompts; engine B,
a fresh process of host `engine-b` (slot 1), must load every full block from the pool and produce
exactly the tokens and logprobs of A's local prefix-cache hit. Each engine opens the pool from its
scheduler-side and its worker-side connector: those handles (and processes) of one host share its
host slot; with on_pool_error=fail, an attachment refused there would stop the engine."""

from __future__ import annotations

import pytest

from conftest import run_engine
from test_connector import PROMPTS, full_blocks, plain

pytestmark = pytest.mark.timeout(900)


def host(name: str, slot: int) -> dict:
    return {"CXLKV_HOST_ID": name, "CXLKV_HOST_SLOT": str(slot)}


def test_second_host_loads_the_first_hosts_kv(pool_path, tiny_model, monkeypatch):
    import cxlkv

    cxlkv.Pool.create(pool_path, "1GiB", backend="multihost").close()
    spec = {"pool": pool_path, "on_pool_error": "fail"}
    a = run_engine(
        {**spec, "rounds": [{"prompts": plain(PROMPTS)}, {"prompts": plain(PROMPTS)}]},
        env=host("engine-a", 0),
    )
    log: list = []
    b = run_engine({**spec, "rounds": [{"prompts": plain(PROMPTS)}]}, env=host("engine-b", 1), log=log)
    b = b[0]["outputs"]
    said = "\n".join(line for line in log[0].splitlines() if "cxlkv" in line.lower())[-4000:]
    for ref, got in zip(a[1]["outputs"], b, strict=True):
        assert got["cached"] == full_blocks(got["len"]), (got["len"], got["cached"], said)
        assert got["tokens"] == ref["tokens"]
        assert got["logprobs"] == ref["logprobs"]
    # The pool is consistent afterwards, seen from a third host's row.
    monkeypatch.setenv("CXLKV_HOST_ID", "checker")
    monkeypatch.setenv("CXLKV_HOST_SLOT", "2")
    with cxlkv.Pool.open(pool_path, attach=False) as pool:
        assert pool.info()["backend"] == "multihost"
        report = pool.check()
    assert report["ok"], report["errors"]
    assert report["orphan_pins"] == 0 and report["blocks"]["in_flight"] == 0
