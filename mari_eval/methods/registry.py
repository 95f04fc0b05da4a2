"""The methods by name, from three sources:

* the built-in ones (``BUILTIN_METHODS``), imported when first asked for, as lm-eval's
  registry names its models;
* plugins: a pip-installed package that declares a method in the entry-point group
  ``mari_eval.methods`` (``[project.entry-points."mari_eval.methods"]``,
  ``name = "package.module:Class"``, docs/plugins.md). The group is read when a name is first
  looked up that no built-in has, and a plugin's module is imported only when its method is
  asked for (a bundle naming it is loaded, ``mari-eval train --method NAME``, ``--methods``).
  A name that two packages claim (or a package and mari-eval) is an error naming both;
* any class that registers itself with ``@register_method("name")`` when its module is imported
  (a method defined in a script or a notebook).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

M = TypeVar("M", bound=type)  # a method's class (a ``mari_eval.methods.intervention.Intervention`` subclass)

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
    "prompting": "{baselines}.prompting:Prompting",
    "lora": "{baselines}.lora:LoRA",
    "control_vector": "mari_eval.vectors.control_vector:ControlVector",
    "steered_config": "mari_eval.vectors.steer_config:SteeredConfig",
}
_METHODS: dict[str, type] = {}
ENTRY_POINT_GROUP = "mari_eval.methods"  # where installed packages declare their methods
log = logging.getLogger(__name__)


class MethodRegistryError(ValueError):
    """A method name that cannot be resolved: unknown, claimed twice, or a plugin that does not load."""


@dataclass(frozen=True)
class Plugin:
    """A method declared by an installed package (one entry point of ``ENTRY_POINT_GROUP``)."""

    name: str
    target: str  # "package.module:Class"
    package: str  # the distribution that declares it ("?" when its metadata does not say)

    def describe(self) -> str:
        return f"{self.target} (package {self.package})"


def register_method(name: str):
    def decorate(cls: M) -> M:
        cls.method = name
        _METHODS[name] = cls
        return cls

    return decorate


def method_class(name: str) -> type:
    """The class of method ``name``, importing its module if it is a built-in one or a plugin
    not loaded yet. A name claimed twice (a built-in one included) is refused, naming both."""
    plugins, claims = plugin_table()
    if name in claims:
        raise MethodRegistryError(f"method {name!r} is claimed by " + " and by ".join(claims[name])
                                  + f": uninstall one of the packages (`pip uninstall PACKAGE`), or rename its "
                                  f"{ENTRY_POINT_GROUP} entry point")
    if name not in _METHODS and name in BUILTIN_METHODS:
        module, cls = BUILTIN_METHODS[name].format(baselines=_baselines_package()).split(":")
        found = getattr(importlib.import_module(module), cls)  # registers itself on import
        _METHODS.setdefault(name, found)  # imported before the registry was reset (tests): registered again
    if name not in _METHODS and name in plugins:
        _METHODS[name] = _load_plugin(plugins[name])
    if name not in _METHODS:
        raise MethodRegistryError(f"unknown method {name!r}; known methods: {', '.join(method_names())} (a method of "
                                  f"another package is found once it is installed and declares it in the "
                                  f"{ENTRY_POINT_GROUP} entry-point group: docs/plugins.md)")
    return _METHODS[name]


@lru_cache(maxsize=1)
def plugin_table() -> tuple[dict[str, Plugin], dict[str, list[str]]]:
    """({name: its plugin}, {name: who claims it} for the names claimed more than once), read once
    from the installed packages' entry points. A plugin claiming a built-in name is a double claim
    too (mari-eval's and the package's)."""
    found: dict[str, list[Plugin]] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        package = entry.dist.name if entry.dist is not None else "?"
        plugin = Plugin(entry.name, entry.value, package)
        if plugin not in found.setdefault(entry.name, []):  # one package seen twice on sys.path counts once
            found[entry.name].append(plugin)
    plugins, claims = {}, {}
    for name, claimants in found.items():
        if name in BUILTIN_METHODS:
            claims[name] = [f"mari-eval's built-in {BUILTIN_METHODS[name]}", *(p.describe() for p in claimants)]
        elif len(claimants) > 1:
            claims[name] = [p.describe() for p in claimants]
        else:
            plugins[name] = claimants[0]
    return plugins, claims


def _load_plugin(plugin: Plugin) -> type:
    """The class a plugin names, checked to be a method, registered under the plugin's name."""
    try:
        cls = importlib.metadata.EntryPoint(plugin.name, plugin.target, ENTRY_POINT_GROUP).load()
    except (Exception, SystemExit) as e:  # whatever its import raises (sys.exit included): named, never fatal to the rest
        raise MethodRegistryError(f"method {plugin.name!r} of package {plugin.package} does not load: "
                                  f"{plugin.target}: {type(e).__name__}: {e}. Reinstall the package or fix its "
                                  f"{ENTRY_POINT_GROUP} entry point (`pip uninstall {plugin.package}` leaves "
                                  "every other method working)") from e
    # Duck-typed: importing mari_eval.methods.intervention here would close a circle (it imports this module).
    if not isinstance(cls, type) or not all(hasattr(cls, a) for a in ("fit", "plan", "tensor_spec", "hyperparameter_fields")):
        raise MethodRegistryError(f"method {plugin.name!r} of package {plugin.package}: {plugin.target} is not a "
                                  "subclass of mari_eval.methods.Intervention (docs/plugins.md)")
    declared = getattr(cls, "method", "abstract")
    if declared not in ("abstract", plugin.name):
        raise MethodRegistryError(f"package {plugin.package} declares {plugin.target} as method {plugin.name!r}, "
                                  f"but the class registers itself as {declared!r}: make the two names agree")
    cls.method = plugin.name
    return cls


def _baselines_package() -> str:
    return "mari_eval.baselines" if importlib.util.find_spec("mari_eval.baselines") is not None else "baselines"


def method_names() -> list[str]:
    """Every method name known: built-in, registered, and declared by installed packages."""
    plugins, claims = plugin_table()
    return sorted(set(BUILTIN_METHODS) | set(_METHODS) | set(plugins) | set(claims))


def method_sources() -> dict[str, str]:
    """{name: where the method comes from}, for listings (``mari-eval methods``)."""
    plugins, claims = plugin_table()
    sources = {name: f"built-in ({target.format(baselines=_baselines_package())})" for name, target in BUILTIN_METHODS.items()}
    sources.update({name: f"registered ({cls.__module__}.{cls.__qualname__})" for name, cls in _METHODS.items()
                    if name not in BUILTIN_METHODS})
    sources.update({name: f"plugin {plugin.describe()}" for name, plugin in plugins.items()})
    sources.update({name: "claimed twice: " + " and ".join(who) for name, who in claims.items()})
    return dict(sorted(sources.items()))


def option_names() -> set[str]:
    """Every evaluation option some method takes (lm-eval model args that are not HFLM's)."""
    return set(option_methods())


def option_methods() -> dict[str, list[str]]:
    """{evaluation option: the methods that take it}, over every known method."""
    taken: dict[str, list[str]] = {}
    for name in method_names():
        try:
            cls = method_class(name)
        except MethodRegistryError as e:  # a broken plugin must not hide the option error being reported
            log.warning("%s", e)
            continue
        for option in cls.option_fields:
            taken.setdefault(option, []).append(name)
    return taken
