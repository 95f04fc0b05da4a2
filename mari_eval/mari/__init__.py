"""MARI, the method of the paper, as a wing of its own: the bundle's method class (``method``:
``MARI``, the gate and the routing at inference), the paper's equations (``equations``),
training (``fit``) and the applicability labels of the gate's control set (``gate_labels``).
Equation labels in these modules refer to ../shared/paper/MARI.tex.
"""

from mari_eval.mari.method import DEFAULTS, MARI

__all__ = ["DEFAULTS", "MARI"]
