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


@pytest.fixture(scope="session")
def tiny_model():
    from cxlkv.testing import models

    return models.tiny_llama()


@pytest.fixture
def pool_path():
    path = f"/dev/shm/cxlkv-vllm-test-{uuid.uuid4().hex}"
    yield path
    for p in (path,):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
