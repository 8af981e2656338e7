#!/usr/bin/env bash
# Long fuzzing campaigns (CI runs a few hundred cases; this runs for as long as you like):
#   scripts/fuzz.sh --minutes M [--seed S] [--out DIR] [--live-seconds S]
# Runs the format fuzzer for M minutes (failing cases go to DIR, default build/fuzz-<seed>, each
# with its replay command), then every live co-tenant corruption scenario for S seconds (default 4)
# and the model state machine with more examples. Exit status 1 when anything failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${CXLKV_VENV:-$ROOT/.venv}/bin/python"
MINUTES=10 SEED="${CXLKV_FUZZ_SEED:-$RANDOM$RANDOM}" OUT="" LIVE=4
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --live-seconds) LIVE="$2"; shift 2 ;;
    *) echo "usage: $0 --minutes M [--seed S] [--out DIR] [--live-seconds S]" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/build/fuzz-$SEED}"
status=0
echo "== format fuzzer: seed $SEED, $MINUTES minutes, failing cases -> $OUT"
"$PY" "$ROOT/tests/fuzz/fuzz_format.py" --seed "$SEED" --cases 100000000 --minutes "$MINUTES" \
      --out "$OUT" || status=1
echo "== live co-tenant corruption: every scenario, $LIVE s each"
"$PY" "$ROOT/tests/fuzz/live_corrupt.py" --seconds "$LIVE" || status=1
echo "== model state machine: seed $SEED, 1000 runs"
CXLKV_FUZZ_SEED="$SEED" CXLKV_MODEL_EXAMPLES=1000 "$PY" -m pytest -q -p no:cacheprovider \
      "$ROOT/tests/python/test_model_state.py" || status=1
[ -d "$OUT" ] && ls "$OUT"/case-*.json 2>/dev/null | sed 's/^/failing case: /'
echo "replay one case: $PY tests/fuzz/fuzz_format.py --replay <case file>"
exit $status
