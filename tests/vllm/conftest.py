"""Fixtures of the real-vLLM tests: each engine runs in its own process (llm_driver.py), as
several vLLM instances would, attached to one pool under /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from cxlkv.testing.prompts import seeded_words

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 128  # vLLM CPU's default block size


def words(seed: int, n: int) -> str:
    return seeded_words(seed, n)


def run_engine(spec: dict, timeout: int = 600, log: list | None = None, env: dict | None = None) -> list:
    """Runs one vLLM engine process; returns its RESULT records (one per round). `log`, when
    given, receives the process's whole output; `env` adds environment variables (e.g. the
    engine's CXLKV_HOST_ID; None unsets one)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}  # None: unset
    env.pop("PYTHONHASHSEED", None)  # keys must match across processes with default settings
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "llm_driver.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if log is not None:
        log.append(p.stdout + p.stderr)
    if p.returncode != 0 or len(results) != len(spec["rounds"]):
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-60:])
        raise AssertionError(f"engine failed (rc={p.returncode}):\n{tail}")
    return results


# bf16 logits of this model step by 1/32 around the logprobs it produces (-2 to -5): two runs
# whose batches differ agree within an ulp or two; KV of another prompt moves them far more.
LOGPROB_TOL = 0.07


def parted_at_tie(ref: dict, got: dict) -> int | None:
    """Where a greedy output parts from the reference, or None when it does not. Asserts that up
    to there both chose the same tokens with logprobs within LOGPROB_TOL, and that the parting is
    a near tie in both runs (each run's token within LOGPROB_TOL of the other's in its top 5): the
    only way two correct runs whose bf16 arithmetic differs in low-order bits may part."""
    for k, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        if a == b:
            assert abs(ref["logprobs"][k] - got["logprobs"][k]) <= LOGPROB_TOL, (
                f"token {k}: logprob {got['logprobs'][k]:.4f} vs the reference's {ref['logprobs'][k]:.4f}"
            )
            continue
        r_top, g_top = dict(ref["top"][k]), dict(got["top"][k])
        assert b in r_top and r_top[a] - r_top[b] <= LOGPROB_TOL, (
            f"token {k}: parted where the reference had no tie"
        )
        assert a in g_top and g_top[b] - g_top[a] <= LOGPROB_TOL, (
            f"token {k}: parted where this run had no tie"
        )
        return k
    return None


@pytest.fixture(scope="session")
def tiny_model():
    from cxlkv.testing import models

    return models.tiny_llama()


def unique_pool(name: str):
    """For a fixture to ``yield from``: a unique, not yet existing pool path under /dev/shm,
    removed when the fixture ends."""
    path = f"/dev/shm/cxlkv-vllm-{name}-{uuid.uuid4().hex}"
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def pool_path():
    yield from unique_pool("test")
