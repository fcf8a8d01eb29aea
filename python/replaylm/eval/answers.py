"""Numbers in model output and in references: find them and read them as exact `Decimal`s.

Text is normalised first (NFKC, so full-width digits and colons become ASCII; every Unicode
decimal digit, e.g. Bengali or Thai, becomes its ASCII digit). A number may carry a sign and a
`$` ("-$5"); a minus right after a word character or ")" is an operator, not a sign ("5-3").
Two digit conventions:

- English (`decimal_comma=False`): "," groups thousands, "." is the decimal point
  ("1,234.5"; "1,2,3" is three numbers).
- Decimal comma (`decimal_comma=True`, e.g. German): ".", "," or a space before exactly three
  digits groups thousands ("70.000", "70 000", and the English "70,000"); any other "," or "."
  is the decimal point ("2,5", "2.5", "1.234,5").
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal

_SIGN = r"(?P<sign>(?<![\w)])[-\u2212]\$?)?"
_ENGLISH = re.compile(
    _SIGN + r"(?P<int>[1-9][0-9]{0,2}(?:,[0-9]{3}(?![0-9]))+|[0-9]+)(?:\.(?P<frac>[0-9]+))?"
)
_DECIMAL_COMMA = re.compile(
    _SIGN + r"(?P<int>[1-9][0-9]{0,2}(?:[., ][0-9]{3}(?![0-9]))+|[0-9]+)(?:[.,](?P<frac>[0-9]+))?"
)


def normalise(text: str) -> str:
    """NFKC, then every non-ASCII decimal digit replaced by its ASCII digit."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(
        str(unicodedata.decimal(c)) if c.isdecimal() and not c.isascii() else c for c in text
    )


def find_numbers(text: str, decimal_comma: bool = False) -> list[Decimal]:
    """Every number in `text`, in order of appearance."""
    pattern = _DECIMAL_COMMA if decimal_comma else _ENGLISH
    numbers = []
    for m in pattern.finditer(normalise(text)):
        digits = re.sub(r"[., ]", "", m["int"])
        if m["frac"]:
            digits += "." + m["frac"]
        numbers.append(-Decimal(digits) if m["sign"] else Decimal(digits))
    return numbers


def last_number(text: str, decimal_comma: bool = False) -> Decimal | None:
    """The last number in `text`, or None when it has none."""
    numbers = find_numbers(text, decimal_comma)
    return numbers[-1] if numbers else None


def parse_reference(text: str) -> Decimal:
    """A reference answer written as one English-convention number ("2,125", "-3", "0.5");
    ValueError for anything else."""
    m = _ENGLISH.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a number: {text!r}")
    return find_numbers(m[0])[0]
