"""The ``cxlkv`` command line: pool administration, benchmarks and the demo.

    cxlkv pool create [PATH] --size 4GiB [--chunk-size 8MiB] [--index-slots N] [--max-nodes N]
                           [--max-namespaces N] [--pin-slots N] [--backend coherent|flush|multihost]
                           [--lock-hosts N] [--stripe-size 2MiB] [--lease-ms MS]
                           [--force [--ignore-attached]]
    cxlkv pool info    [PATH] [--json]      read-only: needs no write access, takes no node slot;
                                            header, geometry, namespaces, nodes and their liveness
    cxlkv pool stats   [PATH] [--json]
    cxlkv pool check   [PATH] [--repair] [--json]   exit 1 when an inconsistency is left
                                            (--repair: also releases what nobody else will)
    cxlkv pool reap    NODE [PATH] [--force] [--json]   reclaim one dead node (--force: even a live one)
    cxlkv pool destroy [PATH] [--ignore-attached] [--force]
    (pool commands refuse a pool owned or writable by another user unless --allow-foreign-owner;
    PATH defaults to $CXLKV_POOL, else /dev/shm/cxlkv-<uid>/pool: the pool the library opens)
    cxlkv bench copy   [--json] [--geometry llama3-8b|smollm2-135m|all] [--iters N]
    cxlkv bench index  [--procs N[,N...]] [--json] [--ops N]
    cxlkv bench vllm   [--model smollm2|tiny] [--contexts N] [--turns N] [--json]   (needs vLLM)
    cxlkv bench serve  [--model M] [--instances N] [--concurrency 1,4,8] [--configs single,plain,cxlkv,nocoalesce,lmcache]
                       [--dataset prefix_repetition|multiturn] [--num-prompts N] [--plot DIR] [--json]
    cxlkv demo         [--procs N] [--seconds S] [--pool PATH] [--json] | --vllm    (--vllm needs vLLM)

Exit codes: :data:`cxlkv.errors.EXIT_CODE_MEANINGS` (printed by ``cxlkv --help``).
Every cxlkv error, OS error and :class:`~cxlkv.errors.CommandError` is reported as one line
``cxlkv: error: <message>`` on stderr (set ``CXLKV_DEBUG=1`` to get the traceback as well).

The package is the top layer: ``parser`` (the command tree), ``commands`` (one function per
command), ``render`` (tables and JSON); this module dispatches and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from cxlkv.errors import CommandError, CxlkvError, ExitCode

from .parser import build_parser
from .render import no_controls

__all__ = ["CommandError", "build_parser", "format_error", "main"]


def format_error(e: BaseException) -> str:
    """One line describing an error: OS errors as 'path: reason', cxlkv errors by their message."""
    if isinstance(e, OSError) and e.strerror:
        msg = e.strerror
        if e.filename is not None:
            msg = f"{os.fsdecode(e.filename)}: {msg}"
            if getattr(e, "filename2", None) is not None:
                msg += f" -> {os.fsdecode(e.filename2)}"
    else:
        msg = str(e)
        if isinstance(e, KeyError) and len(e.args) == 1:
            msg = str(e.args[0])
        if not msg:
            msg = type(e).__name__
    msg = " ".join(line.strip() for line in msg.splitlines() if line.strip())
    return no_controls(msg)


# Errors reported as one line: the library's, the OS's (path: reason) and bad values.
_ONE_LINE_ERRORS: tuple[type[BaseException], ...] = (CxlkvError, OSError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Run the ``cxlkv`` command line; returns the exit code (:class:`~cxlkv.errors.ExitCode`)."""
    return int(_dispatch(argv))


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, bad arguments
        code = e.code
        return code if isinstance(code, int) else (ExitCode.OK if code is None else ExitCode.ERROR)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        print("cxlkv: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `cxlkv pool stats | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return ExitCode.OK
    except CommandError as e:
        _traceback_if_debug()
        print(f"cxlkv: error: {format_error(e)}", file=sys.stderr)
        if e.detail and os.environ.get("CXLKV_DEBUG"):
            print(e.detail.rstrip(), file=sys.stderr)
        return e.exit_code
    except ImportError as e:
        _traceback_if_debug()
        print(f"cxlkv: error: cannot import {e.name or 'a module'}: {format_error(e)}", file=sys.stderr)
        return ExitCode.ERROR
    except _ONE_LINE_ERRORS as e:
        _traceback_if_debug()
        print(f"cxlkv: error: {format_error(e)}", file=sys.stderr)
        return ExitCode.ERROR
    except Exception:  # noqa: BLE001 - a bug: the whole traceback, and a code no expected outcome uses
        traceback.print_exc()
        return ExitCode.INTERNAL


def _traceback_if_debug() -> None:
    if os.environ.get("CXLKV_DEBUG"):
        traceback.print_exc()
