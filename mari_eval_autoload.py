"""Registers ``--model mari`` with lm-eval without the user importing anything.

lm-eval 0.4.13 has no plugin discovery for models. ``mari_eval_autoload.pth``, installed
beside this module in site-packages, imports it at interpreter start-up. It only
installs an import hook (no torch, no lm-eval import), so start-up stays light: when
lm-eval later imports ``lm_eval.models`` (its model registry), the hook adds the lazy
entry ``mari -> mari_eval.lm:MariLM``; the class itself is imported only when asked for.
"""

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder

_WATCHED = "lm_eval.models"
MODEL_NAMES = {"mari": "mari_eval.lm:MariLM"}


def register() -> None:
    from lm_eval.api.registry import model_registry

    for name, target in MODEL_NAMES.items():
        if name not in model_registry:
            model_registry.register(name, target=target)


class _RegisterAfterImport(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _WATCHED:
            return None
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
