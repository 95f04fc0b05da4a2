"""``lm_eval``'s output options, read as lm-eval reads them, and its result files checked once written.

lm-eval writes the results (and, with ``--log_samples``, the samples) after the whole evaluation,
and when that fails (a full disk, a read-only place) it logs a warning and exits 0: hours of work
gone, or a 0-byte results file, and a run that looks successful. So, when ``--model mari`` is loaded
by the ``lm_eval`` command:

* before the model loads, the output path is found with lm-eval's own parser of ``lm_eval run``
  (``output_path_given``: its abbreviations, ``-oX``, ``--output_path=X``, the last of repeats wins,
  then its ``--config`` YAML and ``--hf_hub_log_args output_path=``), refused if repeats disagree or
  it is empty, and checked writable (``lm_checks.check_lm_eval_output``);
* lm-eval's writers are wrapped (``guard_result_writes``): after each, the file it wrote must be
  whole (the results JSON parses, the samples file has a line per sample); if not, what lm-eval
  held is written to ``outputs.unsaved_place`` and the run stops with an error naming the file,
  the reason and where the results were kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from mari_eval.storage.files import atomic_write
from mari_eval.storage.outputs import OutputError, output_error, unsaved_place

_WRAPPED = "_mari_eval_checked"  # attribute marking a wrapped writer (wrap once)


class Refused(Exception):
    """lm-eval's parser refused the arguments (it would have exited)."""


def run_parser(seen: list, dest: str = "output_path") -> argparse.ArgumentParser:
    """lm-eval's parser of ``lm_eval run`` (also the legacy form without ``run``), built as lm-eval builds
    it, with every value given to the option ``dest`` (``--output_path``, ``--model_args``...) recorded in
    ``seen`` (argparse keeps only the last, or merges them). Its ``parse_known_args`` raises ``Refused``
    where lm-eval's would exit."""
    from lm_eval._cli.run import Run  # deferred: only the lm_eval command needs it

    subparsers = argparse.ArgumentParser(prog="lm-eval").add_subparsers(dest="command")
    Run.create(subparsers)
    parser = subparsers.choices["run"]

    def refuse(message: str):
        raise Refused(message)

    parser.error = refuse  # never exit this process: lm-eval reports its own parse errors
    action = next(a for a in parser._actions if a.dest == dest)
    stored = type(action)

    class Recorded(stored):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            seen.append(values)
            super().__call__(parser, namespace, values, option_string)

    action.__class__ = Recorded
    return parser


def output_path_given(argv: list[str]) -> str | None:
    """The output path an ``lm_eval`` command line gives lm-eval (``argv`` without the program), as lm-eval
    resolves it: ``--output_path`` (or what abbreviates it), else its ``--config`` YAML's, else
    ``--hf_hub_log_args output_path=``. None: no results file. ValueError: given twice with different
    values (lm-eval would silently keep the last), or empty (lm-eval would silently write nothing)."""
    seen: list[str] = []
    args = list(argv[1:] if argv[:1] == ["run"] else argv)
    try:
        namespace, _ = run_parser(seen).parse_known_args(args)
    except Refused:
        return None  # not an evaluation lm-eval runs: it refuses these arguments itself
    if len(set(seen)) > 1:
        raise ValueError(f"lm_eval --output_path is given {len(seen)} times ({', '.join(map(repr, seen))}; -o and "
                         "abbreviations such as --output count): lm-eval would keep the last one silently. Give it once")
    if seen and not seen[-1].strip():
        raise ValueError("lm_eval --output_path is empty (an unset shell variable?): lm-eval would write no results. "
                         "Give a directory or a .json file")
    path = namespace.output_path
    if not path and getattr(namespace, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig  # deferred: only with --config

        path = EvaluatorConfig.load_yaml_config(namespace.config).get("output_path")
    if not path:
        path = (getattr(namespace, "hf_hub_log_args", None) or {}).get("output_path")
    return str(path) if path else None


# ----------------------------------------------------------------------------- checking what lm-eval wrote


class _Caught(logging.Filter):
    """Keeps the exception being handled when lm-eval's writer logs its "Could not save" warning."""

    error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        self.error = sys.exc_info()[1] or self.error
        return True


def _with_caught(logger: logging.Logger, call: Callable[[], None]) -> BaseException | None:
    caught = _Caught()
    logger.addFilter(caught)
    try:
        call()
    finally:
        logger.removeFilter(caught)
    return caught.error


def _folder(tracker) -> Path:
    """Where lm-eval put this run's files: the .json path's folder, else OUTPUT/<model name>."""
    path = Path(tracker.output_path)
    return path.parent if path.suffix == ".json" else path / str(tracker.general_config_tracker.model_name_sanitized)


def _results_file(tracker) -> Path | None:
    date_id = getattr(tracker, "date_id", None)
    if date_id is None:
        return None
    path = Path(tracker.output_path)
    return path.with_name(f"{path.stem}_{date_id}.json") if path.suffix == ".json" else _folder(tracker) / f"results_{date_id}.json"


def _whole_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.endswith(b"\n"))
    except OSError:
        return 0


def _keep(files: dict[str, str]) -> str:
    """Write ``files`` ({name: text}) to a new ``unsaved_place``; the sentence saying where, or why not."""
    place = unsaved_place("lm_eval")
    try:
        for name, text in files.items():
            atomic_write(place / name, text)
    except OSError as e:
        return f"they could not be kept elsewhere either ({e})"
    return f"what lm-eval held is kept in {place}"


def _failed(tracker, written: Path | None, error: BaseException | None, keep: dict[str, str]) -> OutputError:
    """The error for a results or samples file lm-eval did not write whole: the file, lm-eval's reason
    (the exception its writer caught, when its warning was logged) or what the file holds, where the
    results were kept, and the fix."""
    if isinstance(error, OSError):
        reason = OSError(error.errno, error.strerror or str(error))
    elif error is not None:  # lm-eval's writer failed before or while writing
        reason = OSError(None, f"lm-eval's writer failed ({type(error).__name__}: {error})")
    elif written is not None and written.is_file():
        size = written.stat().st_size
        reason = OSError(None, "the file is empty (0 bytes)" if size == 0 else f"the file is cut short ({size} bytes)")
    else:
        reason = OSError(None, "lm-eval wrote no file (see its warning above)")
    named = output_error(reason, written or Path(tracker.output_path))
    removed = ""
    if written is not None and written.is_file() and not written.is_symlink():
        written.unlink(missing_ok=True)  # this run's own file, damaged: never left to be read as results
        removed = " (the damaged file was removed)"
    return OutputError(named.errno, f"lm_eval --output_path {tracker.output_path}: {named}{removed}; {_keep(keep)}")


def _dumps(obj: Any) -> str:
    from lm_eval.utils import handle_non_serializable  # deferred: lm-eval is heavy

    return json.dumps(obj, indent=2, default=handle_non_serializable, ensure_ascii=False)


def _sample_lines(samples: list) -> str:
    from lm_eval.utils import handle_non_serializable  # deferred: lm-eval is heavy

    return "".join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n" for s in samples)


def guard_result_writes() -> None:
    """Wrap lm-eval's ``EvaluationTracker.save_results_aggregated`` and ``save_results_samples`` (once per
    process) so that a file they failed to write whole stops the run (module docstring)."""
    from lm_eval.loggers import evaluation_tracker as module  # deferred: only the lm_eval command needs it

    tracker_cls = module.EvaluationTracker
    if getattr(tracker_cls.save_results_aggregated, _WRAPPED, False):
        return
    aggregated, per_task = tracker_cls.save_results_aggregated, tracker_cls.save_results_samples

    @functools.wraps(aggregated)
    def save_results_aggregated(self, results: dict, samples: dict | None = None) -> None:
        error = _with_caught(module.eval_logger, lambda: aggregated(self, results, samples))
        written = _results_file(self) if self.output_path else None
        if self.output_path and (written is None or not _whole_json(written)):
            keep = {"results.json": _dumps(results)}
            keep.update({f"samples_{task}.jsonl": _sample_lines(rows) for task, rows in (samples or {}).items()})
            raise _failed(self, written, error, keep)

    @functools.wraps(per_task)
    def save_results_samples(self, task_name: str, samples: list) -> None:
        error = _with_caught(module.eval_logger, lambda: per_task(self, task_name, samples))
        if not self.output_path:
            return
        written = _folder(self) / f"samples_{task_name}_{getattr(self, 'date_id', '')}.jsonl"
        if _lines(written) != len(samples):
            raise _failed(self, written, error, {f"samples_{task_name}.jsonl": _sample_lines(samples)})

    for wrapped in (save_results_aggregated, save_results_samples):
        setattr(wrapped, _WRAPPED, True)
    tracker_cls.save_results_aggregated, tracker_cls.save_results_samples = save_results_aggregated, save_results_samples
