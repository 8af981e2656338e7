#!/usr/bin/env bash
# The main job, from a fresh machine: several processes share one pool on /dev/shm, publishing
# and reusing KV blocks of shared prefixes; prints hit rates and bandwidth.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
exec cxlkv demo "$@"
