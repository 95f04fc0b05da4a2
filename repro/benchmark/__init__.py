"""The speed benchmarks' machinery: wall-clock timing (``timing``), models at published shapes
with random weights (``random_model``, ``shapes/``), and the GPU benchmark's steps and report
(``gpu_bench_steps``, ``gpu_bench_report``), run by ``repro/gpu_bench.py`` and ``repro/bench.py``.

May import: ``repro.engine``, ``repro.analysis``.
"""
