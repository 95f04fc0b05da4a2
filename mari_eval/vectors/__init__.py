"""What researchers bring, as bundles: fixed vectors added to decoder layers' outputs and the
files they come in. Control-vector bundles and GGUF import and export (``control_vector``,
``control_vector_files``; the public ``mari_eval.control_vector`` names them), lm-eval's ``--model
steered`` configs (``steer_config``) and SAE-feature CSVs (``sae_features``), pyreft saves as ReFT
bundles (``pyreft_save``), the sign check of an imported direction (``vector_sign``), weighted sums
of vectors (``combine``) and the positions and layers a vector edits at evaluation (``edit_positions``).

May import: ``storage``, ``benchmarks``, ``injection``, ``methods``.
"""
