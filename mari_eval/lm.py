"""``lm_eval --model mari``: lm-eval's HFLM with an intervention applied at the site.

The class knows only the method interface (``mari_eval.methods.Intervention``): with
no ``bundle`` it is the frozen base model and scores exactly like ``--model hf``; with
a bundle it applies that bundle's edit at (l*, p*), p* being the last prompt token:

* log-likelihood requests are right-padded rows ``(context + continuation)[:-1]``, so
  p* differs per row and is ``len(row) - len(continuation)``;
* generation requests are left-padded by HFLM, so p* is the last column of the prefill
  and the edit is applied once, before decoding (``mari_eval.site.edit_site``).

Everything else (chat templates, batching, ``--limit``, ``--log_samples``, data
parallelism through ``accelerate launch``, ``parallelize=True``) is HFLM's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from mari_eval import methods, site
from mari_eval.models import DEFAULT_MODEL, resolve_model


@register_model("mari")
class MariLM(HFLM):
    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        bundle: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_name = pretrained if isinstance(pretrained, str) else type(pretrained).__name__
        super().__init__(
            pretrained=resolve_model(pretrained) if isinstance(pretrained, str) else pretrained,
            device=device,
            dtype=dtype,
            **kwargs,
        )
        self.model.requires_grad_(False)
        self.intervention: methods.Intervention | None = None
        if bundle:
            self.intervention = methods.load_bundle(bundle)
            self.intervention.check_compatible(self.model, self.model_name)

    # ------------------------------------------------------------------ the site

    def _site_edit(self, positions: torch.Tensor | None):
        if self.intervention is None:
            return contextlib.nullcontext()
        return self.intervention.applied(self.model, positions)

    # ------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Sum of continuation log-probs and whether it is the greedy continuation, per request.

        Rows are right-padded and run without an attention mask, as HFLM does: with a
        causal mask the trailing pads cannot influence the scored positions.
        """
        batch_size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 1)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context_enc, cont_enc = requests[i]
                if not context_enc or not cont_enc:
                    raise ValueError("A log-likelihood request has an empty context or continuation")
                if len(cont_enc) > self.max_length:
                    raise ValueError(f"A continuation of {len(cont_enc)} tokens exceeds max_length={self.max_length}")
                rows.append((context_enc + cont_enc)[-(self.max_length + 1) :][:-1])
                conts.append(cont_enc)
            width = max(map(len, rows))
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            inps = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
            # p*: the last context token kept in the row (the row ends with cont[:-1]).
            p_star = torch.tensor([len(r) - len(c) for r, c in zip(rows, conts)], device=self.device)
            with torch.no_grad(), self._site_edit(p_star.clamp(min=0)):
                logits = self.model(inps).logits
            for j, i in enumerate(chunk):
                n = len(conts[j])
                first = len(rows[j]) - n  # the logit at p* predicts the first continuation token
                logprobs = F.log_softmax(logits[j, first : first + n].float(), dim=-1)
                target = torch.tensor(conts[j], device=logprobs.device)
                answer = (
                    float(logprobs.gather(-1, target[:, None]).sum()),
                    bool((logprobs.argmax(-1) == target).all()),
                )
                results[i] = answer
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if self.intervention is not None:
            raise NotImplementedError(
                "loglikelihood_rolling (perplexity tasks) has no prompt, hence no last prompt token to edit; "
                "run these tasks without a bundle."
            )
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    # ------------------------------------------------------------------ generation

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        # HFLM left-pads generation batches, so p* is the last column of the prefill.
        with self._site_edit(None):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # ------------------------------------------------------------------ bookkeeping

    def set_cache_hook(self, cache_hook) -> None:
        # CachingLM (--use_cache) keys requests on their text only: results computed
        # under one bundle would be served for another. Allow it only when the cache
        # file names this bundle's fingerprint.
        db = getattr(cache_hook, "dbdict", None)
        if self.intervention is not None and db is not None:
            fingerprint = self.intervention.fingerprint()
            if fingerprint not in str(getattr(db, "filename", "")):
                raise ValueError(
                    "--use_cache keys results on the request text only, so a cache shared between bundles "
                    f"would return wrong results. Put this bundle's fingerprint in the cache path, e.g. "
                    f"--use_cache cache/mari-{fingerprint}"
                )
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["mari_model"] = self.model_name
        info["mari_intervention"] = None if self.intervention is None else self.intervention.describe()
        return info
