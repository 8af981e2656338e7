#!/usr/bin/env bash
# Builds and runs src/bench/copy_micro.cpp (the one-thread fused copy+checksum against glibc's
# memcpy, issue 16 item 3) against the core built by scripts/dev-build.sh (build/dev).
# Arguments go to the program: [MiB=1024] [repeats=7].
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build/dev --target cxlkv_core >/dev/null
out=build/dev/copy_micro
g++ -O2 -std=c++20 -Isrc/core -Isrc/core/platform src/bench/copy_micro.cpp build/dev/libcxlkv_core.a -o "$out" -lpthread
uptime
"$out" "$@"
