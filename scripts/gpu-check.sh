#!/usr/bin/env bash
# The CUDA data path, checked from a fresh checkout on a bare GPU machine (BENCHMARKS.md, "The
# CUDA data path"): offline, with the image's Python, torch, Triton, CMake, Ninja, nanobind and
# scikit-build-core; nothing of this repository built beforehand.
#
#   bash scripts/gpu-check.sh [--python PY] [--budget SECONDS] [--wheelhouse DIR] [--register-gib N]
#
# Steps, each with its own timeout inside one total budget (default 420 s: the check stops itself
# before 8 minutes; a step that no longer fits is skipped and says so):
#   1. probe     what the image has (python, torch + CUDA, triton, numpy, pytest, build tools, GPU)
#   2. build     the extension, without network: pip install --no-build-isolation --no-deps
#                --no-index --target build/gpu-check/site .  (a plain CMake build if pip cannot)
#   3. import    cxlkv from that build (numpy is the one runtime dependency `import cxlkv` needs:
#                missing, it is installed from --wheelhouse DIR if given, else the step fails
#                with one line saying so; rich is only used by the CLI's tables)
#   4. tests     tests/gpu (pytest when the image has it, else the same checks by their own runner)
#   5. bench     pool <-> GPU GB/s of the fused kernels vs one cudaMemcpy of the same bytes and
#                one cudaMemcpyAsync per fragment (python -m cxlkv.tools.bench_cuda)
#   6. register  cudaHostRegister of a pool file in ranges (cuda_registration.py), timed
# Without a CUDA device steps 4-6 are skipped with one line and the check passes (CI runs it so on
# CPU, in a fresh venv with pip's index off, so the build path above is tested on every landing).
#
# Output: the log and gpu-check.json (every step's status and seconds, the probe, the benchmarks'
# JSON) under $OUT when it is set, else build/gpu-check/out. Exit status 0 only if no step failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="" BUDGET="${CXLKV_GPU_CHECK_BUDGET:-420}" WHEELHOUSE="${CXLKV_WHEELHOUSE:-}" REGISTER_GIB=8
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
    --register-gib) REGISTER_GIB="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3 || command -v python); fi
fi

WORK="$ROOT/build/gpu-check"
OUTDIR="${OUT:-$WORK/out}"
SITE="$WORK/site"
mkdir -p "$OUTDIR" "$WORK"
LOG="$OUTDIR/gpu-check.log"
STEPS="$WORK/steps.tsv"
: >"$LOG"
: >"$STEPS"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
START=$(date +%s)
FAILED=0

say() { echo "gpu-check: $*"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME TIMEOUT CMD...: runs CMD with min(TIMEOUT, what is left of the budget - 15 s); records
# ok / failed (rc) / timeout / skipped in steps.tsv.
step() {
  local name="$1" want="$2"
  shift 2
  local t
  t=$(left)
  t=$((t - 15))
  [ "$t" -gt "$want" ] && t="$want"
  if [ "$t" -lt 10 ]; then
    say "$name: skipped: the budget of ${BUDGET} s is spent"
    printf '%s\tskipped\t0\tbudget spent\n' "$name" >>"$STEPS"
    FAILED=1
    return 1
  fi
  say "== $name (timeout ${t} s, $(left) s of the budget left)"
  local t0 rc
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this script (exported below)
    timeout --kill-after=5 "$t" bash -c "$1"
  else
    timeout --kill-after=5 "$t" "$@"
  fi
  rc=$?
  local dt=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    printf '%s\tok\t%s\t\n' "$name" "$dt" >>"$STEPS"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "$name: TIMEOUT after ${dt} s"
    printf '%s\ttimeout\t%s\tafter %s s\n' "$name" "$dt" "$dt" >>"$STEPS"
    FAILED=1
  else
    say "$name: FAILED (exit $rc, ${dt} s)"
    printf '%s\tfailed\t%s\texit %s\n' "$name" "$dt" "$rc" >>"$STEPS"
    FAILED=1
  fi
  return "$rc"
}
skip() {  # skip NAME REASON: one line, not a failure
  say "$1: skipped: $2"
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$STEPS"
}

# Console scripts of the interpreter's environment (pip's cmake / ninja packages put them there)
SCRIPTS_DIR=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)
[ -n "$SCRIPTS_DIR" ] && export PATH="$SCRIPTS_DIR:$PATH"
NPROC=$(nproc 2>/dev/null || echo 2)
export CMAKE_BUILD_PARALLEL_LEVEL="$NPROC"
say "python $PY, budget ${BUDGET} s, output in $OUTDIR"

# 1. probe --------------------------------------------------------------------------------------
step probe 60 "$PY" "$ROOT/scripts/gpu_check_probe.py" "$WORK/probe.json"
HAVE_CUDA=$("$PY" -c 'import json,sys; print(int(json.load(open(sys.argv[1])).get("cuda_available", False)))' \
  "$WORK/probe.json" 2>/dev/null || echo 0)

# 2. build --------------------------------------------------------------------------------------
rm -rf "$SITE"
build_pip() {
  "$PY" -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir \
    --disable-pip-version-check -q --target "$SITE" --config-settings=build-dir="$WORK/skbuild" "$ROOT"
}
build_cmake() {  # the same module without pip: CMake + (Ninja if there is one), then the package tree
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$ROOT" -B "$WORK/cmake" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCXLKV_BUILD_TESTS=OFF \
    -DPython_EXECUTABLE="$(command -v "$PY" || echo "$PY")" >/dev/null &&
    cmake --build "$WORK/cmake" --target _core -j "$NPROC" &&
    rm -rf "$SITE" && mkdir -p "$SITE" && cp -r "$ROOT/python/cxlkv" "$SITE/" &&
    rm -f "$SITE"/cxlkv/_core*.so && cp "$WORK"/cmake/_core*.so "$SITE/cxlkv/"
}
export PY SITE WORK ROOT NPROC
export -f build_pip build_cmake
BEFORE_BUILD=$FAILED
BUILD_TIMEOUT="${CXLKV_GPU_CHECK_BUILD_TIMEOUT:-330}"  # 16 cores: ~1-2 min; 2 loaded cores: ~4 min
if ! step build "$BUILD_TIMEOUT" build_pip; then
  say "build: pip could not build it; trying CMake directly"
  sed -i '$s/\tfailed\t/\tfell-back\t/; $s/\ttimeout\t/\tfell-back\t/' "$STEPS"  # the CMake build decides
  FAILED=$BEFORE_BUILD
  step build-cmake "$BUILD_TIMEOUT" build_cmake || true
fi

# 3. import -------------------------------------------------------------------------------------
export PYTHONPATH="$SITE"
export CXLKV_GPU_CHECK_SITE="$SITE"
if ! "$PY" -c 'import numpy' 2>/dev/null; then
  if [ -n "$WHEELHOUSE" ]; then
    say "numpy is missing: installing it from the wheelhouse $WHEELHOUSE"
    "$PY" -m pip install --no-index --no-deps --find-links "$WHEELHOUSE" --target "$SITE" -q numpy ||
      say "numpy: not installable from $WHEELHOUSE"
  else
    say "numpy is missing from this image and 'import cxlkv' needs it (the token store, the pool's byte views); pass --wheelhouse DIR with a numpy wheel for this Python (no network here)"
  fi
fi
IMPORTED=0
if step import 60 "$PY" -c '
import os, sys
import cxlkv, cxlkv._core
site = os.environ["CXLKV_GPU_CHECK_SITE"]
where = os.path.dirname(cxlkv.__file__)
if not where.startswith(site):
    sys.exit(f"cxlkv imported from {where}, not from the build in {site}")
print("cxlkv imported from", where)
'; then IMPORTED=1; fi

# 4-6. CUDA ---------------------------------------------------------------------------------------
if [ "$HAVE_CUDA" != "1" ]; then
  skip cuda "no CUDA device visible to torch (torch.cuda.is_available() is False, or no torch): tests/gpu and the CUDA benchmarks did not run"
elif [ "$IMPORTED" != "1" ]; then
  skip cuda "cxlkv did not build or import (see above): tests/gpu and the CUDA benchmarks did not run"
  FAILED=1
else
  unset TRITON_INTERPRET
  # Pool directories with room: /dev/shm in a container is often 64 MiB (a disk-backed file is the
  # fallback; cudaHostRegister may refuse its pages, and the steps then say so).
  POOL_DIR=$("$PY" "$ROOT/scripts/gpu_check_probe.py" --pool-dir "$WORK/pools" 2)
  REGISTER_DIR=$("$PY" "$ROOT/scripts/gpu_check_probe.py" --pool-dir "$WORK/pools" "$REGISTER_GIB")
  export CXLKV_GPU_POOL_DIR="$POOL_DIR"
  say "pools in $POOL_DIR; the registration's ${REGISTER_GIB} GiB pool in $REGISTER_DIR"
  if "$PY" -c 'import pytest' 2>/dev/null; then
    step tests 200 "$PY" -m pytest -q -p no:cacheprovider -rs -o addopts= tests/gpu \
      --junitxml="$OUTDIR/tests-gpu.xml" || true
  else
    say "pytest is not in this image: tests/gpu's checks run by their own runner"
    step tests 200 "$PY" tests/gpu/cuda_checks.py || true
  fi
  step bench 120 "$PY" -m cxlkv.tools.bench_cuda --blocks 256 --json --pool-dir "$POOL_DIR" \
    --out "$OUTDIR/bench-cuda.json" || true
  step register 90 "$PY" -m cxlkv.tools.bench_cuda --register-gib "$REGISTER_GIB" --json \
    --pool-dir "$REGISTER_DIR" --out "$OUTDIR/bench-register.json" || true
fi

ELAPSED=$(($(date +%s) - START))
"$PY" - "$STEPS" "$WORK/probe.json" "$OUTDIR" "$ELAPSED" "$BUDGET" "$FAILED" <<'EOF'
import json, os, sys
steps_path, probe_path, outdir, elapsed, budget, failed = sys.argv[1:7]
steps = []
for line in open(steps_path):
    name, status, secs, detail = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    steps.append({"step": name, "status": status, "seconds": int(secs or 0), "detail": detail})
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
out = {
    "ok": failed == "0",
    "elapsed_s": int(elapsed), "budget_s": int(budget), "steps": steps,
    "probe": load(probe_path),
    "bench_cuda": load(os.path.join(outdir, "bench-cuda.json")),
    "registration": load(os.path.join(outdir, "bench-register.json")),
}
with open(os.path.join(outdir, "gpu-check.json"), "w") as f:
    json.dump(out, f, indent=1)
for s in steps:
    print(f"  {s['step']:<12} {s['status']:<8} {s['seconds']:>4} s  {s['detail']}")
EOF
say "done in ${ELAPSED} s: $([ "$FAILED" = 0 ] && echo PASSED || echo FAILED); $OUTDIR/gpu-check.json"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # the log is complete before the caller collects $OUT
exit "$FAILED"
