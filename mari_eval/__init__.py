"""mari-eval: MARI and its baselines, trained on the same splits and scored by lm-eval.

Start-up is kept light: importing this package imports no torch, transformers or lm-eval.
"""

__version__ = "0.1.0"
