"""Every error cxlkv raises, and the one table of the ``cxlkv`` command's exit codes.

The pool errors are the core's (src/core/errors.h), bound one to one by the extension; OS errors
stay Python's built-ins (``FileNotFoundError``, ``PermissionError``...); a bad argument is a
``ValueError``. One type per condition: callers branch on the type, never on the message. :class:`CommandError` is
what the tools (benchmarks, demos, their worker processes) and the CLI raise for a failure worth
one line rather than a traceback; the CLI turns it into its exit code. It lives here, below the
tools and the CLI, so that neither has to import the other to raise or catch it.
"""

from __future__ import annotations

import enum

from ._core import (
    ClosedError,
    CxlkvError,
    FencedError,
    ForkedError,
    HostSlotBusyError,
    LayoutMismatchError,
    LockTimeoutError,
    NamespaceTableFullError,
    NodeTableFullError,
    PoolCorruptError,
    PoolFormatError,
    PoolInUseError,
    PoolNotReadyError,
    PoolTruncatedError,
    PoolVersionError,
    QuotaTableFullError,
    ReadOnlyError,
)

__all__ = [
    "ClosedError",
    "CommandError",
    "CxlkvError",
    "ExitCode",
    "FencedError",
    "ForkedError",
    "HostSlotBusyError",
    "LayoutMismatchError",
    "LockTimeoutError",
    "NamespaceTableFullError",
    "NodeTableFullError",
    "PinSlotsFullError",
    "PoolCorruptError",
    "PoolFormatError",
    "PoolFullError",
    "PoolInUseError",
    "PoolNotReadyError",
    "PoolTruncatedError",
    "PoolVersionError",
    "QuotaTableFullError",
    "ReadOnlyError",
    "SequenceConflictError",
    "SequenceMissError",
    "UntrustedModelNameError",
    "WeightPathError",
    "exit_codes_text",
]


class ExitCode(enum.IntEnum):
    """The exit codes of ``cxlkv``. Their meanings are :data:`EXIT_CODE_MEANINGS`, which the CLI
    help, the README and docs/API.md quote (a test holds them to it)."""

    OK = 0
    CHECK_FAILED = 1
    ERROR = 2
    INTERNAL = 70  # EX_SOFTWARE: a bug in cxlkv (an unexpected exception, traceback printed)
    INTERRUPTED = 130


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok",
    ExitCode.CHECK_FAILED: (
        "a check failed: `pool check` found an inconsistency, `pool reap` found the node alive, "
        "`pool ping` got no answer, a benchmark or the demo read back wrong bytes"
    ),
    ExitCode.ERROR: "bad input, a pool that cannot be opened, or a command that failed",
    ExitCode.INTERNAL: "a bug in cxlkv (an unexpected exception; its traceback is printed)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_codes_text() -> str:
    """``Exit codes: 0 ok, 1 ..., 2 ..., 130 ...``: one line, for help texts and docs."""
    return "Exit codes: " + "; ".join(f"{int(c)} {m}" for c, m in EXIT_CODE_MEANINGS.items()) + "."


class CommandError(Exception):
    """A command failed in a way worth one line, not a traceback (a worker died, a pool too small
    for a benchmark, wrong bytes read back). ``detail`` (e.g. a worker's traceback) is printed
    only with ``CXLKV_DEBUG=1``; ``exit_code`` is an :class:`ExitCode` (``ERROR`` unless the
    failure is a failed check)."""

    def __init__(self, message: str, detail: str = "", exit_code: ExitCode = ExitCode.ERROR):
        super().__init__(message)
        self.detail = detail
        self.exit_code = ExitCode(exit_code)


# ClosedError (bound by the core, a CxlkvError and a RuntimeError) is the one "used after close()"
# type: the pool's own and that of every Python object of cxlkv (pool sessions, backends).


class SequenceMissError(CxlkvError):
    """Token store: rows asked for are not in the pool as written: the sequence (or a chunk of it)
    is absent, was evicted or overwritten, or a row failed its hash. The rows of ``out`` are not
    valid."""


class SequenceConflictError(CxlkvError):
    """Token store: an append found that another writer (another process or handle) extended the
    sequence since this one last saw it. The append stopped at the chunk where it found the other
    writer's version (normally its first: nothing stored). One writer per sequence; appending
    again resumes from what the pool holds."""


class PinSlotsFullError(CxlkvError):
    """Token store: a refresh could pin only some of a sequence's present blocks: this process's
    pin slots are exhausted (create the pool with more ``pin_slots``, or release leases)."""


class PoolFullError(CxlkvError):
    """Token store: an append could not store a block: the pool is full and nothing can be
    evicted."""


class WeightPathError(ValueError):
    """A model's weight or config file that the identity will not read: a symlink whose target
    leaves the model directory (or, for a Hugging Face hub snapshot, the repo's ``blobs/``), or
    something other than a regular file (a FIFO or device would block or never end). Hashing it
    would let whoever can plant a link in a model directory make the connector read any file its
    user can (its digest lands in a cache file beside the model)."""


class UntrustedModelNameError(ValueError):
    """An LMCache object key whose model field is a name (what the engine's operator typed), not
    the identity a cxlkv client derived from the weights and KV configuration: the LMCache server
    cannot know which bytes a name stood for in the engine, so such KV is never stored or loaded."""
