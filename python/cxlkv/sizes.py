"""Human-readable byte sizes: ``parse_size("4GiB") == 4 << 30``, ``format_size(4 << 30) == "4.0 GiB"``.

Accepted suffixes (case-insensitive, optional space between number and suffix):

* IEC, powers of 1024: ``KiB MiB GiB TiB PiB`` (also ``Ki Mi Gi Ti Pi``);
* SI, powers of 1000: ``kB MB GB TB PB``;
* bare letters ``K M G T P`` mean powers of 1024, as in ``truncate -s 1G`` / ``dd bs=1M``
  (a memory size written "1G" almost always means 1 GiB);
* ``B`` or nothing: bytes.

Fractions are allowed when the result is a whole number of bytes (``"1.5KiB"`` -> 1536).
"""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_IEC = {"": 1, "b": 1}
_SI: dict[str, int] = {}
for _i, _p in enumerate("kmgtp", start=1):
    _IEC[_p] = 1024**_i
    _IEC[_p + "i"] = 1024**_i
    _IEC[_p + "ib"] = 1024**_i
    _SI[_p + "b"] = 1000**_i
_UNITS = {**_IEC, **_SI}

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Parse a byte size such as ``"4GiB"``, ``"64MiB"``, ``"512KiB"``, ``"1G"``, ``"2GB"``, ``"123"``.

    Integers are returned unchanged (they must not be negative). Raises ``ValueError`` with a
    message naming the offending input otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected a number of bytes or a string like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value}: must not be negative")
        return value
    if not isinstance(value, str):
        # numpy integers and the like
        try:
            import operator

            return parse_size(operator.index(value))
        except TypeError:
            raise ValueError(f"invalid size {value!r}: expected an int or a string like '4GiB'") from None
    if value.strip().startswith("-"):
        raise ValueError(f"invalid size {value!r}: must not be negative")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit, e.g. "
            "'4GiB', '64MiB', '512KiB', '1G', '2GB' or '123'"
        )
    num, unit = m.group("num"), m.group("unit").lower()
    mult = _UNITS.get(unit)
    if mult is None:
        raise ValueError(
            f"invalid size {value!r}: unknown unit {m.group('unit')!r} "
            "(use B, KiB, MiB, GiB, TiB, K, M, G, T, kB, MB, GB or TB)"
        )
    if "." in num:
        from fractions import Fraction

        exact = Fraction(num) * mult
        if exact.denominator != 1:
            raise ValueError(f"invalid size {value!r}: not a whole number of bytes")
        return int(exact)
    return int(num) * mult


_FORMAT_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]


def format_size(n: int, precision: int = 1) -> str:
    """Format a byte count with IEC units: ``format_size(4 << 30) == "4.0 GiB"``, ``format_size(123) == "123 B"``."""
    n = int(n)
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a < 1024:
        return f"{sign}{a} B"
    v = float(a)
    i = 0
    while v >= 1024 and i < len(_FORMAT_UNITS) - 1:
        v /= 1024
        i += 1
    # 1023.96 MiB would print as "1024.0 MiB": carry into the next unit instead
    if round(v, precision) >= 1024 and i < len(_FORMAT_UNITS) - 1:
        v /= 1024
        i += 1
    return f"{sign}{v:.{precision}f} {_FORMAT_UNITS[i]}"
