#!/usr/bin/env bash
# Builds and runs src/bench/gather_micro.cpp (where a token-row gather's time goes, issues 15 and 24)
# against the core built by scripts/dev-build.sh (build/dev). Arguments go to the program:
# [row_bytes=656] [context=131072] [layers=4] [k=2048] [repeats=9]; CXLKV_COPY_THREADS sets the threads.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build/dev --target cxlkv_core >/dev/null
out=build/dev/gather_micro
g++ -O2 -std=c++20 -Isrc/core -Isrc/core/format -Isrc/core/coherence -Isrc/core/nodes -Isrc/core/store \
  -Isrc/core/transfer -Isrc/core/rpc -Isrc/core/platform src/bench/gather_micro.cpp build/dev/libcxlkv_core.a \
  -o "$out" -lpthread
uptime
"$out" "$@"
