"""Helpers shared by several test modules that run the embedded model, lm-eval or a subprocess:
bundles saved for the embedded model, a few real requests, a repro script in smoke mode; and a
tiny random Llama with the SmolLM2 tokenizer's vocabulary (fixtures ``tokenizer`` and ``model``,
imported by the modules that use them) with tiny bundles of every method for it."""

import math
import subprocess
import sys

import pytest
import torch
import transformers
from lm_eval.api.instance import Instance

from mari_eval.injection import site
from mari_eval.evaluation.lm import MariLM

from .conftest import REPO
from .tiny import tiny_caa, tiny_iti, tiny_mari


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: no process has its pid now
    return child.pid


def saved_mari_bundle(tmp_path, model, gate_never_opens=False):
    n = 20
    energies = torch.full((n,), 1e9) if gate_never_opens else None
    applicable = torch.zeros(n, dtype=torch.uint8) if gate_never_opens else None
    bundle = tiny_mari(K=3, d=model.config.hidden_size, layers=site.num_layers(model), layer=15,
                     energies=energies, applicable=applicable)
    bundle.config["base_model"]["name"] = "smollm2-135m-instruct"
    return bundle.save(tmp_path / ("closed" if gate_never_opens else "open"))


def saved_baseline_bundle(tmp_path, model, method):
    from baselines import iti, reft

    d, layers = model.config.hidden_size, site.num_layers(model)
    g = torch.Generator().manual_seed(0)
    config = {"base_model": {"name": "smollm2-135m-instruct", "hidden_size": d, "num_layers": layers}}
    if method == "reft":
        R = reft.orthonormal_rows(torch.randn(4, d, generator=g))
        bundle = reft.ReFT({**config, "site": {"layer": 15}, "hyperparameters": {"first": 5, "last": 5}},
                           {"R": R, "W": R + 0.5 * torch.randn(4, d, generator=g), "b": torch.randn(4, generator=g)})
    else:
        n_heads, head_dim = site.attention_heads(model)
        theta = torch.randn(3, head_dim, generator=g)
        bundle = iti.ITI({**config, "site": {"layer": 8}, "hyperparameters": {"alpha": 15.0}},
                         {"heads": torch.tensor([[8, 1], [12, 0], [20, 5]]), "sigma": torch.full((3,), 2.0),
                          "directions": theta / theta.norm(dim=-1, keepdim=True)})
    return bundle.save(tmp_path / method)


def capital_requests():
    pairs = [("Q: What is the capital of France?\nA:", " Paris."), ("Q: What is the capital of France?\nA:", " Lyon."),
             ("The sky is", " blue"), ("Water boils at", " 100 degrees Celsius at sea level.")]
    return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]


def run_repro(script: str, dirs, *args: str) -> subprocess.CompletedProcess:
    runs, out = dirs
    proc = subprocess.run([sys.executable, str(REPO / "repro" / script), "--smoke", "--runs", str(runs),
                           "--out", str(out), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


PREAMBLE = ("Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius.\n\n"
            "Q: Which planet is closest to the sun?\nA: Mercury.\n\n")
# (question, mc1 options, mc2 options): truthfulqa_mc1 and _mc2 share each prompt; the second
# question's two tasks have the same options too (as some TruthfulQA docs do): one group twice
QUESTIONS = [
    ("What colour is the sky on a clear day?", [" Blue.", " Green.", " Red."], [" Blue.", " It is blue.", " Green."]),
    ("How many legs does a spider have?", [" Eight.", " Six.", " Ten."], [" Eight.", " Six.", " Ten."]),
    ("What is the capital of France?", [" Paris.", " Lyon.", " Marseille."], [" Paris.", " Nice."]),
]
DISTINCT_GROUPS = 5  # (context, options) pairs among the 6 lm-eval groups (3 questions, mc1 and mc2)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def model(tokenizer):
    # tests/tiny.py's llama, with the tokenizer's vocabulary instead of its VOCAB ids
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tiny_bundles(model, root, closed_gate: bool = False) -> dict[str, str]:
    """A small bundle of CAA, ITI, MARI (K = 3; ``closed_gate``: one that never opens) and ReFT for
    ``model``, saved under ``root``: name -> its directory."""
    from baselines import reft

    d, layers = model.config.hidden_size, site.num_layers(model)
    g = torch.Generator().manual_seed(0)
    R = reft.orthonormal_rows(torch.randn(2, d, generator=g))
    never = dict(energies=torch.full((20,), 1e9), applicable=torch.zeros(20, dtype=torch.uint8)) if closed_gate else {}
    made = {
        "caa": tiny_caa(d=d, layers=layers, layer=2, multiplier=3.0),
        "iti": tiny_iti(model, heads=((2, 0), (2, 3), (3, 1)), alpha=6.0),
        "mari": tiny_mari(K=3, d=d, layers=layers, layer=1, **never),
        "reft": reft.ReFT({"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": 2},
                           "hyperparameters": {"first": 2, "last": 2}},
                          {"R": R, "W": R + 0.5 * torch.randn(2, d, generator=g), "b": torch.randn(2, generator=g)}),
    }
    return {name: str(bundle.save(root / name)) for name, bundle in made.items()}


def lm_for(model, tokenizer, bundles, name, options, shared=None) -> MariLM:
    bundle = bundles.get(name)
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle,
                  allow_other_model=True if bundle else None, shared_pass=shared, **options)


def truthfulqa_requests(questions=QUESTIONS) -> list[Instance]:
    out = []
    for doc_id, (question, mc1, mc2) in enumerate(questions):
        doc = {"mc1_targets": {"choices": mc1, "labels": [1] + [0] * (len(mc1) - 1)},
               "mc2_targets": {"choices": mc2, "labels": [1, 0 if mc2 == mc1 else 1] + [0] * (len(mc2) - 2)}}
        for task, options in (("truthfulqa_mc1", mc1), ("truthfulqa_mc2", mc2)):
            for i, option in enumerate(options):
                out.append(Instance("loglikelihood", doc, (f"{PREAMBLE}Q: {question}\nA:", option), i,
                                    metadata=(task, doc_id, 1)))
    return out


class PrefixEncodings:
    """Counts the model's forward passes that encode a prompt before p* (``encode_prefix`` asks
    for the last position's logits only) and the tokens the first layer reads in all passes."""

    def __init__(self, model):
        self.prefixes = self.tokens = 0
        self.hooks = [
            model.register_forward_pre_hook(self._model_call, with_kwargs=True),
            site.decoder_layers(model)[0].register_forward_pre_hook(self._layer_call, with_kwargs=True),
        ]

    def _model_call(self, module, args, kwargs):
        self.prefixes += kwargs.get("logits_to_keep") == 1

    def _layer_call(self, module, args, kwargs):
        states = args[0] if args else kwargs["hidden_states"]
        self.tokens += states.shape[0] * states.shape[1]

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def evaluate(lm: MariLM, requests, model) -> tuple[list, list, PrefixEncodings]:
    counter = PrefixEncodings(model)
    try:
        answers = lm.loglikelihood(requests)
    finally:
        counter.remove()
    return answers, list(lm.records), counter


def close(a, b, tol=1e-5) -> bool:
    """Equal records: the same keys and values, numbers to ``tol``."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and not isinstance(b, bool):
        return math.isclose(a, b, abs_tol=tol) or (math.isnan(a) and math.isnan(b))
    return a == b
