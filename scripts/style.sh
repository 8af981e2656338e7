#!/usr/bin/env bash
# Style checks, in seconds: ruff (lint and format) over python/ and tests/, mypy over the typed
# surface (the public API and the vLLM connector), and with --cpp clang-format over src/ and
# tests/cpp. Configuration: pyproject.toml ([tool.ruff], [tool.mypy]) and .clang-format; the
# tools are the pinned `dev` extra (scripts/bootstrap.sh installs it).
#
#   bash scripts/style.sh           check Python (scripts/test.sh runs this)
#   bash scripts/style.sh --cpp     check the C++ as well
#   bash scripts/style.sh --fix     apply ruff's fixes and its formatting (with --cpp: clang-format -i)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

cpp=0 fix=0
for arg in "$@"; do
  case "$arg" in
    --cpp) cpp=1 ;;
    --fix) fix=1 ;;
    *) echo "usage: $0 [--cpp] [--fix]" >&2; exit 2 ;;
  esac
done

PY_PATHS=(python tests)
# The typed surface: the public API and the connector (mypy follows their imports).
MYPY_FILES=(python/cxlkv/__init__.py python/cxlkv/errors.py python/cxlkv/sizes.py
            python/cxlkv/paths.py python/cxlkv/integrations/vllm.py
            python/cxlkv/integrations/vllm_scheduler.py python/cxlkv/integrations/vllm_worker.py)

if [ "$fix" = 1 ]; then
  ruff check --fix "${PY_PATHS[@]}"
  ruff format "${PY_PATHS[@]}"
else
  # Not `cmd && echo ok`: set -e ignores a failure on the left of &&, so a lint error passed.
  ruff check --quiet "${PY_PATHS[@]}"
  echo "ruff check: ok"
  ruff format --check --output-format concise "${PY_PATHS[@]}" && echo "ruff format: ok" ||
    { echo "(bash scripts/style.sh --fix formats them)" >&2; exit 1; }
fi
mypy "${MYPY_FILES[@]}"

if [ "$cpp" = 1 ]; then
  mapfile -t CPP_FILES < <(git ls-files 'src/*.cpp' 'src/*.h' 'tests/cpp/*.cpp' 'tests/cpp/*.h')
  if [ "$fix" = 1 ]; then
    clang-format -i "${CPP_FILES[@]}"
  else
    clang-format --dry-run -Werror "${CPP_FILES[@]}"
    echo "clang-format: ok (${#CPP_FILES[@]} files)"
  fi
fi
