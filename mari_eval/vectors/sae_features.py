"""lm-eval's SAE-feature steering CSVs (``lm_eval --model steered --model_args steer_path=FILE.csv``),
read from SAE weights on local disk (``mari-eval import-vector FILE.csv``; the bundle is
``mari_eval.vectors.steer_config``'s ``steered_config``).

What lm-eval does (``SteeredModel.derive_steer_config``, lm_eval/models/hf_steered.py, 0.4.13):
it reads the CSV with pandas (columns loader, action, sparse_model, hookpoint, feature_index,
steering_coefficient, head_index, sae_id, description), loads each row's SAE with sparsify
(``SparseCoder.load_from_disk(sparse_model/hookpoint)`` when ``sparse_model`` is a local path,
else from the Hub) or sae_lens (``SAE.from_pretrained(release=sparse_model, sae_id)``, always the
Hub), and stores under the row's hookpoint ``{action, steering_coefficient, steering_vector:
W_dec[feature_index], bias: b_dec}``. The result is a dict keyed by hookpoint: a later row on the
same hookpoint replaces the earlier one (nothing is summed); ``read_sae_csv`` does the same and
logs a warning naming both rows. The head_index and description columns are not read there.

The SAE files, as the two libraries save them (read from their sources):

* sparsify, ``SparseCoder.save_to_disk(DIR)`` (sparsify/sparse_coder.py): ``DIR/cfg.json`` and
  ``DIR/sae.safetensors`` (``safetensors.torch.save_model``: ``encoder.weight``, ``encoder.bias``,
  ``W_dec`` [num_latents, d_in], ``b_dec`` [d_in], maybe ``W_skip``); a model's SAEs sit in one
  folder per hookpoint, ``ROOT/<hookpoint>/``, which is what lm-eval loads.
* sae_lens, ``SAE.save_model(DIR)`` (sae_lens/saes/sae.py; names in sae_lens/constants.py):
  ``DIR/cfg.json`` and ``DIR/sae_weights.safetensors`` (``W_enc`` [d_in, d_sae], ``W_dec``
  [d_sae, d_in], ``b_dec`` [d_in], ...). A release on the Hub may be stored otherwise (Gemma
  Scope's ``params.npz``); load it once with sae_lens and ``save_model`` it to get this layout.

So ``sparse_model`` here must name local weights: a ``.safetensors`` file holding ``W_dec``; or a
folder, where sparsify rows read ``<folder>/<hookpoint>/sae.safetensors`` (lm-eval's layout) or
``<folder>/sae.safetensors``, and sae_lens rows ``<folder>/<sae_id>/sae_weights.safetensors`` or
``<folder>/sae_weights.safetensors``. A relative path is looked up from the working directory (as
lm-eval does), then from the CSV's folder. Only ``W_dec[feature_index]`` and ``b_dec`` are read
(``safe_open`` slices: an SAE of any size costs one row), as stored: a sae_lens SAE trained on
normalized activations is not rescaled (``SAE.from_pretrained`` may fold a release's scaling
factor in; ``save_model`` after loading writes the folded weights).

Where this differs from lm-eval 0.4.13, each on purpose:

* ``bias`` is b_dec for a clamp row (lm-eval's clamp centres on it) and None for an add row:
  lm-eval sets it on add rows too, and its own ``add`` then stops on ``assert bias is None``, so
  a CSV with an add row does not run there (tests/test_sae_features.py shows it); an add with no
  bias is what such a row asks for.
* Refused with the fix, where lm-eval would download, crash or steer something else: a Hub name
  (no local file), an empty hookpoint (lm-eval falls back to sae_lens's ``hook_name``, a
  TransformerLens name no Hugging Face module has), a ``head_index`` (lm-eval ignores the column
  and steers the whole layer), a negative ``feature_index`` (Python would count from the end), a
  ``W_dec`` stored transposed ([d_model, n_features]) or made for another hidden size.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import torch

from mari_eval.methods.bundle_spec import BundleError
from mari_eval.storage.files import file_sha256
from mari_eval.storage.numbers import NumberError, read_number
from mari_eval.vectors.vector_kind import check_kind

log = logging.getLogger(__name__)

LOADERS = ("sparsify", "sae_lens")
EXTRA = "\0extra"  # csv.DictReader's key for the fields of a row beyond the header's
REQUIRED = ("loader", "sparse_model", "hookpoint", "feature_index", "steering_coefficient")
WEIGHTS = {"sparsify": "sae.safetensors", "sae_lens": "sae_weights.safetensors"}


def read_sae_csv(path: str | Path, hidden: int) -> tuple[dict[str, dict[str, Any]], list[dict[str, str]]]:
    """({hookpoint: lm-eval's steering entry}, [{file, sha256} of each SAE file read]) of the CSV at
    ``path``, for a model of hidden size ``hidden``; a BundleError names the row, the problem and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (an lm-eval SAE-feature steering CSV)")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh, restkey=EXTRA)
            columns = [c.strip() for c in reader.fieldnames or []]
            rows = [row for row in reader]
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start}: Latin-1 or "
                          f"another legacy encoding?); save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > "
                          f"{path.with_name(path.stem + '-utf8.csv')}") from None
    for number, row in enumerate(rows, start=2):  # the header is line 1
        if EXTRA in row:
            raise BundleError(f"{path}, row {number}: {len(columns) + len(row[EXTRA])} fields under a header of "
                              f"{len(columns)} ({', '.join(map(repr, row[EXTRA]))} beyond it): a comma inside a value? "
                              "Quote that value, or drop the extra fields")
    rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in rows]
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise BundleError(f"{path}: no column {', '.join(missing)}; lm-eval's steering CSV has the header "
                          "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,"
                          "description")
    if not rows:
        raise BundleError(f"{path}: no rows under the header; add one row per feature to steer")
    config: dict[str, dict[str, Any]] = {}
    from_row: dict[str, int] = {}
    files: dict[Path, dict[str, str]] = {}
    for number, row in enumerate(rows, start=2):  # the header is line 1
        where = f"{path}, row {number}"
        hookpoint, entry, weights = _row(where, row, hidden, path.parent)
        if hookpoint in config:
            log.warning("%s replaces row %d on hookpoint %s, as lm-eval does (a later row wins; nothing is summed)",
                        where, from_row[hookpoint], hookpoint)
        config[hookpoint], from_row[hookpoint] = entry, number
        if weights not in files:
            files[weights] = {"file": "/".join(weights.parts[-2:]), "sha256": file_sha256(weights)}
    return config, list(files.values())


def _row(where: str, row: dict[str, str], hidden: int, csv_dir: Path) -> tuple[str, dict[str, Any], Path]:
    loader, action = row["loader"], row.get("action", "add")
    if loader not in LOADERS:
        raise BundleError(f"{where}: loader {loader!r} is neither sparsify nor sae_lens (the two lm-eval reads)")
    if action not in ("add", "clamp"):
        raise BundleError(f"{where}: action {action!r} is neither add nor clamp (the two lm-eval applies)")
    hookpoint = row["hookpoint"]
    if not hookpoint:
        raise BundleError(f"{where}: no hookpoint. lm-eval would take the SAE's cfg hook_name, a TransformerLens "
                          "name (blocks.N.hook_resid_post) that no Hugging Face module has: write layers.N, the "
                          "decoder layer whose output the SAE reads")
    if row.get("head_index"):
        raise BundleError(f"{where}: head_index {row['head_index']!r}: lm-eval's CSV reader ignores this column and "
                          "steers the whole layer; leave it empty to get what lm-eval computes")
    feature = _number(where, "feature_index", row["feature_index"], integer=True)
    coefficient = _number(where, "steering_coefficient", row["steering_coefficient"])
    weights = sae_weights_file(where, row["sparse_model"], loader, hookpoint, row.get("sae_id", ""), csv_dir)
    vector, bias = _decoder_row(where, weights, feature, hidden, need_bias=action == "clamp")
    return hookpoint, {"action": action, "steering_coefficient": coefficient, "steering_vector": vector,
                       "bias": bias if action == "clamp" else None, "head_index": None}, weights


def _number(where: str, column: str, text: str, integer: bool = False) -> float | int:
    """A CSV field read by ``numbers.read_number`` ("٣" and "3_0" are not rows 3 and 30)."""
    try:
        return read_number(text, f"{where}: {column}", integer=integer, lo=0 if integer else None)
    except NumberError as e:
        if integer:
            raise BundleError(f"{where}: {column} {text!r} is not a feature's row in W_dec, an integer >= 0 "
                              f"({e.why})") from None
        raise BundleError(str(e)) from None


def sae_weights_file(where: str, sparse_model: str, loader: str, hookpoint: str, sae_id: str, csv_dir: Path) -> Path:
    """The local safetensors file a row's ``sparse_model`` names (the module docstring says where it is looked for)."""
    if not sparse_model:
        raise BundleError(f"{where}: sparse_model is empty; give the path of the SAE's safetensors file or folder")
    given = Path(sparse_model).expanduser()
    found = next((p for p in (given, csv_dir / given) if p.exists()), None)
    if found is None:
        raise BundleError(f"{where}: sparse_model {sparse_model!r} is not a local file or folder. lm-eval would "
                          f"download it from the Hugging Face Hub with {loader}; this import reads local files only: "
                          "download the SAE's safetensors (e.g. `hf download REPO --include 'HOOKPOINT/*' --local-dir "
                          "DIR`; a sae_lens release: load it with sae_lens and SAE.save_model(DIR)) and give that path "
                          "in sparse_model")
    if found.is_file():
        if found.suffix != ".safetensors":
            raise BundleError(f"{where}: {found} is not a .safetensors file; save the SAE's weights with safetensors "
                              f"({loader}'s own save does) and give that file or its folder")
        return found
    name = WEIGHTS[loader]
    sub = hookpoint if loader == "sparsify" else sae_id
    candidates = ([found / sub / name] if sub else []) + [found / name]
    weights = next((p for p in candidates if p.is_file()), None)
    if weights is None:
        raise BundleError(f"{where}: no {name} in {found} (looked for {', '.join(str(p) for p in candidates)}); give "
                          "the SAE's safetensors file itself in sparse_model, or the folder its library saved")
    return weights


def _decoder_row(where: str, weights: Path, feature: int, hidden: int, need_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_dec[feature], b_dec or None) of the SAE in ``weights``, float32, checked against ``hidden``."""
    from safetensors import SafetensorError, safe_open  # deferred: only importing an SAE needs it

    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            names = set(f.keys())
            if "W_dec" not in names:
                raise BundleError(f"{where}: {weights} holds no W_dec tensor (it holds {', '.join(sorted(names))}); "
                                  "give the SAE's weights as sparsify or sae_lens save them (W_dec [n_features, "
                                  "d_model])")
            decoder = f.get_slice("W_dec")
            shape = list(decoder.get_shape())
            _check_decoder(where, weights, shape, feature, hidden)
            vector = check_kind(decoder[feature:feature + 1], f"{where}: W_dec in {weights}").reshape(-1).float()
            bias = check_kind(f.get_tensor("b_dec"), f"{where}: b_dec in {weights}").float().reshape(-1) \
                if "b_dec" in names else None
    except SafetensorError as e:
        raise BundleError(f"{where}: {weights} is not a readable safetensors file ({e}); copy it again") from None
    if need_bias and bias is None:
        raise BundleError(f"{where}: a clamp is centred on the SAE's b_dec (as lm-eval clamps), and {weights} has "
                          "none: add b_dec (zeros for an SAE without a decoder bias), or use action add")
    if bias is not None and bias.numel() != hidden:
        raise BundleError(f"{where}: b_dec in {weights} has {bias.numel()} values, the model's hidden size is {hidden}: "
                          "the SAE was made for another model")
    if not torch.isfinite(vector).all() or (bias is not None and not torch.isfinite(bias).all()):
        raise BundleError(f"{where}: W_dec[{feature}] or b_dec in {weights} is not finite; the SAE file is damaged")
    return vector, bias


def _check_decoder(where: str, weights: Path, shape: list[int], feature: int, hidden: int) -> None:
    if len(shape) != 2:
        raise BundleError(f"{where}: W_dec in {weights} has shape {shape}, not [n_features, d_model]")
    n_features, width = shape
    if width != hidden and n_features == hidden:
        raise BundleError(f"{where}: W_dec in {weights} is {shape}: stored transposed, [d_model, n_features]. lm-eval "
                          "takes row W_dec[feature_index] of [n_features, d_model], as sparsify and sae_lens store it: "
                          "save W_dec.T.contiguous() in its place")
    if width != hidden:
        raise BundleError(f"{where}: W_dec in {weights} is {shape}: its rows have {width} values, the model's hidden "
                          f"size is {hidden}; the SAE was made for another model: import with --model naming that one")
    if feature >= n_features:
        raise BundleError(f"{where}: feature_index {feature} is beyond the SAE's {n_features} features "
                          f"(0..{n_features - 1})")
