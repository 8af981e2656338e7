"""tests/gpu's checks (tests/gpu/cuda_checks.py, what scripts/gpu-check.sh runs on a lent GPU)
run on CPU tensors under Triton's interpreter, so that a GPU session finds them coherent with the
API they call: the same code paths but for the device (the two registration checks need a CUDA
runtime and are left out here). Their own runner is used, as on a GPU image without pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_checks_pass_on_cpu_under_the_triton_interpreter(tmp_path: Path) -> None:
    env = dict(os.environ, CXLKV_GPU_CHECK_DEVICE="cpu", TRITON_INTERPRET="1", CXLKV_GPU_POOL_DIR="/dev/shm")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "cuda_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "cuda_checks: 6 passed, 0 failed" in r.stdout, r.stdout
