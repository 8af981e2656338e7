"""The CUDA data path on a real GPU (scripts/gpu-check.sh): the checks of cuda_checks.py under
pytest, one test each. Skipped, with the reason, where there is no CUDA device; the same logic runs
on CPU tensors under TRITON_INTERPRET=1 in tests/python/test_paged_kernels.py and
test_transfer_cuda.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device (torch.cuda.is_available() is False): run scripts/gpu-check.sh on a GPU machine",
        allow_module_level=True,
    )

import cuda_checks  # noqa: E402  (tests/gpu is on sys.path: pytest's rootdir-less import of this file)


@pytest.mark.parametrize("name", [c[0] for c in cuda_checks.CHECKS])
def test_cuda_check(name: str) -> None:
    cuda_checks.run_check(name)
