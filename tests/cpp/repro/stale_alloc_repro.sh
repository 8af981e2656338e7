#!/usr/bin/env bash
# Deterministic reproducer (needs gdb) for the allocator race: an allocator checks that chunk c is
# ACTIVE for its namespace, then (paused here by gdb at claim_free_block) another process drains c
# and re-carves it for another namespace; the paused allocator then claims a desc of the re-carved
# chunk and publishes a READY entry of its namespace in another namespace's chunk.
# Expected output without the bug: check ok=1 and get X/100 -> 1 (or W's put returning false).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
B="${CXLKV_GTEST_BUILD:-$ROOT/build/gtest}"
OUT="$(mktemp -d)"
g++ -std=c++20 -O1 -g -I"$ROOT/src/core" -I"$ROOT/src/core/format" -I"$ROOT/src/core/coherence" \
    -I"$ROOT/src/core/nodes" -I"$ROOT/src/core/store" -I"$ROOT/src/core/transfer" -I"$ROOT/src/core/rpc" \
    -I"$ROOT/src/core/platform" "$ROOT/tests/cpp/repro/stale_alloc_repro.cpp" \
    "$B/libcxlkv_core.a" -lgtest -lpthread -o "$OUT/stale"
P=/dev/shm/cxlkv-stale-repro-$$
"$OUT/stale" setup "$P" & SETUP=$!
sleep 0.5
# The breakpoint is on the function's first instruction and its condition reads the third integer
# argument register (x86-64 SysV: this=rdi, &ns=rsi, chunk=rdx): a condition on the name `chunk`
# depends on which inlined scope the compiler's first instructions belong to (noipa keeps the
# function itself whole and uncloned, so its entry and argument registers are stable).
gdb -q -batch -ex 'break *cxlkv::Allocator::claim_free_block if $rdx == 1' -ex run \
    -ex "shell $OUT/stale D $P" -ex continue --args "$OUT/stale" W "$P" 2>&1 | grep -E "^(Breakpoint 1,|W:|D:)" || true
RESULT="$("$OUT/stale" check "$P")"
echo "$RESULT"
kill "$SETUP"; rm -f "$P"; rm -rf "$OUT"
# Pass: the pool stays consistent and X's block reads back (or W's put was refused).
echo "$RESULT" | grep -q "check: ok=1" && echo "$RESULT" | grep -q "get X/100 -> 1"
