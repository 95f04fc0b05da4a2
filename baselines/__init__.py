"""Reimplemented baselines (CAA, ITI, NL-ITI, ReFT) behind ``mari_eval.methods.Intervention``.

They register with ``mari_eval.methods.register_method`` when this package is imported.
"""

from baselines import caa  # noqa: F401  (registers "caa")
