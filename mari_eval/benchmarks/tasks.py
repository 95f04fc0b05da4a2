"""Where the project's lm-eval tasks live, and how lm-eval finds them without ``--include_path``.

The task YAMLs are kept in the checkout's top-level ``harness_tasks/`` folder; the wheel
installs that folder as ``mari_eval/harness_tasks`` (pyproject.toml), and an editable
install reads the checkout's folder. :func:`tasks_dir` returns whichever is there.

lm-eval 0.4.13 has no discovery of installed task suites: its ``TaskManager`` indexes its own
tasks plus the caller's ``include_path``. ``mari_eval_autoload`` therefore calls
:func:`extend_task_manager` when lm-eval imports ``lm_eval.tasks.manager``, which wraps
``TaskManager.__init__`` so that every manager built with lm-eval's defaults (the ``lm_eval``
command, ``simple_evaluate`` without ``task_manager``) also indexes :func:`tasks_dir`:

* names that only this project defines (``*_heldout``, ``sorry_bench``, the ``mari_heldout``
  tag) are always added;
* names that are also lm-eval built-ins (``truthfulqa_mc1``, ``bbq``, ``mmlu``, ...) are ours
  only while ``$MARI_DATA_DIR`` is set, so that they read the local copy; without it lm-eval's
  own built-ins answer them, from the Hub, exactly as without this package;
* a folder the caller passes in ``include_path`` still wins over ours (it is indexed last),
  and a caller who passes our folder itself, or ``include_defaults=False``, gets lm-eval's
  behaviour unchanged.

Only the constructor's documented arguments are used: lm-eval indexes ``include_path`` in
order and a later folder's task replaces an earlier one's, so the wrapper only chooses the
order of the folders (ours before or after lm-eval's own).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DATA_ENV = "MARI_DATA_DIR"  # = mari_eval.benchmarks.data.DATA_ENV (not imported: that module loads datasets)
_PACKAGED = Path(__file__).resolve().parents[1] / "harness_tasks"  # the wheel's copy
_CHECKOUT = Path(__file__).resolve().parents[2] / "harness_tasks"  # an editable install's checkout
_WRAPPED = "_mari_eval_tasks"  # attribute marking the wrapped __init__ (wrap once)

log = logging.getLogger("lm_eval.mari_eval")


class TasksNotFound(RuntimeError):
    pass


def tasks_dir() -> Path:
    """The folder of the project's task YAMLs: the installed copy, else the checkout's ``harness_tasks/``."""
    for path in (_PACKAGED, _CHECKOUT):
        if (path / "utils.py").is_file():
            return path
    raise TasksNotFound(
        f"mari-eval's lm-eval tasks are neither at {_PACKAGED} (wheel install) nor at {_CHECKOUT} "
        "(editable install of a checkout); reinstall mari-eval (pip install mari-eval, or pip install -e CHECKOUT)"
    )


def task_manager(names: Sequence[str], **kwargs: Any):
    """lm-eval's ``TaskManager`` for ``names`` (tasks, groups or tags), our task folder winning every
    name it defines: the folder alone where it defines them all (a few milliseconds; indexing
    lm-eval's built-ins as well takes several seconds in every process), else over lm-eval's own.
    ``kwargs`` (``metadata``) pass on to the manager."""
    from lm_eval.tasks import TaskManager  # deferred: lm-eval is heavy; only this path needs it

    ours = TaskManager(include_path=str(tasks_dir()), include_defaults=False, **kwargs)
    if all(name in ours.all_tasks for name in names):
        return ours
    return TaskManager(include_path=str(tasks_dir()), **kwargs)


def _paths(include_path: Any) -> list[Any]:
    if include_path is None or include_path == "":
        return []
    return list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]


def _same(a: Any, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except (OSError, TypeError):
        return False


def index_paths(include_path: Any, include_defaults: bool, builtin_dir: Path) -> tuple[Any, bool] | None:
    """The (include_path, include_defaults) that a wrapped TaskManager passes on, or None to change nothing.

    With ``$MARI_DATA_DIR`` set: lm-eval's folder, ours, the caller's (ours replace the
    built-ins of the same name). Without it: ours, lm-eval's folder, the caller's (the
    built-ins keep their names; ours add the names lm-eval lacks).
    """
    theirs = _paths(include_path)
    if not include_defaults:
        return None  # the caller asked for their folders only
    try:
        ours = tasks_dir()
    except TasksNotFound as e:
        log.warning("%s", e)
        return None
    if any(_same(p, ours) for p in theirs):
        return None  # our folder passed explicitly (--include_path harness_tasks): lm-eval's rules as given
    if os.environ.get(DATA_ENV):
        return [ours, *theirs], True
    return [ours, builtin_dir, *theirs], False


class _QuietOverrides(logging.Filter):
    """Drops lm-eval's per-task "overrides existing task" warning between our folder and lm-eval's.

    About 70 names are shared (57 MMLU subjects among them); one line of ours says which
    folder won instead of 70 warnings on every ``lm_eval`` run. Overrides by the caller's
    own ``include_path`` are still reported by lm-eval.
    """

    def __init__(self, ours: Path, builtin: Path) -> None:
        super().__init__()
        self.roots = (str(ours.resolve()), str(builtin.resolve()))

    def filter(self, record: logging.LogRecord) -> bool:
        if "overrides existing task" not in str(record.msg) or len(record.args or ()) != 3:
            return True
        new, old = (str(Path(p).resolve()) for p in record.args[1:])
        return {_root(new, self.roots), _root(old, self.roots)} != set(self.roots)


class _QuietLoaderHint(logging.Filter):
    """Drops lm-eval's per-task hint that a ``custom_dataset`` loader takes ``--metadata`` kwargs, for
    our tasks: every one of them has such a loader (the held-out splits), and its YAML says which
    ``--metadata`` it reads (split_seed; bleurt). A task of anyone else's keeps the hint."""

    def __init__(self) -> None:
        super().__init__()
        self.ours: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not ("Custom kwargs can be passed to `--metadata`" in message and message.split(":", 1)[0] in self.ours)


_LOADER_HINT = _QuietLoaderHint()


def _names_under(manager, folder: Path) -> list[str]:
    """The task names ``manager`` indexed from YAMLs under ``folder``."""
    root = (str(folder.resolve()),)
    return [name for name, e in manager.task_index.items()
            if e.yaml_path is not None and _root(str(Path(e.yaml_path).resolve()), root) is not None]


def _root(path: str, roots: tuple[str, ...]) -> str | None:
    return next((r for r in roots if path == r or path.startswith(r + os.sep)), None)


def extend_task_manager(task_manager_cls: type) -> None:
    """Wrap ``TaskManager.__init__`` (in place, once) so that default managers index our tasks."""
    original: Callable[..., None] = task_manager_cls.__init__
    if getattr(original, _WRAPPED, False):
        return
    import lm_eval.tasks as lm_eval_tasks  # deferred: lm-eval is heavy; only this path needs it

    builtin = Path(lm_eval_tasks.__file__).resolve().parent
    index_logger = logging.getLogger("lm_eval.tasks._index")

    @functools.wraps(original)
    def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None) -> None:
        if isinstance(metadata, dict) and metadata.get("bleurt"):  # a missing local checkpoint: now, not after generating
            from mari_eval.benchmarks.bleurt import check_checkpoint  # deferred: only a run naming one needs it

            check_checkpoint(str(metadata["bleurt"]))
        chosen = index_paths(include_path, include_defaults, builtin)
        if chosen is None:
            original(self, verbosity=verbosity, include_path=include_path, include_defaults=include_defaults,
                     metadata=metadata)
            _LOADER_HINT.ours.update(_names_under(self, tasks_dir()))
            return
        paths, defaults = chosen
        ours = paths[0]
        quiet = _QuietOverrides(ours, builtin)
        index_logger.addFilter(quiet)
        try:
            original(self, verbosity=verbosity, include_path=paths, include_defaults=defaults, metadata=metadata)
        finally:
            index_logger.removeFilter(quiet)
        self.include_path = include_path  # what the caller gave, as lm-eval keeps it
        names = _names_under(self, ours)
        kept = len(names)
        _LOADER_HINT.ours.update(names)
        if defaults:
            log.info("mari-eval: %d task names from %s, built-in names included (%s is set: they read "
                     "the local copy)", kept, ours, DATA_ENV)
        else:
            log.info("mari-eval: %d task names from %s; lm-eval's built-in names (truthfulqa_mc1, bbq, ...) "
                     "stay lm-eval's, read from the Hub (%s is not set)", kept, ours, DATA_ENV)

    setattr(__init__, _WRAPPED, True)
    task_manager_cls.__init__ = __init__
    logging.getLogger("lm_eval.api.task").addFilter(_LOADER_HINT)
