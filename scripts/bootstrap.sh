#!/usr/bin/env bash
# Installs everything cxlkv needs on a fresh Debian/Ubuntu machine, idempotently:
# system packages (compiler, CMake, Ninja, GoogleTest: the C++ tests; xxHash is vendored in
# third_party/), a virtual environment in .venv, and cxlkv itself with its test and dev (style
# tools) extras. Sourced by scripts/test.sh
# and scripts/demo.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CXLKV_VENV:-$ROOT/.venv}"

need_apt=()
command -v c++ >/dev/null || need_apt+=(g++)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
[ -d /usr/include/gtest ] || need_apt+=(libgtest-dev)
command -v gdb >/dev/null || need_apt+=(gdb)
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "$ROOT[test,dev]"
export PATH="$VENV/bin:$PATH"
