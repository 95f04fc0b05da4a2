"""The field types a benchmark record is checked with (``mari_eval.benchmarks.data_schema`` builds the
schemas from them): each one's ``problem(value, path)`` is None when the value fits, else a
``Bad`` naming the field path, what was expected and what was found."""

from __future__ import annotations

from typing import Any


class Bad(Exception):
    """One field of one record is wrong: where (a path such as ``mc1_targets.labels[2]``), what was expected.

    ``found`` says what was there instead; when None, the message shows ``value``.
    """

    def __init__(self, field: str, expected: str, value: Any = None, found: str | None = None):
        super().__init__(field)
        self.field, self.expected, self.value, self.found = field, expected, value, found


class Scalar:
    """A field type tested by ``fits(value)``; ``expected`` and ``plural`` describe it in messages."""

    expected = plural = ""

    def fits(self, v: Any) -> bool:
        raise NotImplementedError

    def problem(self, v: Any, path: str) -> Bad | None:
        return None if self.fits(v) else Bad(path, self.expected, v)


class Text(Scalar):
    expected, plural = "a non-blank string", "non-blank strings"

    def fits(self, v: Any) -> bool:
        return type(v) is str and v != "" and not v.isspace()


class Str(Scalar):
    expected, plural = "a string", "strings"

    def fits(self, v: Any) -> bool:
        return type(v) is str


TEXT, STR = Text(), Str()


class Int(Scalar):
    """An integer in lo..hi (either bound may be None). A JSON true is a bool, never the integer 1."""

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi
        span = "" if lo is None and hi is None else f" >= {lo}" if hi is None else f" in {lo}..{hi}"
        self.expected, self.plural = f"an integer{span}", f"integers{span}"

    def fits(self, v: Any) -> bool:
        return (type(v) is int  # not isinstance: bool is a subclass of int
                and (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi))


class OneOf(Scalar):
    """One of a few strings."""

    def __init__(self, *values: str):
        self.values = frozenset(values)
        self.expected = "one of " + ", ".join(map(repr, values))

    def fits(self, v: Any) -> bool:
        return type(v) is str and v in self.values


class ListOf:
    """A list of at least ``min_len`` values of the type ``item`` (a scalar, or an ``Obj``)."""

    def __init__(self, item: "Scalar | Obj", min_len: int = 1):
        self.item, self.min_len = item, min_len
        self.expected = f"a {'non-empty ' if min_len else ''}list of {item.plural}"

    def problem(self, v: Any, path: str) -> Bad | None:
        if type(v) is not list or len(v) < self.min_len:
            return Bad(path, self.expected, v)
        for i, x in enumerate(v):
            bad = self.item.problem(x, f"{path}[{i}]")
            if bad is not None:
                return bad
        return None


class Obj:
    """An object holding (at least) the given fields, each of its type."""

    def __init__(self, **fields: Scalar | ListOf | Obj):
        self.fields = tuple(fields.items())
        self.expected = "an object with fields " + ", ".join(fields)
        self.plural = "objects with fields " + ", ".join(fields)

    def problem(self, v: Any, path: str) -> Bad | None:
        if type(v) is not dict:
            return Bad(path, self.expected, v)
        for name, t in self.fields:
            if name not in v:
                return Bad(f"{path}.{name}", t.expected, found="no such field")
            bad = t.problem(v[name], f"{path}.{name}")
            if bad is not None:
                return bad
        return None
