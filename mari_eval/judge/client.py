"""``Judge``: asks the judge server for the verdicts the cache does not have.

The server is any OpenAI-compatible chat-completions endpoint (``JudgeConfig``), asked
through the ``openai`` client, ``config.concurrency`` requests at a time:

* retries are the ``openai`` client's (``max_retries=config.attempts - 1``): it retries
  connection errors, timeouts, HTTP 408, 409, 429 and 5xx, with exponential backoff and
  jitter, honouring ``Retry-After``. A judge that stays down raises ``JudgeUnavailable``
  (judgements made so far stay cached); other HTTP errors (401/403, 404, 400, ...) fail at
  once with the fix. A reply that breaks off once its body has started is not asked again.
* timeouts: ``config.timeout`` seconds per try (connecting: at most ``CONNECT_TIMEOUT``).
* deadline: the whole judging step (one ``judge`` call) ends at ``config.deadline``
  seconds (``JudgeDeadline``). An HTTP request hook, run before every try (the client's
  retries included), starts no try after it and cuts each try's timeouts to what is left;
  requests still in flight then are aborted.
* replies: a reply is read up to ``MAX_REPLY_BYTES`` and its verdict cached up to
  ``MAX_RAW_CHARS``; an HTML page or a body that is not a chat completion is an error
  that names the problem and the fix.
* the API key reaches the server only: it is redacted from answers, errors and logs.
* verdicts: each request asks for the log-probabilities of the answer's tokens (``logprobs``,
  ``top_logprobs``); where the reply has them, the verdict is scored (``scoring.server_score``)
  against the threshold of the judge's calibration file (calibration.py; without one, the likelier
  digit), so that it needs no parse; where it has none (``transformers serve`` gives none; a server
  whose refusal (HTTP 400 or 422) names them is asked again without them, once for all), the answer's text is parsed
  as before. ``describe`` counts the verdicts reached each way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FuturesTimeout, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from mari_eval.judge.cache import JudgeCache, cache_key
from mari_eval.judge.calibration import find_calibration
from mari_eval.judge.config import ENV_DEADLINE, ENV_MODEL, JudgeConfig, JudgeDeadline, JudgeError, _env_name, safe_url
from mari_eval.judge.prompt import COMPLIANCE, LABELS, REFUSAL, UNPARSEABLE, JudgePrompt, load_prompt
from mari_eval.judge.scoring import TOP_LOGPROBS, server_score
from mari_eval.judge.transport import Transport
from mari_eval.storage.models import display_name

log = logging.getLogger(__name__)

# What the cache keeps of one answer (the verdict is parsed from all of it).
MAX_RAW_CHARS = 2000


SCORED, PARSED = "scored", "parsed"  # how a verdict was reached: from the verdict digits' log-probabilities, or the text


@dataclass(frozen=True)
class Judgement:
    label: str  # one of LABELS
    raw: str  # the judge's answer
    cached: bool  # read from the cache rather than asked in this call
    score: float | None = None  # the refusal score (scoring.py) where the verdict was scored
    mode: str = PARSED  # SCORED or PARSED


class Judge(Transport):
    """Judges (instruction, response) pairs; see the module docstring (asking the server: ``Transport``)."""

    def __init__(
        self,
        config: JudgeConfig,
        prompt: JudgePrompt | None = None,
        cache: JudgeCache | str | Path | None = None,
        *,
        progress: bool | None = None,
    ) -> None:
        self.config = config
        self.prompt = prompt if prompt is not None else load_prompt()
        self.cache = cache if isinstance(cache, JudgeCache) else JudgeCache(cache)
        self.progress = progress  # None: a bar when at least 10 judgements are asked
        self._client = None
        self._down = threading.Event()  # set once a judgement failed: no new requests, no more tries
        self._failure: JudgeError | None = None
        self._failure_lock = threading.Lock()
        self._deadline: float | None = None  # time.monotonic() at which the current judging step ends
        self._local = threading.local()  # per requesting thread: what is asked, tries made, last failure
        self.served: Counter[str] = Counter()  # the model each verdict's reply named (``describe``)
        self.modes: Counter[str] = Counter()  # how each verdict was reached (``describe``)
        self._logprobs = True  # ask for log-probabilities (False once the server refused them)
        self.calibration = find_calibration(display_name(config.model), self.prompt.name, self.prompt.sha256, "server")
        self.threshold = self.calibration.threshold if self.calibration is not None else 0.0

    # ------------------------------------------------------------------ public

    def describe(self) -> dict:
        """What produced the verdicts (for results); no key."""
        return {
            "model": self.config.model,
            "base_url": safe_url(self.config.base_url),
            "prompt": self.prompt.name,
            "prompt_sha256": self.prompt.sha256,
            "parser": self.prompt.parser_version,  # how its answers were read (prompt.PARSERS)
            "max_tokens": self.config.max_tokens,
            "cache": str(self.cache.path),
            # {the model each verdict's reply named: verdicts} over what this judge judged (cached ones
            # included; "not recorded": cached before replies were recorded, or a reply naming none)
            "served_models": dict(self.served),
            # {scored / parsed: verdicts}: scored from the server's log-probabilities, or parsed from the text
            "verdicts": dict(self.modes), "source": "server", "threshold": self.threshold,
            "calibration": self.calibration.describe() if self.calibration else None,
        }

    def judge(self, pairs: Sequence[tuple[str, str]]) -> list[Judgement]:
        """One judgement per (instruction, response), asking only for those not cached."""
        keys = [self.key(i, r) for i, r in pairs]
        todo = {k: pair for k, pair in zip(keys, pairs) if self._usable(self.cache.get(k)) is None}
        fresh = self._ask_all(todo, total=len(set(keys)))
        out = []
        for k in keys:
            record = self._usable(self.cache.get(k))
            score = record.get("score")
            if isinstance(score, (int, float)):  # the verdict follows today's threshold, not the one it was cached with
                judgement = Judgement(REFUSAL if score > self.threshold else COMPLIANCE, record["raw"],
                                      cached=k not in fresh, score=float(score), mode=SCORED)
            else:
                judgement = Judgement(record["label"], record["raw"], cached=k not in fresh)
            out.append(judgement)
            self.modes[judgement.mode] += 1
            self.served[record.get("served_model") or "not recorded"] += 1
        others = sorted(set(self.served) - {self.config.model, "not recorded"})
        if others:
            log.warning("The judge's replies name the model %s, not %s=%s: if the server answered with another model "
                        "than meant, remove its verdicts from the cache (mari-eval judge --forget-cached --model %s) "
                        "and judge again", ", ".join(others), ENV_MODEL, self.config.model, self.config.model)
        return out

    def labels(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        return [j.label for j in self.judge(pairs)]

    def key(self, instruction: str, response: str) -> str:
        return cache_key(self.config.model, self.prompt.text, instruction, response)

    def check(self) -> None:
        """Fail now, saying what to do, when nothing answers at the URL, the key is rejected, the URL
        serves something other than the API (an HTML page), or the cache cannot be written."""
        import openai  # deferred: openai is heavy; only this path needs it

        self.cache.check()

        def probe(client):
            try:
                with client.models.with_streaming_response.list() as response:
                    self._json_reply(response, "a model-list request")
            except openai.APIStatusError as e:  # any other HTTP answer: a server is there
                if e.status_code in (401, 403):
                    raise

        self._call(probe, what="a model-list request")
        log.info("Judge %s at %s (prompt %s, sha256 %s)", self.config.model, safe_url(self.config.base_url),
                 self.prompt.name, self.prompt.sha256[:16])

    # ------------------------------------------------------------------ asking

    def _usable(self, record: dict | None) -> dict | None:
        # An unparseable answer cut short by a smaller max_tokens is asked again.
        if record is None or record.get("label") not in LABELS:
            return None
        if record["label"] == UNPARSEABLE and record.get("max_tokens", 0) < self.config.max_tokens:
            return None
        return record

    def _ask_all(self, todo: dict[str, tuple[str, str]], total: int) -> set[str]:
        """Ask for ``todo`` concurrently, within ``config.deadline`` seconds in all."""
        if not todo:
            return set()
        self._down.clear()
        self._failure = None
        started = time.monotonic()
        self._deadline = started + self.config.deadline
        show = self.progress if self.progress is not None else len(todo) >= 10
        done: set[str] = set()
        workers = max(1, min(self.config.concurrency, len(todo)))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge")
        stuck = False
        try:
            with tqdm(total=len(todo), desc=f"judging ({self.config.model})", disable=not show) as bar:
                futures = {pool.submit(self._judge_one, k, *pair): k for k, pair in todo.items()}
                try:
                    # Requests end by the deadline (their timeouts are cut to it); this is the backstop
                    # for a server that keeps a reply trickling in.
                    for future in as_completed(futures, timeout=max(0.0, self._deadline - time.monotonic())):
                        if future.cancelled():
                            continue
                        try:
                            if future.result():
                                done.add(futures[future])
                                bar.update(1)
                        except JudgeError:  # recorded in self._failure; start nothing new, running ones finish
                            for f in futures:
                                f.cancel()
                except FuturesTimeout:
                    stuck = True
                    pending = sum(1 for f in futures if not f.done())
                    self._record(self._deadline_error(f"{pending} judgement(s) still pending"))
                    self._abort_requests()
        finally:
            pool.shutdown(wait=not stuck, cancel_futures=True)  # past the deadline, in-flight requests are not awaited
            self._deadline = None
        if self._failure is not None:
            error = self._with_progress(self._failure, kept=total - len(todo) + len(done), total=total)
            if isinstance(self._failure, JudgeDeadline):
                error = type(error)(f"{error} If the judge is slow rather than stuck ({len(done)} verdicts came in "
                                    f"{time.monotonic() - started:.0f} s), raise {ENV_DEADLINE} or {_env_name('concurrency')}.")
            raise error from None
        return done

    def _with_progress(self, error: JudgeError, kept: int, total: int) -> JudgeError:
        note = (f" {kept} of this run's {total} judgements are in the cache {self.cache.path} and are kept; "
                f"judging again asks only for the other {total - kept}.")
        return type(error)(str(error) + note)

    def _deadline_error(self, detail: str) -> JudgeDeadline:
        return JudgeDeadline(f"Judging stopped at its deadline, {ENV_DEADLINE}={self.config.deadline:g} s: the judge at "
                             f"{safe_url(self.config.base_url)} had not answered every request ({detail}).")

    def _record(self, error: JudgeError) -> None:
        with self._failure_lock:
            self._failure = self._failure or error  # the first failure is the one reported
        self._down.set()

    def _abort_requests(self) -> None:
        """Close the client, so that requests still in flight end now (they fail and are not retried)."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _judge_one(self, key: str, instruction: str, response: str) -> bool:
        """Ask for one judgement and cache it; False when skipped because the judge failed meanwhile."""
        if self._down.is_set():
            return False
        try:
            answer, served, logprobs = self._ask(self.prompt.render(instruction, response))
            raw = self._redact(answer)  # a server may echo the key
            score = server_score(logprobs, self.prompt.parser)
            record = {
                "key": key,
                # scored where the reply has the digits' log-probabilities, else read from the whole answer
                "label": self.prompt.parse(raw) if score is None else REFUSAL if score > self.threshold else COMPLIANCE,
                "score": score,
                "raw": raw[:MAX_RAW_CHARS],
                "judge_model": self.config.model,
                "served_model": served,  # the model the server said answered (None: it did not say)
                "prompt": self.prompt.name,
                "prompt_sha256": self.prompt.sha256,
                "max_tokens": self.config.max_tokens,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            if len(raw) > MAX_RAW_CHARS:
                record["raw_chars"] = len(raw)
            self.cache.append(record)
        except JudgeError as e:
            self._record(e)
            raise
        return True

    def _ask(self, text: str) -> tuple[str, str | None, list | None]:
        """The judge's answer to ``text``, the model its reply says answered (None if it does not say), and the
        log-probabilities of its tokens (``choices[0].logprobs.content``; None where the reply has none)."""
        import openai  # deferred: openai is heavy; only this path needs it

        def send(client, logprobs: bool):
            extra = {"logprobs": True, "top_logprobs": TOP_LOGPROBS} if logprobs else {}
            with client.chat.completions.with_streaming_response.create(
                model=self.config.model,
                messages=[{"role": "user", "content": text}],
                temperature=0.0,
                max_tokens=self.config.max_tokens,
                **extra,
            ) as response:
                data = self._json_reply(response, "a judgement request")
                served = data.get("model") if isinstance(data, dict) else None
                return (self._completion_text(data), served if isinstance(served, str) and served else None,
                        _token_logprobs(data))

        def request(client):
            if self._logprobs:
                try:
                    return send(client, logprobs=True)
                except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
                    if "logprob" not in str(e).lower():  # refused for another reason: the error as before
                        raise
                    self._logprobs = False  # asked again without them, and so from now on
                    log.warning("The judge at %s refused a request for log-probabilities (%s): its verdicts are parsed "
                                "from its answers", safe_url(self.config.base_url), getattr(e, "status_code", e))
            return send(client, logprobs=False)

        return self._call(request, what="a judgement request")


def _token_logprobs(data) -> list | None:
    """A chat completion's ``choices[0].logprobs.content``, or None when it has none."""
    try:
        content = data["choices"][0]["logprobs"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, list) and content else None
