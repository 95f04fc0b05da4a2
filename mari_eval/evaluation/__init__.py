"""Scoring with lm-eval: the registered ``--model mari`` class (``lm``, ``lm_generation``; checks of
its arguments and its output files: ``lm_checks``, ``lm_outputs``), what scores a batch of requests
(``runner``, ``row_passes``, ``shared_pass``, ``prefix_cache``, ``batching``), generation under an
edit (``generation``), the choices a method made (``choice_log``), KL and cross-entropy on general
text (``divergence``) and ``mari-eval generate``'s side-by-side text (``side_by_side``).

May import: ``storage``, ``benchmarks``, ``injection``, ``methods``, ``vectors``.
"""
