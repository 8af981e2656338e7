"""The CLI's exit-code contract, in process (no pool, no subprocess; well under a second):
every kind of error a command can raise maps to its documented code and one stderr line, and the
documented table (README, ``cxlkv --help``) is exactly :data:`cxlkv.errors.EXIT_CODE_MEANINGS`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cxlkv
from cxlkv import cli
from cxlkv.cli import parser as cli_parser
from cxlkv.cli import parser_pool
from cxlkv.errors import EXIT_CODE_MEANINGS, CommandError, ExitCode, exit_codes_text

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (CommandError("a worker died"), ExitCode.ERROR, "cxlkv: error: a worker died"),
        (
            CommandError("wrong bytes", exit_code=ExitCode.CHECK_FAILED),
            ExitCode.CHECK_FAILED,
            "cxlkv: error: wrong bytes",
        ),
        (ValueError("bad size '4XiB'"), ExitCode.ERROR, "cxlkv: error: bad size '4XiB'"),
        (
            FileNotFoundError(2, "No such file or directory", "/nonexistent/pool"),
            ExitCode.ERROR,
            "cxlkv: error: /nonexistent/pool: No such file or directory",
        ),
        (
            cxlkv.PoolCorruptError("offset out of range\nsecond line"),
            ExitCode.ERROR,
            "cxlkv: error: offset out of range second line",
        ),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED, "cxlkv: interrupted"),
    ],
)
def test_errors_map_to_their_exit_code_and_one_line(monkeypatch, capsys, exc, code, line):
    def command(args):
        raise exc

    monkeypatch.setattr(parser_pool, "cmd_pool_info", command)
    monkeypatch.delenv("CXLKV_DEBUG", raising=False)
    assert cli.main(["pool", "info", "/nonexistent/pool"]) == code
    err = capsys.readouterr().err
    assert err.strip() == line, err


def test_a_bug_exits_70_with_its_traceback_never_1(monkeypatch, capsys):
    """1 means "a check failed"; an unexpected exception must not be mistaken for it."""

    def command(args):
        raise RuntimeError("an unexpected bug")

    monkeypatch.setattr(parser_pool, "cmd_pool_stats", command)
    assert cli.main(["pool", "stats", "/nonexistent/pool"]) == ExitCode.INTERNAL == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: an unexpected bug" in err


def test_debug_adds_the_traceback_keeps_the_code(monkeypatch, capsys):
    def command(args):
        raise CommandError("a worker died", detail="worker traceback here")

    monkeypatch.setattr(parser_pool, "cmd_pool_check", command)
    monkeypatch.setenv("CXLKV_DEBUG", "1")
    assert cli.main(["pool", "check", "/nonexistent/pool"]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and "worker traceback here" in err
    assert err.rstrip().splitlines()[-2] == "cxlkv: error: a worker died"


def test_usage_errors_and_help_codes(capsys):
    assert cli.main(["pool", "create"]) == ExitCode.ERROR  # --size is required
    assert "error:" in capsys.readouterr().err
    assert cli.main(["--help"]) == ExitCode.OK


def test_the_documented_table_is_the_code_table():
    text = README.read_text()
    rows = {int(c): m.strip() for c, m in re.findall(r"^\| (\d+) \| (.+?) \|$", text, re.M)}
    assert rows == {int(c): m for c, m in EXIT_CODE_MEANINGS.items()}, (
        "README's exit-code table differs from cxlkv.errors.EXIT_CODE_MEANINGS"
    )
    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)
    epilog = " ".join((cli.build_parser().epilog or "").split())
    assert exit_codes_text() in epilog


def test_create_help_shows_the_cores_defaults_and_limits(capsys):
    cli.main(["pool", "create", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    opts = cxlkv.create_options()
    for name in ("max_nodes", "max_namespaces", "lease_ms"):
        o = opts[name]
        assert f"{o['min']}..{o['max']} (default {o['default']})" in out, (name, out)
    assert f"(default {opts['backend']['default']})" in out


def _leaf_commands(parser, prefix=()) -> list[tuple[str, ...]]:
    """Every runnable command of the argparse tree, e.g. ("pool", "create"), ("demo",)."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [leaf for name, p in subs[0].choices.items() for leaf in _leaf_commands(p, (*prefix, name))]


def test_every_command_has_a_smoke_test():
    """CI runs every command at least once (tests/python/test_cli_smoke.py): a command added to
    the parser without a smoke test fails here, naming it."""
    smoke = (Path(__file__).parent / "test_cli_smoke.py").read_text()
    leaves = _leaf_commands(cli.build_parser())
    assert ("pool", "create") in leaves and ("demo",) in leaves
    missing = [" ".join(c) for c in leaves if ", ".join(f'"{w}"' for w in c) + "," not in smoke]
    assert not missing, f"commands without a smoke test in test_cli_smoke.py: {missing}"


def test_create_help_lists_every_backend_and_lock_hosts(capsys):
    """Each backend the core knows is named and explained (a new one needs its line in
    parser.BACKEND_HELP); --lock-hosts shows the core's range."""
    assert set(cli_parser.BACKEND_HELP) == set(cxlkv._core.backends())
    cli.main(["pool", "create", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, line in cli_parser.BACKEND_HELP.items():
        assert f"{name}: {' '.join(line.split())}" in out, name
    o = cxlkv.create_options()["lock_hosts"]
    assert "--lock-hosts" in out and f"{o['min']}..{o['max']} (default {o['default']})" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pool", "ping", str(2**32), "/nonexistent/pool"], "out of range 1..254"),
        (["pool", "reap", str(2**64), "/nonexistent/pool"], "out of range 1..254"),
        (["pool", "reap", "0", "/nonexistent/pool"], "must be positive"),
        (
            ["pool", "create", "/nonexistent/pool", "--size", "16MiB", "--stripe-size", "0"],
            "0 is not a stripe size",
        ),
        (
            ["pool", "create", "/nonexistent/pool", "--size", "16MiB", "--lock-hosts", "65"],
            "out of range 1..64",
        ),
    ],
)
def test_bad_values_are_usage_errors_before_any_pool_is_touched(capsys, argv, message):
    assert cli.main(argv) == ExitCode.ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("cxlkv"), err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--stripe-size", "2MiB"], "--stripe-size is only meaningful for a pool of several devices"),
        (["--lock-hosts", "4"], "--lock-hosts only goes with --backend multihost"),
        (["--lock-hosts", "4", "--backend", "flush"], "--lock-hosts only goes with --backend multihost"),
    ],
)
def test_create_options_that_do_not_apply_are_refused(capsys, extra, message):
    assert cli.main(["pool", "create", "/nonexistent/dir/pool", "--size", "16MiB", *extra]) == ExitCode.ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"cxlkv: error: {message}") and "\n" not in err, err


def test_check_has_repair():
    args = cli.build_parser().parse_args(["pool", "check", "/p", "--repair"])
    assert args.repair is True
    assert cli.build_parser().parse_args(["pool", "check", "/p"]).repair is False


def test_reap_wait_is_bounded_and_every_doc_says_so(capsys):
    """`pool reap --wait` without SECONDS watches three leases (cmd_pool_reap), never "until it
    dies" unbounded: the help and every document that describes the flag say the bound."""
    args = cli.build_parser().parse_args(["pool", "reap", "1", "/dev/shm/x", "--wait"])
    assert args.wait == 0.0  # the const cmd_pool_reap turns into three leases
    cli.main(["pool", "reap", "--help"])
    assert "three leases" in " ".join(capsys.readouterr().out.split())
    root = README.parent
    described = 0
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        text = " ".join(doc.read_text().replace("#", " ").split())
        for m in re.finditer(r"--wait\b", text):
            if "reap" not in text[max(0, m.start() - 200) : m.start()]:
                continue  # another command's --wait
            described += 1
            window = text[m.start() : m.start() + 250]
            assert "three leases" in window, f"{doc.name}: reap --wait without its bound: {window!r}"
    assert described >= 2
