#!/usr/bin/env bash
# The main job, from a fresh machine: two vLLM OpenAI servers (SmolLM2-135M, CPU) attached to one
# cxlkv pool on /dev/shm; a multi-turn conversation starts on one and continues on the other,
# with per-turn TTFT against a plain vLLM server. Installs vLLM CPU on first use (~3 min, 6 GB).
# `bash scripts/demo.sh --pool-only` runs the lighter demo of the pool alone (several processes
# publishing and reusing KV blocks; hit rates and bandwidth).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
if [ "${1:-}" = "--pool-only" ]; then
  shift
  exec cxlkv demo "$@"
fi
bash "$ROOT/scripts/setup-vllm.sh" "$VENV"
exec cxlkv demo --vllm "$@"
