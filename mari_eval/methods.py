"""The methods' door: the interface every method implements (``Intervention``,
mari_eval/intervention.py), the methods by name (mari_eval/registry.py) and reading a bundle
back (``load_bundle``, mari_eval/bundles.py). ``from mari_eval import methods`` is all a caller
of the method system needs.
"""

from mari_eval.bundle_spec import BUNDLE_FILES, BUNDLE_JSON, BUNDLE_WEIGHTS, BundleError, check_bundle_directory
from mari_eval.bundles import load_bundle
from mari_eval.intervention import Intervention
from mari_eval.registry import BUILTIN_METHODS, method_class, method_names, option_methods, option_names, register_method

__all__ = ["BUILTIN_METHODS", "BUNDLE_FILES", "BUNDLE_JSON", "BUNDLE_WEIGHTS", "BundleError", "Intervention", "check_bundle_directory", "load_bundle",
           "method_class", "method_names", "option_methods", "option_names", "register_method"]
