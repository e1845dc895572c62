"""Sizes as people write them, in binary units everywhere (the CLI and extra_config alike).

'4096', '64k', '512MiB', '1.5g', '10GiB', '4096B': k/m/g/t/p and KiB/MiB/GiB/TiB/PiB are powers of
1024. '10GB' is refused: it reads as decimal (10**10) but a disk tool may mean 10 GiB, 7 % apart,
so the message names both spellings that are exact. Throughput (GB/s) is printed in decimal.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = "binary units: k/m/g/t/p or KiB/MiB/GiB/TiB/PiB, powers of 1024 (e.g. 64k, 512MiB, 500g)"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?b)?|(b))?\s*$", re.I)
_DIGITS_MAX = 4000  # Python refuses int() of more digits (sys.get_int_max_str_digits); say why instead


def parse_size(text) -> int:
    """Bytes from an int or a string with an optional binary unit; ValueError names the rule."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size; give bytes or a number with {UNITS}")
    if isinstance(text, int):
        return text
    s = str(text)
    m = _SIZE_RE.match(s)
    if not m or len(m.group(1)) > _DIGITS_MAX:
        raise ValueError(f"{s[:80]!r} is not a size; give bytes or a number with {UNITS}")
    unit, suffix = (m.group(2) or "").lower(), (m.group(3) or "")
    if unit and suffix.lower() == "b":
        n = m.group(1)
        raise ValueError(f"{s.strip()!r} is ambiguous (decimal or binary?); sizes here are binary: write "
                         f"{n}{unit.upper()}iB or {n}{unit} ({format_bytes(_exact(n, unit))}), or give bytes")
    value = _exact(m.group(1), unit)
    if value.denominator != 1:
        raise ValueError(f"{s.strip()!r} is not a whole number of bytes ({float(value):.1f}); {UNITS}")
    return int(value)


def _exact(number: str, unit: str) -> Fraction:
    return Fraction(number) * (1 << (10 * " kmgtp".index(unit or " ")))  # exact: no float rounding


def format_bytes(n) -> str:
    """'10737418240 bytes = 10 GiB' style: the exact count and its largest whole-ish binary unit."""
    n = int(n)
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes = {n / (1 << shift):.4g} {unit}"
    return f"{n} bytes"
