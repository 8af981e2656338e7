#!/usr/bin/env bash
# The CUDA data path on a GPU machine (torch + triton + CUDA; no vLLM needed): the kernel and
# connector-path tests on CUDA, then pool <-> GPU bandwidth of the fused kernel against one
# cudaMemcpy of the same bytes and one cudaMemcpyAsync per fragment (ratios printed).
# Usage: bash scripts/gpu-check.sh [python]   (default: ./.venv/bin/python, else python3)
# Without CUDA it says so and exits 0 (the same logic is tested on CPU under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: skipped: no CUDA device visible to torch (torch.cuda.is_available() is False)"
  exit 0
fi
"$PY" -c 'import torch; print("gpu-check on", torch.cuda.get_device_name(0), "torch", torch.__version__)'
unset TRITON_INTERPRET
"$PY" -m pytest -q -x tests/gpu
"$PY" -m cxlkv.tools.bench_cuda --blocks 256
"$PY" -m cxlkv.tools.bench_cuda --blocks 256 --json
