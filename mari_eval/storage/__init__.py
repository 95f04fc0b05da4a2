"""Where things are kept: files written whole, never replacing what should not be replaced
(``files``, ``outputs``), a training run's per-epoch checkpoints (``checkpoint``), and model names
resolved to the directories that hold them (``models``: Hub ids, local folders, the embedded aliases), and
every number a user gives read one way (``numbers``: ASCII digits, finite, in range).

The lowest wing: it imports no other part of mari_eval.
"""
