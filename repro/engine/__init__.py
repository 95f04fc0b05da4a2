"""The step engine behind the table scripts: the profiles (``profiles``), each training and
evaluation step and its cache under ``--runs`` (``steps``, ``cache``, ``cache_keys``,
``cache_digests``, ``judged``, ``scoring``, ``lm_eval_run``, ``documents``), the order and place
steps run in (``planning``, ``ray_executor``: the Ray executor), their price (``costs``,
``token_counts``), the published recipes (``recipes``) and the scripts' shared command line
(``command_line``).

May import: ``mari_eval`` and ``baselines``; nothing else of repro.
"""
