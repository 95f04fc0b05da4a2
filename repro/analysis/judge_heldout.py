"""Refusal judges on XSTest's held-out half: a scored judge's threshold chosen on the other half
(mari_eval/judge/calibration.py), and every judge's agreement with people where no threshold was chosen.

``scored_judge`` scores all completions in this process (``LocalJudge``, its scores cached), chooses
the threshold on the calibration half, judges the held-out half with it and writes the judge's
calibration file (what it reads at scoring time); ``held_out`` scores every judge's verdicts on the
held-out half: overall, safe and unsafe prompts, and each model (Mistral-instruct's among them).
``judged_column`` says whether the tables' judged column (the judge ``judge_identity`` names) reaches
the kappa floor. Used by repro/judge_agreement.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from mari_eval.judge import agreement as A
from mari_eval.judge import calibration as C
from mari_eval.judge.samples import described_label, readable_label
from repro.analysis import intervals
from repro.engine.judged import held_out_kappa

READING = A.DEFAULT_READING  # partial refusals are refusals, on both halves
MISTRAL = "model mistralinstruct"  # the subset of Mistral-instruct's completions
FLOOR_SOURCE = ("Landis & Koch (1977), The Measurement of Observer Agreement for Categorical Data, Biometrics 33(1): "
                "0.61-0.80 'substantial'")


def halves(rows: list[dict], limit_prompts: int | None = None) -> dict[str, list[int]]:
    """{half: indices of its completions} by ``calibration.half`` of each completion's prompt id; with
    ``limit_prompts``, only the first N prompts of each half (by their number)."""
    ids = {h: sorted({r["id"] for r in rows if C.half(r["id"]) == h}, key=_number) for h in C.HALVES}
    kept = {h: set(ids[h][:limit_prompts] if limit_prompts else ids[h]) for h in C.HALVES}
    return {h: [i for i, r in enumerate(rows) if r["id"] in kept[h]] for h in C.HALVES}


def _number(prompt_id: str):
    tail = prompt_id.rsplit("-", 1)[-1]
    return (int(tail), prompt_id) if tail.isdigit() else (10 ** 9, prompt_id)


def split_record(rows: list[dict], split: dict[str, list[int]], limit_prompts: int | None) -> dict:
    return {"rule": C.SPLIT_RULE, "seed": None, "limit_prompts": limit_prompts,
            "prompts": {h: len({rows[i]["id"] for i in split[h]}) for h in C.HALVES},
            "completions": {h: len(split[h]) for h in C.HALVES}}


def _subsets(rows: list[dict], where: list[int]) -> dict[str, list[int]]:
    """{subset: indices}: all of ``where``, its safe and unsafe prompts, each model's completions."""
    out = {"all": list(where),
           "safe prompts": [i for i in where if not rows[i]["type"].startswith("contrast_")],
           "unsafe prompts": [i for i in where if rows[i]["type"].startswith("contrast_")]}
    for model in sorted({rows[i]["model"] for i in where}):
        out[f"model {model}"] = [i for i in where if rows[i]["model"] == model]
    return out


def agreement_by_subset(rows: list[dict], where: list[int], verdicts: dict[int, bool | None]) -> dict:
    """{subset: agreement as JSON} of ``verdicts`` ({row index: refusal}) on the rows ``where``."""
    human = {i: A.human_refusal(rows[i]["final_label"], READING) for i in where}
    return {name: A.agreement([human[i] for i in idx], [verdicts[i] for i in idx], iterations=intervals.ITERATIONS,
                              seed=intervals.SEED).as_json()
            for name, idx in _subsets(rows, where).items()}


def auc(scores: list[float], human: list[bool]) -> float | None:
    """The probability that a human refusal scores above a human compliance (ties half): the area under
    the ROC curve of the scores, whatever the threshold; None with one class only."""
    from sklearn.metrics import roc_auc_score  # deferred: only the scored judges need it

    return float(roc_auc_score(human, scores)) if 0 < sum(human) < len(human) else None


def scored_judge(alias: str, rows: list[dict], split: dict[str, list[int]], command: str,
                 thresholds: Path | None = None, judge_factory: Callable | None = None,
                 limit_prompts: int | None = None) -> dict:
    """Score ``rows`` with the in-process judge ``alias``, choose its threshold on the calibration half,
    judge the held-out half, and write its calibration file; what judge_agreement.json records of it."""
    import torch  # deferred: torch is heavy; the other judges need none of it

    from mari_eval.judge.local import SOURCE, LocalJudge
    from mari_eval.judge.scoring import SCORE_VERSION, verdicts

    judge = (judge_factory or LocalJudge)(alias, progress=True, calibrated=False)
    used = sorted(split["calibration"] + split["held-out"])
    pairs = [(rows[i]["prompt"], rows[i]["completion"]) for i in used]
    cached_before = sum(judge.cache.get(judge.key(*p)) is not None for p in set(pairs))
    scores = dict(zip(used, judge.scores(pairs)))
    seconds = judge.seconds(pairs)
    calibrate = split["calibration"]
    threshold, calibration_kappa = C.choose_threshold(
        [scores[i] for i in calibrate], [A.human_refusal(rows[i]["final_label"], READING) for i in calibrate])
    held = split["held-out"]
    judged = dict(zip(held, verdicts([scores[i] for i in held], threshold)))
    by_subset = agreement_by_subset(rows, held, judged)
    described = {"model": judge.name, "prompt": judge.prompt.name, "prompt_sha256": judge.prompt.sha256,
                 "source": SOURCE, "verdicts": {"scored": len(held)}, "threshold": threshold}
    label = described_label(described)
    calibration_half = A.agreement([A.human_refusal(rows[i]["final_label"], READING) for i in calibrate],
                                   verdicts([scores[i] for i in calibrate], threshold), iterations=0).as_json()
    timing = {"seconds": round(seconds, 1), "seconds_per_completion": round(seconds / len(set(pairs)), 3),
              "completions_scored_now": len(set(pairs)) - cached_before, "completions": len(set(pairs)),
              "cpu_cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
              "how": "the wall time of the scoring call that computed each score, over the completions it scored "
                     "(read back from the judge cache for those scored before), summed"}
    record = {"judge": {k: described[k] for k in ("model", "prompt", "prompt_sha256", "source")},
              "label": label, "score": f"mari_eval/judge/scoring.py, version {SCORE_VERSION}",
              "threshold": threshold, "rule": C.THRESHOLD_RULE, "reading": READING,
              "calibration_half": {**{k: calibration_half[k] for k in ("n", "accuracy", "kappa", "confusion")},
                                   "auc": auc([scores[i] for i in calibrate], [A.human_refusal(rows[i]["final_label"],
                                                                                               READING) for i in calibrate])},
              "held_out": {**{k: by_subset["all"][k] for k in ("n", "accuracy", "accuracy_ci", "kappa", "kappa_ci",
                                                               "confusion")},
                           "mistralinstruct_kappa": by_subset.get(MISTRAL, {}).get("kappa"),
                           "auc": auc([scores[i] for i in held], [A.human_refusal(rows[i]["final_label"], READING)
                                                                  for i in held])},
              "kappa_floor": C.KAPPA_FLOOR, "split": split_record(rows, split, limit_prompts), "command": command,
              "data": "xstest/completions.jsonl.gz", "timing": timing}
    path = C.write_calibration(record, thresholds)
    return {**record, "calibration_file": f"mari_eval/judge/thresholds/{path.name}" if thresholds is None else str(path),
            "subsets": by_subset}


def held_out(rows: list[dict], split: dict[str, list[int]], judges: dict[str, tuple[str | None, dict[int, bool | None]]],
             scored: dict[str, dict]) -> dict:
    """{"reading", "kappa_floor", "floor_source", "judges": {name: {"label", "verdicts", "subsets"}}}: every
    judge on the held-out half (``judges``: {name: (its label, {row index: verdict})} for those with no
    threshold, whose verdicts may cover only some rows; ``scored``: ``scored_judge``'s records)."""
    out = {}
    for name, (label, verdicts) in judges.items():
        where = [i for i in split["held-out"] if i in verdicts]
        if where:
            out[name] = {"label": label, "subsets": agreement_by_subset(rows, where, verdicts)}
    for alias, record in scored.items():
        out[f"scored {alias}"] = {"label": record["label"], "threshold": record["threshold"],
                                  "calibration_kappa": record["calibration_half"]["kappa"],
                                  "auc": [record["calibration_half"]["auc"], record["held_out"]["auc"]],
                                  "timing": record["timing"], "subsets": record["subsets"]}
    return {"reading": READING, "kappa_floor": C.KAPPA_FLOOR, "floor_source": FLOOR_SOURCE, "judges": out}


def judged_column(record: dict) -> dict:
    """Whether the tables' judged SORRY-Bench column reaches the kappa floor: its judge (``judge_identity``:
    the configured one, else the embedded one through ``transformers serve``) and that judge's held-out
    kappa here (``--llm``; None: not measured, NaN, written null: undefined, no verdict read)."""
    from mari_eval.judge.server import judge_identity

    identity = judge_identity()
    label = readable_label(f"{identity['model']} | prompt {identity['prompt']} sha256:{identity['prompt_sha256']}")
    kappa = held_out_kappa(record, label)
    return {"judge": label, "kappa": kappa, "measured": kappa is not None, "floor": C.KAPPA_FLOOR,
            "passes": C.kappa_reaches_floor(kappa),
            "rule": f"a judged column is printed when its judge's held-out kappa reaches {C.KAPPA_FLOOR} "
                    f"({FLOOR_SOURCE}), else n/a with the kappa (repro/engine/judged.py)"}


def figure(value, ci=None) -> str:
    """A figure to 3 decimals with its interval, or n/a (None or NaN)."""
    if value is None or value != value:
        return "n/a"
    return f"{value:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def confusion_text(c: dict) -> str:
    """A confusion matrix as "human refusal judged refusal / judged compliance / human compliance judged ..."."""
    return (f"{c['human refusal']['judge refusal']} / {c['human refusal']['judge compliance']} / "
            f"{c['human compliance']['judge refusal']} / {c['human compliance']['judge compliance']}")


def markdown(record: dict) -> str:
    """The held-out section of results/judge_agreement.md."""
    from repro.analysis.tables import markdown_table  # deferred: the tables module is heavy

    split, held = record["split"], record["held_out"]
    limited = f" (only the first {split['limit_prompts']} prompts of each half)" if split["limit_prompts"] else ""
    lines = ["\n## The held-out half (partial refusals counted as refusals)\n",
             f"Split {split['rule']} (deterministic, no seed): {split['prompts']['calibration']} prompts "
             f"({split['completions']['calibration']} completions) to calibrate, {split['prompts']['held-out']} "
             f"({split['completions']['held-out']}) held out{limited}. A scored judge's verdict is refusal where its "
             "score, log P(refusal digit) - log P(compliance digit) right after the judge prompt "
             "(mari_eval/judge/scoring.py), is above its threshold, chosen on the calibration half by "
             f"{C.THRESHOLD_RULE}; written with the judge's calibration file (mari_eval/judge/thresholds/), which the "
             "judge reads when it scores. The other judges have no threshold: their verdicts as above, on the held-out "
             "half only. AUC: the probability that a human refusal scores above a human compliance (ties half), "
             f"whatever the threshold. Kappa floor of the tables' judged columns: {held['kappa_floor']} ({held['floor_source']}). "
             "Seconds: the scoring's wall time on this machine (cores and torch threads beside it), the models scored "
             "one after the other.\n"]
    rows = []
    for name, entry in held["judges"].items():
        a = entry["subsets"]["all"]
        mistral = entry["subsets"].get(MISTRAL)
        timing = entry.get("timing")
        rows.append([name, "n/a" if "threshold" not in entry else f"{entry['threshold']:.4f}",
                     figure(entry.get("calibration_kappa")),
                     " / ".join(figure(a) for a in entry["auc"]) if entry.get("auc") else "n/a", f"{a['n']}" + (f" (+{a['unparseable']} unparseable)"
                                                                              if a["unparseable"] else ""),
                     figure(a["accuracy"], a["accuracy_ci"]), figure(a["kappa"], a["kappa_ci"]), confusion_text(a["confusion"]),
                     "n/a" if mistral is None else f"{figure(mistral['kappa'], mistral['kappa_ci'])} (n={mistral['n']})",
                     "-" if timing is None else (f"{timing['seconds']:.0f} s ({timing['seconds_per_completion']:.2f} s "
                                                 f"each; {timing['cpu_cores']} cores, {timing['torch_threads']} threads; "
                                                 f"{timing['completions_scored_now']} of {timing['completions']} scored by "
                                                 "this run, the others read back from the judge cache)")])
    lines.append(markdown_table(["judge", "threshold", "kappa, calibration half", "AUC, calibration / held-out", "n", "accuracy", "Cohen's kappa",
                                 "confusion", "kappa, Mistral-instruct", "seconds"], rows))
    subsets = [name for name in next(iter(held["judges"].values()))["subsets"] if name != "all"] if held["judges"] else []
    lines.append("\nCohen's kappa (accuracy, n) by subset, held-out half:\n")
    lines.append(markdown_table(["judge"] + subsets, [
        [name] + [f"{figure(e['subsets'][s]['kappa'])} ({figure(e['subsets'][s]['accuracy'])}, n={e['subsets'][s]['n']})"
                  if s in e["subsets"] else "n/a" for s in subsets] for name, e in held["judges"].items()]))
    labels = [f"`{name}`: {entry['label']}" for name, entry in held["judges"].items() if entry.get("label") not in (None, name)]
    if labels:
        lines.append("\nJudges' labels (as the tables name them): " + "; ".join(labels) + ".\n")
    column = record["judged_column"]
    kappa = ("not measured" if column["kappa"] is None else "undefined (no verdict read)" if column["kappa"] != column["kappa"]
             else f"{column['kappa']:.3f}")
    lines.append(f"\nThe tables' judged column is read by {column['judge']}: held-out kappa {kappa}, "
                 f"{'reaches' if column['passes'] else 'below'} the floor {column['floor']}: its cells are "
                 f"{'printed' if column['passes'] else 'n/a'}.\n")
    return "\n".join(lines)
