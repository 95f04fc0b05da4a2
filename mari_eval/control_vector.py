"""The public name of the control-vector helpers (``mari_eval.control_vector.from_steering_vector``,
docs/methods.md), kept where users first imported them; they live in the ``vectors`` wing
(mari_eval/vectors/control_vector.py), which every module of this project imports instead.
"""

from mari_eval.vectors.control_vector import ControlVector, export_gguf, from_steering_vector, import_gguf  # noqa: F401
