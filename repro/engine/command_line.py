"""The command line every repro script shares (``start``): the profile, the cache, the output
folder, and the placement it trains and evaluates in.

Every script takes ``mari-eval train``'s placement flags (``--dtype``, ``--device``,
``--device-map``, ``--max-memory-per-gpu``, ``--max-cpu-memory``): one ``Placement`` for
the bundles it trains and the evaluations it runs (``placement_from_args``).
"""

import argparse
import logging
import re
import sys
from pathlib import Path

from mari_eval.methods import options, registry
from mari_eval.cli import add_placement_arguments
from mari_eval.injection.devices import Placement
from mari_eval.storage.files import check_writable_dir
from repro.engine.cache import Store
from repro.engine.cache_keys import warn_if_stored_under_other_versions
from repro.engine.profiles import PROFILES, REPO, Profile

PLACEMENT_HELP = """\
The frozen model's placement, for the bundles a script trains and the evaluations it runs
(the flags of `mari-eval train`). --profile paper on a machine with CUDA defaults to
--dtype bfloat16 --device-map auto: an explicit --dtype replaces its dtype, an explicit
--device or --device-map its device map. Otherwise: dtype auto (the checkpoint's own;
float32 for the embedded models), cuda when available, else cpu. The resolved dtype is
part of every cached step's key under --runs (bf16 and float32 are cached apart)."""


def profile_from_args(args) -> Profile:
    profile = PROFILES[args.profile]
    if getattr(args, "model", None):
        profile = Profile(**{**profile.__dict__, "models": [args.model]})
    if getattr(args, "seeds", None) is not None:  # exactly these seeds, for every column (column_seeds dropped)
        profile = Profile(**{**profile.__dict__, "seeds": listed(args.seeds, "--seeds", options.seed), "column_seeds": {}})
    return profile


def placement_from_args(args, profile: Profile):
    """The ``train.Placement`` of a script's command line: its flags, else the profile's
    defaults on a CUDA machine (``Profile.cuda_placement``), else ``mari-eval train``'s."""
    values = {"dtype": args.dtype, "device": args.device, "device_map": args.device_map,
              "max_memory_per_gpu": args.max_memory_per_gpu, "max_cpu_memory": args.max_cpu_memory}
    if profile.cuda_placement:
        import torch  # deferred: torch is heavy; only the paper profile's CUDA default needs it

        if torch.cuda.is_available():
            defaults = dict(profile.cuda_placement)
            if values["device"] is not None:  # one device named: no device map of the profile's
                defaults.pop("device_map", None)
            values.update({k: v for k, v in defaults.items() if values[k] is None})
    return Placement(**{**values, "dtype": values["dtype"] or "auto"})


def add_common_args(parser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick",
                        help="how much to compute (default: quick); paper also defaults to bf16 with --device-map auto "
                             "on a CUDA machine (see placement below)")
    parser.add_argument("--smoke", dest="profile", action="store_const", const="smoke", help="same as --profile smoke")
    parser.add_argument("--model", help="run this model (embedded alias or Hub id) instead of the profile's")
    parser.add_argument("--seeds", help="comma-separated seeds instead of the profile's, for every column (the quick and standard "
                                        "profiles' extra TruthfulQA seeds 1 and 2 are dropped too)")
    parser.add_argument("--runs", default=str(REPO / "runs"), help="where bundles and evaluations are cached")
    parser.add_argument("--out", help="where tables and plots are written (default: results/ for the standard profile, "
                                      "whose tables are committed; results/profiles/NAME/ for the others)")
    parser.add_argument("--force", action="store_true", help="recompute cached steps")
    parser.add_argument("--strict-cache", action="store_true",
                        help="stop at a cached step whose files do not match the digests it recorded (or that records "
                             "none), instead of recomputing it with a warning (repro/engine/cache_digests.py)")
    parser.add_argument("--columns", help="comma-separated subset of the table's benchmark columns (e.g. tqa_mc1,bbq_acc)")
    placement = parser.add_argument_group("placement", PLACEMENT_HELP)
    add_placement_arguments(placement)
    parser.set_defaults(dtype=None)  # not given: the profile's default (placement_from_args)
    placement.add_argument("--max-memory", help="as mari-eval train's: what training may keep of the frozen model's work, "
                                                "e.g. 40GiB (beyond it caches are recomputed; results are the same)")


def listed(text: str, option: str, kind: type = str, allow_empty: bool = False) -> list:
    """A comma-separated option value as a list of ``kind``, refused (SystemExit naming the option and
    the fix) when it is empty or holds an empty item (``--seeds ''``, ``--ks 1,,4``: an unset shell
    variable, a stray comma) or an item that is not a ``kind``. ``allow_empty``: '' means none."""
    if not text.strip():
        if allow_empty:
            return []
        raise SystemExit(f"{option} is empty (an unset shell variable?): give comma-separated values, or leave "
                         f"{option} out for the default")
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise SystemExit(f"{option} {text!r} holds an empty item (a stray comma?): give comma-separated values, "
                         "e.g. 1,2,4")
    read = {int: options.INTEGER_FLAG, float: options.NUMBER_FLAG}.get(kind, kind)  # numbers: numbers.read_number
    try:
        return [read(item) for item in items]
    except argparse.ArgumentTypeError as e:  # a typed item's own reason (numbers.read_number; options.seed: its range)
        raise SystemExit(f"{option} {text!r}: {e}") from None
    except ValueError as e:
        raise SystemExit(f"{option} {text!r}: every item must be {'an integer' if kind in (int, options.seed) else 'a number'}, "
                         f"e.g. 1,2,4 ({e})") from None


def methods_listed(text: str, option: str = "--methods", extra: tuple[str, ...] = ("vanilla",)) -> list[str]:
    """``--methods``: the rows to train and score, each a method mari-eval knows (built-in, or
    declared by an installed package: docs/plugins.md) or one of ``extra`` (the untouched model's
    row). A plugin's class is imported here, so that a name that does not load is refused before
    any work, naming the package to fix."""
    names = listed(text, option)
    for name in names:
        if name in extra:
            continue
        try:
            registry.method_class(name)
        except registry.MethodRegistryError as e:
            raise SystemExit(f"{option}: {e}") from None
    return names


def extra_bundles(values: list[str] | None, store: Store, taken: list[str], copy: bool = True) -> dict[str, tuple]:
    """``--extra-bundle NAME=DIR`` (repeatable): {NAME: (its directory under --runs, its method)}, rows
    of bundles made elsewhere (``Store.imported``). Refused, naming the fix: no ``=``, a name that
    is not a plain word or that another row has, a directory that is not a bundle."""
    out: dict[str, tuple] = {}
    for value in values or []:
        name, sep, directory = value.partition("=")
        if not sep or not directory:
            raise SystemExit(f"--extra-bundle {value!r}: give NAME=DIR, e.g. repeng=bundles/honesty")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", name):
            raise SystemExit(f"--extra-bundle {value!r}: a row name is a letter then letters, digits, '_', '.', '-'")
        if name in out or name in taken:
            raise SystemExit(f"--extra-bundle {value!r}: another row is named {name!r}; give this one another name")
        try:
            out[name] = store.imported(name, Path(directory), copy=copy)
        except (ValueError, OSError) as e:  # BundleError among them: not a bundle, or a damaged one
            raise SystemExit(f"--extra-bundle {value!r}: {e}") from None
    return out


def at_least(least: int):
    """An argparse ``type`` for a count option: an integer >= ``least`` (``--repeats 0`` would be a
    median of nothing, ``--prompts -1`` a slice from the end), refused with a usage error."""
    def parse(text: str) -> int:
        value = options.INTEGER_FLAG(text)  # numbers.read_number: ASCII digits, no underscore
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}: give an integer >= {least}")
        return value

    parse.__name__ = f"integer >= {least}"  # argparse's "invalid <name> value" names the rule
    return parse


def select(columns: list[tuple], wanted: str | None, optional: list[tuple] = ()) -> list[tuple]:
    """The benchmark columns named in ``--columns`` (without it, all of ``columns``; the ``optional``
    ones only when named)."""
    if wanted is None:
        return columns
    names = listed(wanted, "--columns")
    known = [*columns, *optional]
    unknown = sorted(set(names) - {c[0] for c in known})
    if unknown:
        extra = f" (and, when named, {[c[0] for c in optional]})" if optional else ""
        raise SystemExit(f"--columns: unknown {unknown}; this table has {[c[0] for c in columns]}{extra}")
    return [c for c in known if c[0] in names]


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)


def start(doc: str, script: str, argv: list[str] | None, extra_args=None):
    """Parse a repro script's command line: (args, profile, store, the command as it will be recorded)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(PROFILES[args.profile].results_dir())
    for option, folder in (("--out ", args.out), ("--runs ", args.runs)):  # before the work they will hold
        try:
            check_writable_dir(Path(folder), option)
        except ValueError as e:
            parser.error(str(e))
    setup_logging()
    command = (f"python repro/{script} " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    profile = profile_from_args(args)
    try:
        placement = placement_from_args(args, profile)
    except ValueError as e:
        parser.error(str(e))
    store = Store(args.runs, force=args.force, placement=placement, max_memory=args.max_memory, strict=args.strict_cache)
    warn_if_stored_under_other_versions(args.runs)
    return args, profile, store, command
