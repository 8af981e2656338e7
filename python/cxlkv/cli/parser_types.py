"""The ``cxlkv`` parser's argument types and shared arguments (help texts, the pool path, the
backend), for the command groups' ``parser_<group>.py``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import cxlkv
from cxlkv.sizes import parse_size

# ---------------------------------------------------------------------------------------------
# argument types


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _stripe_size_arg(text: str) -> int:
    v = _size_arg(text)
    if v == 0:
        raise argparse.ArgumentTypeError("0 is not a stripe size (leave --stripe-size out for the default)")
    return v


def _ranged_int(option: dict[str, Any]):
    """An int type bounded by one row of :func:`cxlkv.create_options` (or of a pool's limits)."""

    def parse(text: str) -> int:
        v = _pos_int(text)
        hi = option["max"]
        if v < option["min"] or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range {option['min']}..{hi}")
        return v

    return parse


def _pos_int(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _procs_arg(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(_pos_int(part))
    if not out:
        raise argparse.ArgumentTypeError(f"invalid process count {text!r}")
    return out


def _backend_args(p: argparse.ArgumentParser) -> None:
    """--backend / --compare-backends of bench copy and bench index."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--backend",
        choices=cxlkv._core.backends(),
        default="coherent",
        help="coherence backend of the benchmark's pool (default %(default)s)",
    )
    g.add_argument(
        "--compare-backends",
        action="store_true",
        help="run on coherent, then on multihost, and print multihost / coherent (same run)",
    )


def _leases_arg(text: str) -> list[int]:
    out = [_pos_int(part.strip()) for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"invalid lease list {text!r}")
    return out


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _range(option: dict[str, Any]) -> str:
    """``1..254 (default 64)`` from one row of :func:`cxlkv.create_options`."""
    hi = option["max"]
    return f"{option['min']}..{hi if hi is not None else ''} (default {option['default']})"


# One line per backend for `pool create --backend` (coherence.h, docs/ARCHITECTURE.md §2, §11).
# The contract test holds this to cxlkv._core.backends(): a new backend needs its line here.
BACKEND_HELP = {
    "coherent": "one host, hardware-coherent memory (DRAM, /dev/shm, a coherent CXL device)",
    "flush": "one host, non-coherent CXL memory: metadata written back and re-read explicitly "
    "(clwb/clflushopt), payloads by streaming stores",
    "multihost": "several hosts on one CXL 2.0 pool without coherence between them: the flush "
    "discipline plus a cross-host lock (bakery) for claims and lease fencing; see --lock-hosts",
}


def _backend_help() -> str:
    return "; ".join(f"{name}: {BACKEND_HELP[name]}" for name in cxlkv._core.backends())


_PATH_HELP = (
    "pool file or /dev/daxX.Y, or several joined by commas (A,B,...: one pool striped over them, "
    "first device first)"
)


def _pool_path_arg(p: argparse.ArgumentParser, default_pool: str) -> None:
    p.add_argument("path", nargs="?", default=default_pool, help=f"{_PATH_HELP} (default {default_pool})")


# ---------------------------------------------------------------------------------------------
# parser


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``cxlkv: error:`` style for bad arguments (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


_NODE_HELP = "node id, as listed by 'pool info' (1..the pool's max_nodes)"

_FOREIGN_HELP = (
    "accept a pool owned by another user or writable by others (that user can read and corrupt every block)"
)
