"""bbq.yaml's few-shot sampler (its own module, so that only the BBQ tasks' cache keys read it:
repro/engine/task_files.py).

BBQ is zero-shot and has one split, the documents it scores. Without a few-shot source lm-eval lists
every test document (17,628 for ``bbq``) as the pool of shots each time it builds the task, seconds
per evaluation that no zero-shot run reads; bbq.yaml gives an empty pool (``samples: []``) and this
sampler, which says so by name if shots are asked for.
"""

from __future__ import annotations

from lm_eval.api.samplers import ContextSampler


class BBQZeroShot(ContextSampler):
    def sample(self, n: int, eval_doc=None, df=None, **kwargs):
        if n > 0:
            raise ValueError(f"--num_fewshot {n}: the bbq tasks are zero-shot, and their only split is the documents "
                             "they score, so there is nowhere to draw shots from; run them with --num_fewshot 0")
        return []
