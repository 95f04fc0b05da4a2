"""The methods by name: the built-in ones (``BUILTIN_METHODS``, imported when first asked for, as
lm-eval's registry names its models) and any other that registers itself with
``@register_method("name")`` when its module is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TypeVar

M = TypeVar("M", bound=type)  # a method's class (a ``mari_eval.intervention.Intervention`` subclass)

# The methods that come with mari-eval, by name: "module:Class", imported when first asked for
# (as lm-eval's registry names its models). A method defined elsewhere registers itself with
# ``@register_method`` when its module is imported.
# "{baselines}" is the package of the checkout's baselines/ folder: mari_eval.baselines in an
# installed wheel (pyproject.toml installs it there), baselines in an editable install.
BUILTIN_METHODS = {
    "mari": "mari_eval.mari.method:MARI",
    "caa": "{baselines}.caa:CAA",
    "iti": "{baselines}.iti:ITI",
    "nl_iti": "{baselines}.iti:NLITI",
    "reft": "{baselines}.reft:ReFT",
}
_METHODS: dict[str, type] = {}


def register_method(name: str):
    def decorate(cls: M) -> M:
        cls.method = name
        _METHODS[name] = cls
        return cls

    return decorate


def method_class(name: str) -> type:
    """The class of method ``name``, importing its module if it is a built-in one not loaded yet."""
    if name not in _METHODS and name in BUILTIN_METHODS:
        module, cls = BUILTIN_METHODS[name].format(baselines=_baselines_package()).split(":")
        getattr(importlib.import_module(module), cls)  # registers itself on import
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    return _METHODS[name]


def _baselines_package() -> str:
    return "mari_eval.baselines" if importlib.util.find_spec("mari_eval.baselines") is not None else "baselines"


def method_names() -> list[str]:
    return sorted(set(BUILTIN_METHODS) | set(_METHODS))


def option_names() -> set[str]:
    """Every evaluation option some method takes (lm-eval model args that are not HFLM's)."""
    return set(option_methods())


def option_methods() -> dict[str, list[str]]:
    """{evaluation option: the methods that take it}, over every known method."""
    taken: dict[str, list[str]] = {}
    for name in method_names():
        for option in method_class(name).option_fields:
            taken.setdefault(option, []).append(name)
    return taken
