"""The benchmarks' documents: reading the local copies under ``MARI_DATA_DIR`` (``data``), their
schemas (``data_schema``, ``data_fields``), the training, calibration and held-out splits of every
dataset, BBQ's included (``data_splits``), the order lm-eval visits documents in (``document_order``),
where the project's lm-eval task YAMLs live (``tasks``) and BLEURT for TruthfulQA generation (``bleurt``).

May import: ``storage``.
"""
