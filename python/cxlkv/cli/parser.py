"""The ``cxlkv`` argument parser: the command tree, each command's options and their help.

Defaults that are facts of the library are read from it, never written here: the default pool
path (:func:`cxlkv.default_pool_path`, so ``$CXLKV_POOL`` names the pool of every command), pool
creation's defaults and limits (:func:`cxlkv.create_options`), the backends, the exit codes
(:mod:`cxlkv.errors`) and the benchmark geometries.
"""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

import cxlkv
from cxlkv.errors import exit_codes_text
from cxlkv.paths import default_pool_path

from .parser_bench import add_bench
from .parser_demo import add_demo
from .parser_pool import add_pool
from .parser_services import add_services
from .parser_types import BACKEND_HELP, _Parser

__all__ = ["BACKEND_HELP", "build_parser"]

_POOL_ENV_HELP = "Every command's default pool is $CXLKV_POOL if set, else /dev/shm/cxlkv-<uid>/pool."


def build_parser() -> argparse.ArgumentParser:
    """The command tree: one ``add_<group>`` per command group, each in its ``parser_<group>.py``."""
    p = _Parser(
        prog="cxlkv",
        description="cxlkv: a KV-cache block store in a shared-memory (CXL) pool.",
        epilog=exit_codes_text() + " " + _POOL_ENV_HELP,
    )
    try:
        ver = version("cxlkv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ver = "unknown"
    p.add_argument("--version", action="version", version=f"cxlkv {ver}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    default_pool = default_pool_path()  # $CXLKV_POOL, read now: the pool the library would open
    create = cxlkv.create_options()

    add_pool(sub, default_pool, create)
    add_bench(sub, default_pool)
    add_demo(sub, default_pool)
    add_services(sub, default_pool)
    return p
