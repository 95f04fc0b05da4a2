"""How a ``Judge`` reaches its server: one chat-completions request through the ``openai`` client
(``Transport._call``), its tries, timeouts and deadline (the HTTP hooks ``_before_try`` and
``_after_try``), and its reply read and checked (``_json_reply``, ``_completion_text``).

A mixin of ``mari_eval.judge.client.Judge``, whose ``__init__`` sets what it reads: ``config``,
``_client``, ``_deadline``, ``_down`` and ``_local`` (per requesting thread: what is asked, the
tries made, the last failure). The retry policy is the openai client's; see client.py's docstring.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Callable

from mari_eval.judge.config import (CONNECT_TIMEOUT, ENV_API_KEY, ENV_API_KEY_FALLBACK, ENV_BASE_URL, ENV_MODEL,
                                    JudgeError, JudgeUnavailable, _env_name, safe_url)

log = logging.getLogger("mari_eval.judge.client")  # retries are logged as the client's

# A reply is read up to this many bytes, and no further: a verdict is a few hundred
# characters (max_tokens caps what a compliant server writes), a model list a few KB.
MAX_REPLY_BYTES = 1 << 20


class _ReplyInterrupted(Exception):
    """The connection failed while a reply's body was read (after the client returned it: not retried)."""


class Transport:
    """Requests to the judge server and their replies (see the module docstring)."""

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
        import openai  # deferred: openai is heavy; only this path needs it

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
            import openai  # deferred: openai is heavy; only a request needs it

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
    import openai  # deferred: openai is heavy; only this path needs it

    if isinstance(e, (openai.APIConnectionError, _ReplyInterrupted)):  # APITimeoutError included
        return True
    status = getattr(e, "status_code", None)
    return status in (408, 409, 429) or (status is not None and status >= 500)


def _describe(e) -> str:
    status = getattr(e, "status_code", None)
    message = str(e).splitlines()[0][:300] if str(e) else ""
    name = "connection lost" if isinstance(e, _ReplyInterrupted) else type(e).__name__
    return name + (f" HTTP {status}" if status else "") + (f": {message}" if message else "")
