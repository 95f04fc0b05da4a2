"""The methods' door: the interface every method implements (``Intervention``,
mari_eval/methods/intervention.py), the methods by name (mari_eval/methods/registry.py, plugins included) and
reading a bundle back (``load_bundle``, mari_eval/methods/bundles.py). ``from mari_eval import methods``
is all a caller of the method system needs, and all a method of another package imports
(docs/plugins.md): the base class, the fields that declare its bundle and settings, and its
evaluation options.

The wing holds the method system: the interface (``intervention``), a bundle's schema and the checks
of its files (``bundle_spec``), reading a bundle back (``bundles``), bundles on the Hugging Face Hub
(``hub``), the methods by name (``registry``) and typed evaluation options (``options``).
May import: ``storage``, ``benchmarks``, ``injection``.
"""

from mari_eval.methods.bundle_spec import (BUNDLE_FILES, BUNDLE_JSON, BUNDLE_WEIGHTS, Bool, BundleError, Float, Int, List, Str,
                                           TensorSpec, check_bundle_directory)
from mari_eval.methods.bundles import load_bundle
from mari_eval.methods.intervention import Intervention
from mari_eval.methods.options import Option
from mari_eval.injection.plan import BASE, Plan
from mari_eval.methods.registry import (BUILTIN_METHODS, ENTRY_POINT_GROUP, MethodRegistryError, method_class, method_names,
                                        method_sources, option_methods, option_names, register_method)

__all__ = ["BASE", "BUILTIN_METHODS", "BUNDLE_FILES", "BUNDLE_JSON", "BUNDLE_WEIGHTS", "Bool", "BundleError",
           "ENTRY_POINT_GROUP", "Float", "Int", "Intervention", "List", "MethodRegistryError", "Option", "Plan", "Str",
           "TensorSpec", "check_bundle_directory", "load_bundle", "method_class", "method_names", "method_sources",
           "option_methods", "option_names", "register_method"]
