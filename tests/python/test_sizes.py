"""Table tests of cxlkv.sizes: parse_size (units, case, spaces, fractions, bad input) and
format_size (unit boundaries, rounding carry, negatives, huge values), and their round trips."""

from __future__ import annotations

import numpy as np
import pytest

from cxlkv.sizes import format_size, parse_size

KiB, MiB, GiB, TiB, PiB = (1 << 10), (1 << 20), (1 << 30), (1 << 40), (1 << 50)

PARSE_OK = [
    # bytes
    ("0", 0),
    ("123", 123),
    ("123B", 123),
    ("123 b", 123),
    # IEC, every spelling and case
    ("1KiB", KiB),
    ("1kib", KiB),
    ("1KIB", KiB),
    ("1Ki", KiB),
    ("1K", KiB),
    ("1k", KiB),
    ("64MiB", 64 * MiB),
    ("64Mi", 64 * MiB),
    ("64M", 64 * MiB),
    ("64mib", 64 * MiB),
    ("4GiB", 4 * GiB),
    ("4G", 4 * GiB),
    ("4gi", 4 * GiB),
    ("2TiB", 2 * TiB),
    ("2T", 2 * TiB),
    ("3PiB", 3 * PiB),
    ("3P", 3 * PiB),
    # SI
    ("1kB", 1000),
    ("1KB", 1000),
    ("2MB", 2_000_000),
    ("2GB", 2_000_000_000),
    ("5TB", 5 * 10**12),
    ("1PB", 10**15),
    # spaces: around the number and between number and unit
    ("  4GiB  ", 4 * GiB),
    ("4 GiB", 4 * GiB),
    ("4\tGiB", 4 * GiB),
    ("\n512 KiB\n", 512 * KiB),
    # fractions that are whole numbers of bytes
    ("1.5KiB", 1536),
    ("0.5MiB", 512 * KiB),
    (".5K", 512),
    ("2.", 2),
    ("2.0", 2),
    ("1.5kB", 1500),
    ("0.25GiB", GiB // 4),
    # leading zeros
    ("007", 7),
    ("0008MiB", 8 * MiB),
    # huge values: Python ints, no overflow
    ("1024PiB", 1 << 60),
    ("16384PiB", 1 << 64),
    ("99999999999999999999999", 99999999999999999999999),
]


@pytest.mark.parametrize("text,expected", PARSE_OK)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", [0, 1, 4096, 1 << 64, np.int64(4096), np.uint32(7)])
def test_parse_size_passes_integers_through(value):
    assert parse_size(value) == int(value)
    assert type(parse_size(value)) is int


PARSE_BAD = [
    ("", "expected a number"),
    ("   ", "expected a number"),
    ("GiB", "expected a number"),
    ("4 G i B", "expected a number"),
    ("1e9", "expected a number"),
    ("0x100", "expected a number"),
    ("4XB", "unknown unit"),
    ("4EiB", "unknown unit"),  # exa is not accepted on input
    ("4 bytes", "unknown unit"),
    ("1,5GiB", "expected a number"),
    ("1.5", "not a whole number of bytes"),
    ("0.1KiB", "not a whole number of bytes"),
    ("1.0001kB", "not a whole number of bytes"),
    ("-1", "must not be negative"),
    (" -4GiB", "must not be negative"),
    ("+4GiB", "expected a number"),
    ("4GiB4", "expected a number"),
    ("nan", "expected a number"),
    ("inf", "expected a number"),
]


@pytest.mark.parametrize("text,message", PARSE_BAD)
def test_parse_size_rejects_with_a_message_naming_the_input(text, message):
    with pytest.raises(ValueError, match=message) as ei:
        parse_size(text)
    assert repr(text) in str(ei.value)


@pytest.mark.parametrize(
    "value,message",
    [
        (-1, "must not be negative"),
        (True, "invalid size True"),
        (False, "invalid size False"),
        (None, "expected an int or a string"),
        (1.5, "expected an int or a string"),
        (b"4GiB", "expected an int or a string"),
        (np.int64(-5), "must not be negative"),
    ],
)
def test_parse_size_rejects_non_sizes(value, message):
    with pytest.raises(ValueError, match=message):
        parse_size(value)


FORMAT = [
    (0, "0 B"),
    (1, "1 B"),
    (1023, "1023 B"),
    (1024, "1.0 KiB"),
    (1536, "1.5 KiB"),
    (1025, "1.0 KiB"),
    (MiB - 1, "1.0 MiB"),  # 1023.999 KiB rounds up: carried into the next unit
    (MiB - 52, "1023.9 KiB"),
    (MiB, "1.0 MiB"),
    (360 * KiB, "360.0 KiB"),
    (4 * GiB, "4.0 GiB"),
    (TiB, "1.0 TiB"),
    (PiB, "1.0 PiB"),
    (1 << 60, "1.0 EiB"),
    (1 << 70, "1024.0 EiB"),  # past the last unit: stays in EiB, no index error
    (-1, "-1 B"),
    (-2048, "-2.0 KiB"),
    (-(4 * GiB), "-4.0 GiB"),
]


@pytest.mark.parametrize("n,text", FORMAT)
def test_format_size(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize(
    "n,precision,text",
    [
        (1536, 0, "2 KiB"),
        (1536, 3, "1.500 KiB"),
        (GiB + GiB // 3, 2, "1.33 GiB"),
        (MiB - 1, 2, "1.00 MiB"),
        (MiB - 1, 3, "1023.999 KiB"),
    ],
)
def test_format_size_precision(n, precision, text):
    assert format_size(n, precision) == text


def test_format_size_accepts_numpy_integers():
    assert format_size(np.int64(4 * GiB)) == "4.0 GiB"


@pytest.mark.parametrize(
    "n", [0, 1, 1023, KiB, 1536, 360 * KiB, 64 * MiB, 3 * GiB // 2, 4 * GiB, TiB, 2 * PiB]
)
def test_round_trip_format_then_parse(n):
    """Sizes that format exactly (a whole number of tenths of a unit) parse back to themselves."""
    text = format_size(n)
    assert parse_size(text.replace(" ", "")) == n
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["4GiB", "64MiB", "512KiB", "1.5GiB", "123", "2TiB"])
def test_round_trip_parse_then_format(text):
    n = parse_size(text)
    assert parse_size(format_size(n)) == n
