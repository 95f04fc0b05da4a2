"""Training a method on a dataset's splits: ``mari-eval train`` (``train``), the frozen model's
work prepared once per example (``session``, ``examples``), the objectives (``objectives``), the
epoch loop that a killed run resumes (``epochs``) and the memory a step holds (``memory``).

May import: every wing below it (``storage`` to ``evaluation``).
"""
