"""Reimplemented baselines (CAA, ITI, NL-ITI, ReFT) behind ``mari_eval.methods.Intervention``.

They register with ``mari_eval.methods.register_method`` when this package is imported.
"""

from baselines import caa, iti, reft  # noqa: F401  (register "caa", "iti", "nl_iti", "reft")
