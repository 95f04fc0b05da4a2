"""``--model_args`` as the user typed them (issue 83.1, 83.2): a key given twice refused, and numbers
read by ``numbers.read_number`` from the text, not from what lm-eval made of it.

lm-eval turns ``--model_args`` into a dict before a model sees it, and in doing so it

* keeps the last of a key given twice (``rho=0.0,rho=1.0`` runs at rho 1.0; the command line logs
  one "Overwriting key" warning, the Python path nothing), and
* converts every value that Python's ``int()`` or ``float()`` accepts: "1_0" arrives as 10.0,
  Arabic-Indic "٣" as 3, "1e400" as infinity, and "0123" (a revision) as 123.

The command line (``lm_eval run``, 0.4.13) parses ``--model_args`` with ``key_val_to_dict`` inside
its argparse action and calls ``MariLM.create_from_arg_obj`` with the dict; the Python path calls
``create_from_arg_string`` with the string. Both come here (``MariLM``'s two constructors):

* ``from_command_line``: when this process is the ``lm_eval`` command, the values given to
  ``--model_args`` are read again from ``sys.argv`` with lm-eval's own parser of ``lm_eval run``
  (``lm_outputs.run_parser``: its abbreviations, ``-a``, repeats, ``key=value`` items split as
  ``split_top_level`` splits them, a JSON object read with its duplicate keys kept);
* ``from_arg_string``: the string split as lm-eval's ``simple_parse_args_string`` splits it.

Reading the command line again, rather than wrapping lm-eval's parser from the import hook
(``mari_eval_autoload``), keeps the check to ``--model mari`` (``--model hf`` keeps lm-eval's
behaviour) and works whatever imports lm-eval first. A ``--config`` YAML's model_args is not re-read.

Then (``typed``): a key given twice is refused; a value lm-eval made a number is checked as its text
(``read_number``); and for the keys ``MariLM`` reads itself (the methods' options, ``batch_tokens``,
``max_batch_size``, ``bundle``...) the text itself is handed on, to be read by the option's own type.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from mari_eval.evaluation import lm_outputs
from mari_eval.storage.numbers import read_number

# The model args MariLM reads itself (beyond the methods' options): they receive the text as typed.
OWN_ARGS = frozenset({"bundle", "bundle_revision", "diagnostics", "allow_other_model", "batch_tokens", "max_batch_size"})


def _json_pairs(text: str) -> list[tuple[str, Any]] | None:
    """The (key, value) pairs of a JSON object, duplicates kept; None when ``text`` is not one."""
    try:
        pairs = json.loads(text, object_pairs_hook=lambda items: items)
    except json.JSONDecodeError:
        return None
    return pairs if isinstance(pairs, list) and all(isinstance(p, tuple) for p in pairs) else None


def command_line_pairs(argv: list[str]) -> list[tuple[str, Any]] | None:
    """Every (key, value as typed) given to ``--model_args`` on the ``lm_eval`` command line ``argv``
    (without the program), in order; None when lm-eval's parser refuses ``argv`` (it reports that itself)."""
    from lm_eval._cli.utils import split_top_level  # deferred: only the lm_eval command needs it

    seen: list[list[str]] = []
    quiet = logging.getLogger("lm_eval._cli.utils")  # its "Overwriting key" warnings were logged once already
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        lm_outputs.run_parser(seen, dest="model_args").parse_known_args(list(argv[1:] if argv[:1] == ["run"] else argv))
    except lm_outputs.Refused:
        return None
    finally:
        quiet.setLevel(level)
    pairs: list[tuple[str, Any]] = []
    for values in seen:
        values = [values] if isinstance(values, str) else list(values or [])
        as_json = _json_pairs(values[0]) if values else None
        if as_json is not None:
            if len(values) > 1:
                raise ValueError(f"--model_args {' '.join(values)!r}: after a JSON object lm-eval reads nothing more "
                                 f"({' '.join(values[1:])!r} would be dropped silently); put every key in the object")
            pairs += as_json
            continue
        for value in values:
            pairs += [tuple(item.split("=", 1)) for item in split_top_level(value) if "=" in item]
    return pairs


def string_pairs(arg_string: str | None) -> list[tuple[str, str]]:
    """The (key, value) pairs of a ``key=value,...`` string, split as lm-eval's ``simple_parse_args_string``."""
    items = [item for item in (arg_string or "").strip().split(",") if item]
    return [(item.split("=", 1)[0], item.split("=", 1)[1] if "=" in item else "") for item in items]


def check_given_once(pairs: list[tuple[str, Any]], shown: str) -> None:
    """Refuse a key given more than once (lm-eval would keep the last one silently)."""
    keys = [key.strip() for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} given more than once in --model_args ({shown}): lm-eval would keep the "
                         "last one silently; give each key once")


def typed(arg_dict: dict[str, Any], pairs: list[tuple[str, Any]], shown: str, own: Callable[[], set[str]]) -> dict[str, Any]:
    """``arg_dict`` (what lm-eval made of ``pairs``) with each number lm-eval read checked as typed, and the
    text itself for the keys in ``own()`` (called only when a number is met: it may import every method);
    a key given twice is refused first."""
    check_given_once(pairs, shown)
    out = dict(arg_dict)
    own_keys: set[str] | None = None
    for key, text in pairs:
        value = out.get(key)
        if not isinstance(text, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a JSON value, or text lm-eval kept as text: read as it is
        own_keys = own() if own_keys is None else own_keys
        if key in own_keys:
            out[key] = text.strip()  # read by the option's own type (numbers.read_number for numbers)
        else:
            read_number(text, f"{key}=", where="in --model_args")  # lm-eval's value stands once the text is a number
    return out


def from_command_line(arg_dict: dict[str, Any], argv: list[str], own: Callable[[], set[str]]) -> dict[str, Any]:
    """``typed`` over the ``--model_args`` of the ``lm_eval`` command line ``argv`` (without the program)."""
    pairs = command_line_pairs(argv)
    if not pairs:
        return arg_dict
    return typed(arg_dict, pairs, ",".join(f"{key}={text}" for key, text in pairs), own)


def from_arg_string(arg_string: str | None, own: Callable[[], set[str]]) -> dict[str, Any]:
    """lm-eval's dict of ``arg_string`` (``simple_parse_args_string``), ``typed``."""
    from lm_eval.utils import simple_parse_args_string  # deferred: as lm-eval's own constructor does

    return typed(simple_parse_args_string(arg_string), string_pairs(arg_string), repr(arg_string), own)
