"""The figures' numbers and drawings (``figure_stats``, ``figure_plots``), used by ``repro/figures.py``.

May import: ``repro.engine``, ``repro.analysis``.
"""
