#!/usr/bin/env bash
# Developer build: installs the package (C++ core + module) into the dev venv. Serialized with
# flock so parallel callers do not trample one build tree.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-${CXLKV_VENV:-.venv}}  # the project's venv, as scripts/setup-peers.sh
exec 9>/tmp/cxlkv-dev-build.lock
flock 9
# python -m pip, not bin/pip: a hard-linked venv copy keeps the console scripts of the venv it was
# copied from in their shebangs, and bin/pip would install into that venv instead.
"$VENV/bin/python" -m pip install -q --no-build-isolation -Cbuild-dir=build/dev . 2>&1 | tail -30
