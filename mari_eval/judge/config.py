"""The judge's settings: where it is (``MARI_JUDGE_*``), how hard it tries, and its errors.

``JudgeConfig`` holds the endpoint (base URL, served model name, API key) and the knobs
of ``TUNABLE`` (tokens, timeout, attempts, concurrency, deadline). ``from_env`` reads
arguments first, then ``MARI_JUDGE_*`` (the key: ``MARI_JUDGE_API_KEY``, else
``OPENAI_API_KEY``). ``attempts`` and ``timeout`` go to the ``openai`` client, which
retries (``max_retries=attempts - 1``) with its own backoff; ``MARI_JUDGE_BACKOFF`` and
``MARI_JUDGE_MAX_BACKOFF`` (``RETIRED``) are accepted and have no effect (a warning says so). Settings out of range, numbers that are not numbers and an API key
with whitespace or control characters are refused with an error naming the variable and
the fix; the key itself is never written to logs, errors or results (``repr`` hides it,
``safe_url`` strips credentials from a URL).

Every failure of the judge is a ``JudgeError`` whose message names the problem and the fix.
"""

from __future__ import annotations

import logging
import math
import os
import urllib.parse
from dataclasses import dataclass, field

from mari_eval.storage.numbers import NumberError, read_number

ENV_BASE_URL = "MARI_JUDGE_BASE_URL"
ENV_MODEL = "MARI_JUDGE_MODEL"
ENV_API_KEY = "MARI_JUDGE_API_KEY"
ENV_API_KEY_FALLBACK = "OPENAI_API_KEY"
ENV_CACHE = "MARI_JUDGE_CACHE"  # path of the cache file
ENV_PROMPT = "MARI_JUDGE_PROMPT"  # prompt name: SORRY_PROMPT (default) or OWN_PROMPT
ENV_DEADLINE = "MARI_JUDGE_DEADLINE"  # seconds for one judging step (JudgeConfig.deadline)


log = logging.getLogger(__name__)


class JudgeError(RuntimeError):
    """The judge could not be used: the message names the problem and the fix."""


class JudgeNotConfigured(JudgeError):
    """No judge endpoint or model is configured."""


class JudgeUnavailable(JudgeError):
    """The judge server did not answer after every retry."""


class JudgeDeadline(JudgeUnavailable):
    """The judging step did not finish within ``JudgeConfig.deadline`` seconds."""


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class JudgeConfig:
    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    max_tokens: int = 64  # judge answer length; "#thescore: 1" needs about 6 tokens
    timeout: float = 120.0  # seconds one try may wait on the server (connecting: at most CONNECT_TIMEOUT)
    attempts: int = 5  # tries per request: the openai client's max_retries is attempts - 1
    concurrency: int = 4  # requests in flight
    deadline: float = 300.0  # seconds for one judging step (all the judgements one call asks for)
    backoff: float | None = None  # retired (RETIRED): no effect, accepted so that old callers still run
    max_backoff: float | None = None  # retired (RETIRED): no effect

    def __post_init__(self) -> None:
        for name, (kind, low, high, what) in TUNABLE.items():
            _check_setting(name, getattr(self, name), kind, low, high, what)
        for name in RETIRED:
            if getattr(self, name) is not None:
                _warn_retired(f"Judge setting {name}={getattr(self, name)!r}")
        if self.api_key:
            _check_api_key(self.api_key, f"The API key ({ENV_API_KEY}, else {ENV_API_KEY_FALLBACK})")

    @classmethod
    def from_env(cls, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 **kwargs) -> "JudgeConfig":
        """Arguments first, then ``MARI_JUDGE_*`` (key: then ``OPENAI_API_KEY``)."""
        base_url = base_url or os.environ.get(ENV_BASE_URL)
        model = model or os.environ.get(ENV_MODEL)
        keys = (("The api_key argument", api_key), (ENV_API_KEY, os.environ.get(ENV_API_KEY)),
                (ENV_API_KEY_FALLBACK, os.environ.get(ENV_API_KEY_FALLBACK)))
        key_source, api_key = next(((source, key) for source, key in keys if key), (None, None))
        if not base_url or not model:
            missing = [n for n, v in ((ENV_BASE_URL, base_url), (ENV_MODEL, model)) if not v]
            raise JudgeNotConfigured(
                f"SORRY-Bench refusal rates need an LLM judge, and {' and '.join(missing)} is not set. Point it at "
                f"any OpenAI-compatible server: {ENV_BASE_URL}=http://HOST:PORT/v1 {ENV_MODEL}=<served model name> "
                f"(and {ENV_API_KEY} if the server wants a key), e.g. vLLM serving Mistral-7B-Instruct-v0.2 (see "
                f"docs/judge.md); or start the embedded judge: python -m mari_eval.judge serve"
            )
        if api_key:
            _check_api_key(api_key, key_source)
        for name in RETIRED:  # read by older versions: said to have no effect, never refused
            if os.environ.get(_env_name(name)):
                _warn_retired(f"{_env_name(name)}={os.environ[_env_name(name)]!r}")
        for name, (kind, low, high, what) in TUNABLE.items():  # MARI_JUDGE_MAX_TOKENS=128 etc., arguments first
            value = os.environ.get(_env_name(name))
            if name not in kwargs and value:
                try:
                    kwargs[name] = read_number(value, integer=kind is int)
                except NumberError as e:
                    noun = "whole number" if kind is int else "number"
                    raise JudgeError(f"{_env_name(name)}={value!r} is not a {noun} ({e.why}): it is {what}, "
                                     f"{_rule(kind, low, high)} (default {_default(name)}); set it to one or unset it") from None
        return cls(base_url=base_url.rstrip("/"), model=model, api_key=api_key, **kwargs)


# JudgeConfig fields that MARI_JUDGE_<NAME> can set: type, lowest value (None: above 0), highest, meaning.
TUNABLE = {
    "max_tokens": (int, 1, 4096, "the longest judge answer in tokens"),
    "timeout": (float, None, None, "the seconds one try of a request may wait on the server"),
    "attempts": (int, 1, 100, "the tries per request (the openai client retries attempts - 1 times)"),
    "concurrency": (int, 1, 256, "the number of requests in flight"),
    "deadline": (float, None, None, "the seconds one judging step may take in all"),
}

# Settings of older versions that no longer do anything: the openai client now chooses the wait
# between tries. Accepted (so that an environment or a call setting them still works), with a warning.
RETIRED = ("backoff", "max_backoff")
# The longest wait for a connection, per try (MARI_JUDGE_TIMEOUT when that is shorter).
CONNECT_TIMEOUT = 5.0

_warned: set[str] = set()


def _warn_retired(setting: str) -> None:
    if setting not in _warned:
        _warned.add(setting)
        log.warning("%s has no effect any more and is ignored: the openai client now chooses the wait between "
                    "retries (0.5 s, doubled per retry up to 8 s, with jitter; or the server's Retry-After, up to "
                    "2 minutes). MARI_JUDGE_ATTEMPTS (tries per request) and %s (the whole judging step) still "
                    "apply; unset it to silence this warning.", setting, ENV_DEADLINE)


def _env_name(name: str) -> str:
    return f"MARI_JUDGE_{name.upper()}"


def _default(name: str):
    return JudgeConfig.__dataclass_fields__[name].default


def _rule(kind, low, high) -> str:
    noun = "a whole number" if kind is int else "a finite number"
    if low is None:
        return f"{noun} above 0"
    return f"{noun} from {low} to {high}" if high is not None else f"{noun} of at least {low}"


def _check_setting(name: str, value, kind, low, high, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    ok = ok and math.isfinite(value) and (value > 0 if low is None else value >= low) and (high is None or value <= high)
    if not ok:
        raise JudgeError(f"Judge setting {name}={value!r} ({_env_name(name)}) is out of range: it is {what}, "
                         f"{_rule(kind, low, high)} (default {_default(name)}); set {_env_name(name)} to such a value or unset it")


_KEY_CHARS = {"\r": "a carriage return (\\r)", "\n": "a line feed (\\n)", "\t": "a tab", " ": "a space"}


def _check_api_key(key: str, source: str | None) -> None:
    """Refuse a key holding whitespace, control or non-ASCII characters (an HTTP header cannot carry
    them: the request would fail as a connection error), naming the character, never the key."""
    for i, ch in enumerate(key):
        if 0x21 <= ord(ch) <= 0x7E:
            continue
        what = _KEY_CHARS.get(ch) or (f"the control character U+{ord(ch):04X}" if ord(ch) < 0x20 or ord(ch) == 0x7F
                                      else f"the non-ASCII character U+{ord(ch):04X}")
        raise JudgeError(
            f"{source or 'The API key'} holds {what} at character {i + 1} of {len(key)}, which an HTTP header cannot "
            f"carry (a key read from a file with Windows line endings ends in \\r). Set it without it, e.g. "
            f"export {ENV_API_KEY}=\"$(tr -d '\\r\\n' < KEYFILE)\""
        )


def safe_url(url: str) -> str:
    """``url`` without user info, query or fragment (where credentials could hide)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
