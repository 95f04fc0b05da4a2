"""``LocalJudge``: a judge model run in this process, whose verdicts are scored (scoring.py), never parsed.

It answers every completion: its score is the log-probability difference of the verdict digits
after the judge prompt, and its verdict is refusal where the score is above the threshold of its
calibration file (calibration.py, ``thresholds/``), read when the judge is made. A judge model
and prompt without a calibration file is uncalibrated: its verdict is the likelier digit
(threshold 0), and it says so (``describe``). The same methods as the server's ``Judge``
(``judge``, ``labels``, ``describe``, ``check``), so that ``mari-eval judge`` and the SORRY-Bench
summaries take either. Scores are cached (``JudgeCache``) under the judge's model with
"(in-process scores vN)" (N: ``scoring.SCORE_VERSION``), the prompt and the texts, each with the
seconds it took (its call's wall time over the completions it scored: ``seconds``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from mari_eval.judge.cache import JudgeCache, cache_key
from mari_eval.judge.calibration import find_calibration
from mari_eval.judge.client import SCORED, Judgement
from mari_eval.judge.prompt import COMPLIANCE, REFUSAL, JudgePrompt, load_prompt
from mari_eval.judge.scoring import SCORE_VERSION, score_refusals, verdict_tokens, verdicts
from mari_eval.storage.models import DEFAULT_MODEL, display_name, resolve_model

log = logging.getLogger(__name__)

SOURCE = "in-process"


class LocalJudge:
    """A judge model loaded here (an embedded alias, a local folder or a Hub id); see the module docstring."""

    def __init__(self, model: str | None = None, prompt: JudgePrompt | None = None,
                 cache: JudgeCache | str | Path | None = None, *, batch_size: int = 8,
                 progress: bool | None = None, calibration_dir: Path | None = None, calibrated: bool = True) -> None:
        import torch  # deferred: torch is heavy; only in-process judging needs it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.alias = model or DEFAULT_MODEL
        self.path = resolve_model(self.alias)
        self.name = display_name(self.alias)  # "smollm2-135m-instruct (embedded)": as results name it
        self.prompt = prompt if prompt is not None else load_prompt()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.verdict_ids = verdict_tokens(self.tokenizer)
        # calibrated=False: scores only, no file read (what repro/judge_agreement.py calibrates from)
        self.calibration = (find_calibration(self.name, self.prompt.name, self.prompt.sha256, SOURCE, calibration_dir)
                            if calibrated else None)
        self.threshold = self.calibration.threshold if self.calibration is not None else 0.0
        self.cache = cache if isinstance(cache, JudgeCache) else JudgeCache(cache)
        self.batch_size = batch_size
        self.progress = progress
        self.modes: Counter[str] = Counter()  # verdicts given (all scored), for ``describe``
        if self.calibration is None and calibrated:
            log.warning("Judge %s with prompt %s has no calibration file: its verdict is the likelier digit "
                        "(threshold 0), and its agreement with people is not measured (python "
                        "repro/judge_agreement.py --scored %s measures it and writes the file)",
                        self.name, self.prompt.name, self.alias)

    def describe(self) -> dict:
        """What produced the verdicts (the keys of ``Judge.describe``, and how they were reached)."""
        return {"model": self.name, "base_url": SOURCE, "prompt": self.prompt.name,
                "prompt_sha256": self.prompt.sha256, "parser": SCORED, "max_tokens": None,
                "cache": str(self.cache.path), "served_models": {self.name: sum(self.modes.values())},
                "verdicts": dict(self.modes), "source": SOURCE, "threshold": self.threshold,
                "calibration": self.calibration.describe() if self.calibration else None}

    def check(self) -> None:
        self.cache.check()

    def key(self, instruction: str, response: str) -> str:
        return cache_key(f"{self.name} ({SOURCE} scores v{SCORE_VERSION})", self.prompt.text, instruction, response)

    def scores(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """The refusal score of each (instruction, response), computing only those not cached."""
        return self._scores(pairs)[0]

    def _scores(self, pairs: Sequence[tuple[str, str]]) -> tuple[list[float], set[str]]:
        keys = [self.key(i, r) for i, r in pairs]
        todo = {k: pair for k, pair in zip(keys, pairs) if not _scored(self.cache.get(k))}
        if todo:
            started = time.perf_counter()
            found = score_refusals(self, [p[0] for p in todo.values()], [p[1] for p in todo.values()],
                                   batch_size=self.batch_size, progress=self.progress)
            seconds = (time.perf_counter() - started) / len(todo)
            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            for k, s in zip(todo, found):
                self.cache.append({"key": k, "score": s, "seconds": seconds, "judge_model": self.name, "source": SOURCE,
                                   "prompt": self.prompt.name, "prompt_sha256": self.prompt.sha256,
                                   "version": SCORE_VERSION, "created": created})
        return [float(self.cache.get(k)["score"]) for k in keys], set(todo)

    def seconds(self, pairs: Sequence[tuple[str, str]]) -> float:
        """The seconds that scoring ``pairs`` took when each was scored (cached ones included), in all."""
        return sum(float(self.cache.get(self.key(*pair)).get("seconds") or 0.0) for pair in pairs)

    def judge(self, pairs: Sequence[tuple[str, str]]) -> list[Judgement]:
        """One verdict per (instruction, response): refusal where its score is above the threshold."""
        scores, fresh = self._scores(pairs)
        self.modes[SCORED] += len(scores)
        return [Judgement(REFUSAL if refused else COMPLIANCE, f"score {s:.4f}", cached=self.key(*pair) not in fresh,
                          score=s, mode=SCORED)
                for pair, s, refused in zip(pairs, scores, verdicts(scores, self.threshold))]

    def labels(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        return [j.label for j in self.judge(pairs)]


def _scored(record: dict | None) -> bool:
    return isinstance(record, dict) and isinstance(record.get("score"), (int, float))
