"""A prompt-based refusal judge for SORRY-Bench, behind any OpenAI-compatible endpoint.

SORRY-Bench (Xie et al., 2024, "SORRY-Bench: Systematically Evaluating Large Language
Model Safety Refusal", arXiv:2406.14598) scores a response 1 when it fulfils the
harmful request and 0 when it refuses; the refusal rate is the fraction of 0s. The
judge here asks a chat model for that score:

* endpoint: any server speaking the OpenAI chat-completions API (vLLM, TGI, llama.cpp,
  ``transformers serve``, OpenAI), through the ``openai`` client. Base URL, model and key
  come from arguments or from ``MARI_JUDGE_BASE_URL``, ``MARI_JUDGE_MODEL`` and
  ``MARI_JUDGE_API_KEY`` (else ``OPENAI_API_KEY``). The key is never written to logs,
  errors, the cache or results.
* prompt: SORRY-Bench's own "base-#thescore" template, read at run time from
  ``$MARI_DATA_DIR/sorry_bench/judge_prompts.jsonl.gz`` when it is there; otherwise our
  own ``prompt.txt`` (same ``{question}``/``{answer}`` slots, same ``#thescore: 0/1``
  answer). Results name the prompt used and its sha256.
* presets (``MARI_JUDGE_PRESET``): ``sorry-bench-base`` (Mistral-7B-Instruct-v0.2 with that
  template) and ``sorry-bench-ft`` (SORRY-Bench's fine-tuned judge with the template it was
  trained on, answering a bare 0 or 1); ``python -m mari_eval.judge serve --preset NAME``
  serves one with ``transformers serve`` or vLLM.
* verdicts: ``parse_verdict`` (and ``parse_digit`` for the fine-tuned judge) is strict; an
  answer it cannot read is "unparseable", counted and reported, never guessed.
* cache: every judgement is appended to a JSON-lines file keyed by sha256 of (judge
  model, prompt text, instruction, response), so a rerun never asks twice.
* failures: the ``openai`` client retries connection errors, timeouts, HTTP 408, 409, 429
  and 5xx (``MARI_JUDGE_ATTEMPTS`` tries, its backoff with jitter, ``Retry-After``); a
  judge that stays down raises ``JudgeUnavailable`` (judgements made so far stay cached),
  and the whole judging step ends at one deadline (``JudgeDeadline``).
  A reply is read up to ``MAX_REPLY_BYTES`` and its verdict cached up to ``MAX_RAW_CHARS``;
  an HTML page, a body that is not a chat completion, settings out of range, an API key
  with whitespace or control characters and a cache path that is a directory are errors
  that name the problem and the fix.
* ``keyword_refusal`` (refusal-string matching) is reported beside the judged rate, so
  that a weak judge shows; ``refusal_summary`` computes both, overall and per category.
* ``serve_embedded`` starts ``transformers serve`` with the embedded instruct model on
  loopback: the default judge when none is configured (``python -m mari_eval.judge serve``).

This package's door (``mari_eval/judge/__init__.py``) re-exports the public names of its
modules, one idea each, so that ``from mari_eval import judge as J; J.Judge(...)`` is all a
caller needs:

* ``config``: the ``MARI_JUDGE_*`` settings (``JudgeConfig``) and the errors.
* ``prompt``: the prompt, ``parse_verdict`` and ``keyword_refusal``; ``presets``: the judge presets.
* ``cache``: the verdict cache (``JudgeCache``).
* ``client``: ``Judge``, which asks the server for what the cache lacks; ``transport``: its requests (the
  client's retries, deadline) and reply checks.
* ``summary``: ``refusal_summary`` and the category names.
* ``server``: the embedded ``transformers serve`` judge and ``main`` (``__main__``).
* ``samples``: saved generations (``mari-eval judge``) and their verdicts.
* ``sorry_bench``: the SORRY-Bench task's scoring, which harness_tasks/utils.py hands to lm-eval.
* ``agreement``: a refusal judge's verdicts against people's labels (XSTest; repro/judge_agreement.py).
* ``scoring``: verdicts scored, not parsed: ``score_refusals(judge, prompts, completions)`` (the
  log-probability difference of the verdict digits after the judge prompt) and ``verdicts(scores,
  threshold)``; ``server_score`` reads the same from a server's log-probabilities.
* ``calibration``: the split of XSTest by prompt, the threshold rule, the calibration files
  (``thresholds/*.json``) a scored judge reads, and the kappa floor of the tables' judged columns.
* ``local``: ``LocalJudge``, a judge model run in this process, every verdict scored.
"""

from mari_eval.judge.cache import JudgeCache, cache_key, default_cache_path
from mari_eval.judge.calibration import KAPPA_FLOOR, Calibration, choose_threshold, find_calibration, half
from mari_eval.judge.local import LocalJudge
from mari_eval.judge.scoring import score_refusals, server_score, verdicts
from mari_eval.judge.client import MAX_RAW_CHARS, Judge, Judgement
from mari_eval.judge.transport import MAX_REPLY_BYTES
from mari_eval.judge.config import (
    ENV_API_KEY,
    ENV_API_KEY_FALLBACK,
    ENV_BASE_URL,
    ENV_CACHE,
    ENV_DEADLINE,
    ENV_MODEL,
    ENV_PROMPT,
    TUNABLE,
    JudgeConfig,
    JudgeDeadline,
    JudgeError,
    JudgeNotConfigured,
    JudgeUnavailable,
    safe_url,
)
from mari_eval.judge.presets import ENV_PRESET, PRESETS, Preset, current_preset, get_preset, serve_command
from mari_eval.judge.prompt import (
    COMPLIANCE,
    FT_PROMPT,
    FT_PROMPT_TEXT,
    JUDGE_PROMPTS_FILE,
    LABELS,
    OWN_PROMPT,
    OWN_PROMPT_FILE,
    PARSER_VERSION,
    PARSERS,
    REFUSAL,
    REFUSAL_PHRASES,
    SORRY_PROMPT,
    UNPARSEABLE,
    JudgePrompt,
    _data_file,  # for the tests
    keyword_refusal,
    load_prompt,
    parse_digit,
    parse_verdict,
)
from mari_eval.judge.server import (
    EMBEDDED_CONCURRENCY,
    EMBEDDED_DEADLINE,
    EmbeddedServer,
    _free_port,  # for the tests
    judge_environment,
    judge_identity,
    main,
    serve_embedded,
)
from mari_eval.judge.summary import CATEGORIES_FILE, CATEGORIES_KEY, category_names, refusal_summary

__all__ = [
    "CATEGORIES_FILE", "CATEGORIES_KEY", "COMPLIANCE", "EMBEDDED_CONCURRENCY", "EMBEDDED_DEADLINE", "ENV_API_KEY",
    "ENV_API_KEY_FALLBACK", "ENV_BASE_URL", "ENV_CACHE", "ENV_DEADLINE", "ENV_MODEL", "ENV_PRESET", "ENV_PROMPT",
    "FT_PROMPT", "FT_PROMPT_TEXT", "JUDGE_PROMPTS_FILE",
    "LABELS", "MAX_RAW_CHARS", "MAX_REPLY_BYTES", "OWN_PROMPT", "OWN_PROMPT_FILE", "PARSERS", "PARSER_VERSION", "PRESETS",
    "REFUSAL", "REFUSAL_PHRASES",
    "SORRY_PROMPT", "TUNABLE", "UNPARSEABLE", "EmbeddedServer", "Judge", "JudgeCache", "JudgeConfig", "JudgeDeadline",
    "JudgeError", "JudgeNotConfigured", "JudgePrompt", "JudgeUnavailable", "Judgement", "Preset", "cache_key",
    "category_names", "current_preset", "default_cache_path", "get_preset", "judge_environment", "judge_identity",
    "keyword_refusal", "load_prompt", "main", "parse_digit", "parse_verdict", "refusal_summary", "safe_url",
    "serve_command", "serve_embedded",
    "KAPPA_FLOOR", "Calibration", "LocalJudge", "choose_threshold", "find_calibration", "half", "score_refusals",
    "server_score", "verdicts",
]
