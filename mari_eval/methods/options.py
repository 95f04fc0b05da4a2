"""Evaluation options: what a method lets a user change at evaluation (lm-eval ``--model_args``),
each typed, parsed once and refused with its name when it does not fit.

A method lists its options in ``Intervention.option_fields`` (MARI: ``gate``, ``rho``,
``experts``, ``labels``; CAA, ITI and NL-ITI: ``scale``); ``parse_options`` turns the strings
lm-eval hands over into those types and refuses unknown names, naming the methods that do take
them, so a method's ``configure`` receives checked values only.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Any

from mari_eval.storage.numbers import flag_type, meant_as_number, read_number


@dataclass(frozen=True)
class Option:
    """One evaluation option: its type (bool, float, int or str) and what a valid value looks like."""

    kind: type
    example: str  # shown in errors, e.g. "rho=0.9"
    finite: bool = True  # kept for plugins that set it: every float option is finite (numbers.read_number)

    def parse(self, name: str, value: Any) -> Any:
        if self.kind is bool:
            return as_bool(value, name)
        if self.kind is float:
            return read_number(value, f"{name}=", where="in --model_args", example=self.example)
        if self.kind is int:
            return as_int(value, name, self.example)
        return str(value)


def as_int(value: Any, name: str, example: str) -> int:
    """``value`` as an integer, never truncated (``numbers.read_number``): lm-eval hands "2.7" over as the
    float 2.7, which int() would read as 2; an integral float (3.0) and a string of ASCII digits are integers."""
    return read_number(value, f"{name}=", integer=True, where="in --model_args", example=example)


def as_bool(value: Any, name: str) -> bool:
    """``value`` as lm-eval's model_args give it (a bool, 0/1 or a word) read as a bool, or a ValueError naming ``name``."""
    if isinstance(value, str):
        if value.strip().lower() in ("true", "on", "1", "yes"):
            return True
        if value.strip().lower() in ("false", "off", "0", "no"):
            return False
    elif isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}={value!r} in --model_args: use true or false")


def given(values: dict[str, Any]) -> dict[str, Any]:
    """The options actually set: lm-eval passes an unset one as None. An empty one (``scale=``: an
    unset shell variable in a sweep) is refused, never read as the bundle's default."""
    empty = [name for name, value in values.items() if isinstance(value, str) and not value.strip()]
    if empty:
        listed = ", ".join(f"{name}=" for name in empty)
        raise ValueError(f"{listed} in --model_args {'is' if len(empty) == 1 else 'are'} empty (an unset shell "
                         f"variable?): give {'a value' if len(empty) == 1 else 'values'}, or leave "
                         f"{'it' if len(empty) == 1 else 'them'} out for the bundle's own setting")
    return {k: v for k, v in values.items() if v is not None}


def parse_options(method: str, fields: dict[str, Option], values: dict[str, Any],
                  taken_by: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """``values`` converted to the types of ``fields``; names the method does not take are refused,
    with the methods that take them when ``taken_by`` ({option: [methods]}) names some."""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        takes = f"its options are {', '.join(sorted(fields))}" if fields else "it takes none"
        elsewhere = "".join(f"; {name} is an option of {', '.join(sorted(taken_by[name]))} bundles only"
                            for name in unknown if (taken_by or {}).get(name))
        raise ValueError(f"{', '.join(unknown)} in --model_args: not an option of {method} bundles ({takes}{elsewhere}); "
                         f"drop {'it' if len(unknown) == 1 else 'them'} from --model_args")
    return {name: fields[name].parse(name, value) for name, value in values.items()}


# argparse types of numeric flags (numbers.flag_type): a count of at least 1; any integer or number, their
# ranges checked where the values are used
positive_int, INTEGER_FLAG, NUMBER_FLAG = flag_type(integer=True, lo=1), flag_type(integer=True), flag_type()


def set_value(key: str, text: str) -> Any:
    """A ``mari-eval train --set KEY=VALUE`` value: JSON (``layers=[3,9]``, ``single=true``) with its numbers
    read by ``read_number`` (NaN, Infinity and what overflows refused), else the text itself; text that starts
    as a number (``1_0``, ``٣``, ``.5``) is read as one, never kept as a string."""
    def constant(word: str) -> float:
        return read_number(word, f"--set {key}=")  # NaN, Infinity: refused, naming the key

    try:
        return json.loads(text, parse_float=lambda t: read_number(t, f"--set {key}="), parse_constant=constant)
    except json.JSONDecodeError:
        pass
    if meant_as_number(text):  # "1_0", "٣", ".5": read as a number (or refused), never kept as text
        return read_number(text, f"--set {key}=", integer=not re.search(r"[.eE]|inf|nan", text, re.IGNORECASE))
    return text


# The seeds every part of the code can take: scikit-learn's and NumPy's legacy random_state hold 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1


def seed(text: Any) -> int:
    """A command line's seed (``--seed``, ``--seeds``) as an integer in 0 .. MAX_SEED: a ValueError for
    what is not an integer (argparse: "invalid seed value"), an ``argparse.ArgumentTypeError`` naming the
    range for one outside it (argparse prints its message)."""
    number = read_number(text, "seed", integer=True)
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed {number} is out of range: give 0 to {MAX_SEED} (the seeds NumPy's and "
                                         "scikit-learn's random states take)")
    return number
