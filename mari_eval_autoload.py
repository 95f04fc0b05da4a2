"""Makes ``--model mari`` and the project's tasks known to lm-eval without the user importing anything.

lm-eval 0.4.13 discovers neither installed models nor installed task folders.
``mari_eval_autoload.pth``, installed beside this module in site-packages, imports it at
interpreter start-up. It only installs an import hook (no torch, no lm-eval import), so
start-up stays light. When lm-eval later imports

* ``lm_eval.models`` (its model registry), the hook adds the lazy entry
  ``mari -> mari_eval.evaluation.lm:MariLM``; the class itself is imported only when asked for;
* ``lm_eval.tasks.manager`` (its ``TaskManager``), the hook lets every manager built with
  lm-eval's defaults index the project's task folder too (``mari_eval.benchmarks.tasks``).

pyproject.toml also declares the entry point ``lm_eval.models: mari = mari_eval.evaluation.lm:MariLM``,
the group that lm-eval's upstream reads once it discovers model plugins
(``lm_eval.api.registry.load_plugins``). Where lm-eval has that, the model half of this
hook stands aside; the hook is to be removed once the pinned lm-eval discovers both models
and tasks.
"""

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder

MODEL_NAMES = {"mari": "mari_eval.evaluation.lm:MariLM"}


def lm_eval_discovers_models() -> bool:
    """Whether the installed lm-eval reads the ``lm_eval.models`` entry points itself."""
    from lm_eval.api import registry

    return callable(getattr(registry, "load_plugins", None))


def register() -> None:
    """Registers ``MODEL_NAMES`` in lm-eval's model registry, unless lm-eval finds them itself."""
    if lm_eval_discovers_models():
        return
    from lm_eval.api.registry import model_registry

    for name, target in MODEL_NAMES.items():
        if name not in model_registry:
            model_registry.register(name, target=target)


def add_tasks(module) -> None:
    """Lets ``module.TaskManager`` (lm_eval.tasks.manager) index the project's tasks by default."""
    from mari_eval.benchmarks.tasks import extend_task_manager

    extend_task_manager(module.TaskManager)


# module lm-eval imports -> what to run right after it has been executed
_AFTER_IMPORT = {"lm_eval.models": lambda module: register(), "lm_eval.tasks.manager": add_tasks}


class _RegisterAfterImport(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        then = _AFTER_IMPORT.get(fullname)
        if then is None:
            return None
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
