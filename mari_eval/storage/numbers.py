"""Every number a user gives, read one way (issue 83.2): ``read_number``.

Model args (``--model_args rho=0.5``), ``--set`` values, command-line flags, CSV fields, layer
numbers in GGUF and SteeringVector keys, ``combine`` weights, ``positions=`` and ``layers=`` all
come here, so one rule holds for all of them. Python's ``int()`` and ``float()`` are not that rule:
they read "3_0" as 30, Arabic-Indic "٣" as 3, "1e400" as infinity and " 2 " as 2. Here a number is

* ASCII digits 0-9 only (a Unicode digit is refused, named by its code point), with an optional
  sign, and no underscore;
* a decimal point or an exponent only where a float is meant (``integer=False``): an integer
  written "3.0" or "1e3" is refused, never rounded;
* finite ("inf", "nan", and what overflows a float, such as 1e400, are refused);
* within ``lo`` .. ``hi`` when given (each bound closed unless ``lo_open``/``hi_open``).

A Python number given as such (lm-eval's model args from Python, JSON values) passes the same
checks: a bool is not a number, a float is an integer only when whole. A refusal is a
``NumberError`` (a ValueError) naming the input (``name``: the option, flag, file and row) and
the fix. This module imports nothing of the project: it sits at the bottom of the import graph.
"""

from __future__ import annotations

import argparse
import math
import numbers
import re
import unicodedata
from typing import Any

INTEGER = re.compile(r"[+-]?[0-9]+")
FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


# Text that is meant as a number, well written or not: digits of any script, underscores, a point, an
# exponent, a sign; or infinity and NaN. Where text may be a number or a name (a ``--set`` value, the part of
# a ``combine`` term after its last colon), what matches is read by ``read_number``, never kept as a name.
MEANT_AS_NUMBER = re.compile(r"[+-]?(?:[\d_.]*\d[\d_.]*(?:[eE][+-]?[\d_]+)?|inf|infinity|nan)", re.IGNORECASE)


def meant_as_number(text: str) -> bool:
    """Whether ``text`` (stripped) is written as a number, well or badly (``MEANT_AS_NUMBER``)."""
    return MEANT_AS_NUMBER.fullmatch(text.strip()) is not None


class NumberError(ValueError):
    """A number a user gave that is not read: the message names the input and the fix; ``why`` is the
    reason alone (for a caller that words the rest itself)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def _range(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}" + (" (bounds excluded)" if lo_open or hi_open else "")
    if lo is not None:
        return f" {'above' if lo_open else 'of at least'} {lo}"
    if hi is not None:
        return f" {'below' if hi_open else 'of at most'} {hi}"
    return ""


def _text_reason(text: str, integer: bool) -> str | None:
    """Why ``text`` (stripped) is not a number of the kind asked for, or None when it is one."""
    if not text:
        return "it is empty: an unset shell variable?"
    odd = next((c for c in text if not c.isascii()), None)
    if odd is not None:
        kind = "a digit" if unicodedata.category(odd) == "Nd" else "a character"
        return f"{odd!r} is U+{ord(odd):04X} {unicodedata.name(odd, '(unnamed)')}, {kind} outside ASCII"
    if "_" in text:
        return "it holds an underscore, which Python would skip: 1_0 as 10"
    if (INTEGER if integer else FLOAT).fullmatch(text):
        return None
    if integer and FLOAT.fullmatch(text):
        return "a decimal point or an exponent where a whole number is meant: it is never rounded"
    if text.lstrip("+-").lower() in ("inf", "infinity", "nan"):
        return "infinity and NaN are not read"
    return "its form is not that of a number"


def read_number(value: Any, name: str = "", *, integer: bool = False, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False, where: str = "", example: str | None = None) -> int | float:
    """``value`` (text as typed, or a Python number) read as an int (``integer``) or a float under the
    rules of the module docstring. A ``NumberError`` names it as ``{name}{value!r} {where}`` (a ``name``
    ending in "=" is joined to the value: "rho='2' in --model_args"; any other is followed by a space:
    "data.csv, row 3: feature_index '٣'") and says what to give (``example`` when given)."""
    shown = f"{name}{'' if not name or name.endswith('=') else ' '}{value!r}{' ' + where if where else ''}"
    noun = "an integer" if integer else "a number"
    rule = "numbers are written in the digits 0-9 with an optional sign" + ("" if integer else ", decimal point and exponent")
    eg = f": e.g. {example}" if example else ""

    def refuse(why: str, finite: bool = False) -> NumberError:
        return NumberError(f"{shown} is not {'a finite number' if finite else noun}{eg} ({why}; {rule})", f"{why}; {rule}")

    if isinstance(value, bool):
        raise refuse("a truth value is not a number")
    if isinstance(value, str):
        text = value.strip()
        reason = _text_reason(text, integer)
        if reason is not None:
            raise refuse(reason, finite=reason.startswith("infinity") and not integer)
        number: int | float = int(text) if integer else float(text)
        if not math.isfinite(number):  # the text passed the grammar: it overflows
            raise refuse("it overflows a float", finite=True)
    elif isinstance(value, numbers.Integral):
        number = int(value) if integer else float(value)
    elif isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise refuse("infinity and NaN are not read", finite=not integer)
        if integer and not number.is_integer():
            raise refuse("it is not whole, and it is never rounded")
        number = int(number) if integer else number
    else:
        raise refuse(f"it is a {type(value).__name__}")
    below = lo is not None and (number < lo or (lo_open and number == lo))
    above = hi is not None and (number > hi or (hi_open and number == hi))
    if below or above:
        wanted = f"{noun}{_range(lo, hi, lo_open, hi_open)}"
        raise NumberError(f"{shown} is out of range: give {wanted}" + (f", e.g. {example}" if example else ""),
                          f"it is not {wanted}")
    return number


def flag_type(integer: bool = False, lo: float | None = None, hi: float | None = None):
    """An argparse ``type`` reading a flag's value with ``read_number``; argparse prints "argument --FLAG: "
    before the reason."""
    def parse(text: str) -> int | float:
        try:
            return read_number(text, integer=integer, lo=lo, hi=hi)
        except NumberError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "integer" if integer else "number"
    return parse
