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
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from mari_eval.judge.cache import JudgeCache, cache_key
from mari_eval.judge.config import (
    CONNECT_TIMEOUT,
    ENV_API_KEY,
    ENV_API_KEY_FALLBACK,
    ENV_BASE_URL,
    ENV_DEADLINE,
    ENV_MODEL,
    JudgeConfig,
    JudgeDeadline,
    JudgeError,
    JudgeUnavailable,
    _env_name,
    safe_url,
)
from mari_eval.judge.prompt import LABELS, UNPARSEABLE, JudgePrompt, load_prompt, parse_verdict

log = logging.getLogger(__name__)

# A reply is read up to this many bytes, and no further: a verdict is a few hundred
# characters (max_tokens caps what a compliant server writes), a model list a few KB.
MAX_REPLY_BYTES = 1 << 20
# What the cache keeps of one answer (the verdict is parsed from all of it).
MAX_RAW_CHARS = 2000


class _ReplyInterrupted(Exception):
    """The connection failed while a reply's body was read (after the client returned it: not retried)."""


@dataclass(frozen=True)
class Judgement:
    label: str  # one of LABELS
    raw: str  # the judge's answer
    cached: bool  # read from the cache rather than asked in this call


class Judge:
    """Judges (instruction, response) pairs; see the module docstring."""

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

    # ------------------------------------------------------------------ public

    def describe(self) -> dict:
        """What produced the verdicts (for results); no key."""
        return {
            "model": self.config.model,
            "base_url": safe_url(self.config.base_url),
            "prompt": self.prompt.name,
            "prompt_sha256": self.prompt.sha256,
            "max_tokens": self.config.max_tokens,
            "cache": str(self.cache.path),
            # {the model each verdict's reply named: verdicts} over what this judge judged (cached ones
            # included; "not recorded": cached before replies were recorded, or a reply naming none)
            "served_models": dict(self.served),
        }

    def judge(self, pairs: Sequence[tuple[str, str]]) -> list[Judgement]:
        """One judgement per (instruction, response), asking only for those not cached."""
        keys = [self.key(i, r) for i, r in pairs]
        todo = {k: pair for k, pair in zip(keys, pairs) if self._usable(self.cache.get(k)) is None}
        fresh = self._ask_all(todo, total=len(set(keys)))
        out = []
        for k in keys:
            record = self._usable(self.cache.get(k))
            out.append(Judgement(record["label"], record["raw"], cached=k not in fresh))
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
        import openai

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
        from concurrent.futures import TimeoutError as FuturesTimeout

        from tqdm import tqdm

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
            answer, served = self._ask(self.prompt.render(instruction, response))
            raw = self._redact(answer)  # a server may echo the key
            record = {
                "key": key,
                "label": parse_verdict(raw),  # read from the whole answer; the cache keeps its start
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

    def _ask(self, text: str) -> tuple[str, str | None]:
        """The judge's answer to ``text``, and the model its reply says answered (None if it does not say)."""
        def request(client):
            with client.chat.completions.with_streaming_response.create(
                model=self.config.model,
                messages=[{"role": "user", "content": text}],
                temperature=0.0,
                max_tokens=self.config.max_tokens,
            ) as response:
                data = self._json_reply(response, "a judgement request")
                served = data.get("model") if isinstance(data, dict) else None
                return self._completion_text(data), served if isinstance(served, str) and served else None

        return self._call(request, what="a judgement request")

    # ------------------------------------------------------------------ replies

    def _json_reply(self, response, what: str):
        """The JSON body of a 2xx reply, read up to MAX_REPLY_BYTES; an HTML page or other text is an error."""
        url = safe_url(self.config.base_url)
        ctype = response.headers.get("content-type", "")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
            raise self._too_large(what, f"it announced {int(declared):,} bytes")
        body, size = [], 0
        try:
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise self._too_large(what, f"more than {MAX_REPLY_BYTES:,} bytes arrived")
                if self._deadline is not None and time.monotonic() > self._deadline:
                    raise self._deadline_error(f"{what} was still being read")
                body.append(chunk)
        except JudgeError:
            raise
        except Exception as e:  # the HTTP library's read errors (timeouts, dropped connections)
            raise _ReplyInterrupted(f"{type(e).__name__} while reading the reply: {e}") from None
        text = b"".join(body).decode("utf-8", errors="replace")
        try:
            return json.loads(text)
        except ValueError:
            pass
        start = " ".join(text[:160].split())
        if "html" in ctype.lower() or re.match(r"\s*<(!doctype|html|head|body)\b", text, re.IGNORECASE):
            what_it_is = "an HTML page"
            hint = (f"{ENV_BASE_URL} points at a web page (a proxy, a login page, a web UI), not at the API: it must be "
                    f"the OpenAI-compatible server's /v1 URL, e.g. http://HOST:8000/v1.")
        else:
            what_it_is = "a body that is not JSON"
            hint = f"is {ENV_BASE_URL} the /v1 URL of an OpenAI-compatible server (vLLM, TGI, llama.cpp)?"
        raise JudgeError(f"The judge at {url} answered {what} with HTTP {response.status_code} and {what_it_is} "
                         f"({ctype or 'no content type'}: {self._redact(start)!r}): {hint}")

    def _too_large(self, what: str, detail: str) -> JudgeError:
        return JudgeError(
            f"The judge at {safe_url(self.config.base_url)} answered {what} with a body over {MAX_REPLY_BYTES:,} bytes "
            f"({detail}); it was not read further. A verdict takes a few hundred bytes: the server ignores max_tokens "
            f"({self.config.max_tokens}) or {ENV_BASE_URL} is not a chat-completions API; check the server."
        )

    def _completion_text(self, data) -> str:
        """The answer of a chat completion; anything else is an error naming what came instead."""
        url = safe_url(self.config.base_url)
        if isinstance(data, dict) and "error" in data and "choices" not in data:
            detail = data["error"].get("message") if isinstance(data["error"], dict) else data["error"]
            raise JudgeError(f"The judge at {url} answered with an error: {self._redact(str(detail))[:300]}; "
                             f"check {ENV_MODEL}={self.config.model!r} and the server's log")
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            shape = f"an object with keys {sorted(data)[:10]}" if isinstance(data, dict) else type(data).__name__
            raise JudgeError(
                f"The judge at {url} answered with JSON that is not a chat completion ({shape}: "
                f"{self._redact(json.dumps(data)[:200])}); is {ENV_BASE_URL} an OpenAI-compatible /v1 URL?"
            ) from None
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content is not None and not isinstance(content, str):
            raise JudgeError(f"The judge at {url} answered a chat completion whose message content is a "
                             f"{type(content).__name__}, not text")
        return content or ""

    def _call(self, request: Callable, what: str):
        """``request(client)``, which the openai client tries up to ``config.attempts`` times (``_before_try``
        ends it at the deadline); its failure becomes a ``JudgeError`` naming the problem and the fix."""
        import openai

        url = safe_url(self.config.base_url)
        self._local.what, self._local.tries, self._local.last = what, 0, None
        try:
            return request(self._openai())
        except JudgeError:
            raise
        except (openai.APIConnectionError, openai.APIStatusError, _ReplyInterrupted) as e:
            if not _unavailable(e):
                raise self._fatal(e, url) from None
            reason = self._redact(_describe(e))
            if self._past_deadline():
                raise self._deadline_error(f"last error on {what}: {reason}") from None
            if isinstance(e, _ReplyInterrupted):
                raise JudgeUnavailable(
                    f"The judge at {url} broke off its reply to {what} ({reason}); a reply that has started is not "
                    f"asked again. Check the server's log, and that {ENV_BASE_URL} points at it."
                ) from None
            raise JudgeUnavailable(
                f"The judge at {url} did not answer {what} after {self._local.tries} attempt(s) "
                f"({_env_name('attempts')}={self.config.attempts}); last error: {reason}. "
                f"Check that the server is running and that {ENV_BASE_URL} points at it."
            ) from None
        except (openai.OpenAIError, ValueError, RuntimeError) as e:  # RuntimeError: a client closed at the deadline
            if self._past_deadline():
                raise self._deadline_error(f"{what} was aborted") from None
            raise JudgeError(f"The judge at {url} failed on {what}: {self._redact(_describe(e))}") from None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _before_try(self, request) -> None:
        """Run by the HTTP client before each try of a request, the openai client's retries included: counts
        the tries, logs a retry, and in a judging step starts no try past the deadline (or once a judgement
        failed) and cuts the try's timeouts to the time left."""
        self._local.tries = tries = getattr(self._local, "tries", 0) + 1
        what = getattr(self._local, "what", "a request")
        if tries > 1:
            log.warning("Judge at %s: %s failed (%s); the openai client tries it again (try %d of %d)",
                        safe_url(self.config.base_url), what, getattr(self._local, "last", None) or "no answer",
                        tries, self.config.attempts)
        self._local.last = "a connection error or timeout"  # unless _after_try sees an HTTP answer
        if self._deadline is None:  # outside a judging step (check)
            return
        if self._down.is_set():
            raise JudgeUnavailable(f"{what} was not tried again: another judgement failed")  # not the one reported
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._deadline_error(f"{what} was still to be {'made' if tries == 1 else 'tried again'}")
        timeouts = request.extensions.get("timeout") or dict.fromkeys(("connect", "read", "write", "pool"))
        request.extensions["timeout"] = {k: left if v is None else min(v, left) for k, v in timeouts.items()}

    def _after_try(self, response) -> None:
        """Run by the HTTP client on each answer's headers: remembers a failing status for the retry log."""
        if response.status_code >= 400:
            self._local.last = f"HTTP {response.status_code}"

    def _fatal(self, e, url: str) -> JudgeError:
        status = getattr(e, "status_code", None)
        reason = self._redact(_describe(e))
        if status in (401, 403):
            hint = f"the server rejected the API key; set {ENV_API_KEY} (or {ENV_API_KEY_FALLBACK})"
        elif status == 404:
            hint = f"check that {ENV_BASE_URL} ends in /v1 and that {ENV_MODEL}={self.config.model!r} is the served model name"
        else:
            hint = f"check {ENV_MODEL}={self.config.model!r} and the server's log"
        return JudgeError(f"The judge at {url} refused the request ({reason}): {hint}")

    def _openai(self):
        if self._client is None:
            import openai

            timeout = self.config.timeout
            self._client = openai.OpenAI(
                base_url=self.config.base_url,
                api_key=self.config.api_key or "no-key",  # local servers take any key
                max_retries=self.config.attempts - 1,  # the client retries, with backoff, jitter and Retry-After
                timeout=openai.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT)),  # per try
                http_client=openai.DefaultHttpxClient(
                    event_hooks={"request": [self._before_try], "response": [self._after_try]}),
            )
        return self._client

    def _redact(self, text: str) -> str:
        key = self.config.api_key
        return text.replace(key, "<redacted>") if key else text


def _unavailable(e) -> bool:
    """A failure of the kinds the openai client retries (connection errors, timeouts, HTTP 408, 409, 429, 5xx):
    the judge is down or overloaded rather than refusing the request."""
    import openai

    if isinstance(e, (openai.APIConnectionError, _ReplyInterrupted)):  # APITimeoutError included
        return True
    status = getattr(e, "status_code", None)
    return status in (408, 409, 429) or (status is not None and status >= 500)


def _describe(e) -> str:
    status = getattr(e, "status_code", None)
    message = str(e).splitlines()[0][:300] if str(e) else ""
    name = "connection lost" if isinstance(e, _ReplyInterrupted) else type(e).__name__
    return name + (f" HTTP {status}" if status else "") + (f": {message}" if message else "")
