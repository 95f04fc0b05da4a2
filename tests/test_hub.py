"""Bundles on the Hugging Face Hub (mari_eval/methods/hub.py): ``bundle=org/name``, ``hf://org/name[@rev]``
and ``bundle_revision=`` read through huggingface_hub's own ``snapshot_download`` from a real
cache directory (the Hub itself is unreachable here: HF_HUB_OFFLINE, as in every test), checked
like a local bundle and evaluated through lm-eval to the same numbers; ``mari-eval push``'s
checks, its exact upload (``--to-dir``) loaded back as a repository, and its refusal offline.

What is not exercised: a download over the network, and HfApi's upload itself (it needs the Hub).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from mari_eval import cli, methods
from mari_eval.methods import hub
from mari_eval.methods.bundle_spec import BUNDLE_JSON, BUNDLE_WEIGHTS, BundleError

from .conftest import HARNESS_TASKS
from .tiny import tiny_mari


def cache_repo(cache: Path, repo_id: str, folder: Path, refs: tuple[str, ...] = ("main",), in_repo: str = "") -> str:
    """Put ``folder``'s files into the Hugging Face cache ``cache`` as a commit of ``repo_id`` (under
    ``in_repo`` there), laid out as huggingface_hub lays out a download (blobs, a snapshot folder
    of links to them, refs naming the commit); returns the commit hash."""
    files = {f"{in_repo}/{p.relative_to(folder)}".lstrip("/"): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    commit = hashlib.sha1(json.dumps({k: hashlib.sha256(v).hexdigest() for k, v in files.items()}).encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, the one huggingface_hub reads (HF_HUB_CACHE), offline."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
    assert constants.is_offline_mode()  # conftest: nothing here reaches the Hub
    return path


def _saved(directory: Path, seed: int = 0) -> Path:
    return tiny_mari(seed=seed).save(directory)


def test_the_test_cache_is_laid_out_as_huggingface_hub_reads_it(tmp_path, cache):
    commit = cache_repo(cache, "org/name", _saved(tmp_path / "b"), refs=("main", "v1"))
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert repo.repo_id == "org/name" and revision.commit_hash == commit and revision.refs == {"main", "v1"}
    assert sorted(f.file_name for f in revision.files) == [BUNDLE_JSON, BUNDLE_WEIGHTS]


def test_references_local_directory_wins_hub_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub("org/name") == hub.HubRef("org/name")
    assert hub.parse_hub("hf://org/name@v1/sub/dir") == hub.HubRef("org/name", "model", "v1", "sub/dir")
    assert hub.parse_hub("hf://org/name", "main") == hub.HubRef("org/name", revision="main")
    for local in ("./org/name", "/abs/org", "a/b/c", "name", "~/x", "my bundle/x"):
        assert hub.parse_hub(local) is None, local
    assert hub.resolve(Path("org/name")) == hub.Resolved(Path("org/name"))  # a Path is a path, missing or not
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.resolve("org/name") == hub.Resolved(Path("org/name"))  # it exists here: the local directory
    with pytest.raises(ValueError, match="bundle_revision=main applies to a Hub bundle, and bundle=org/name is a local directory"):
        hub.resolve("org/name", "main")  # never an ignored argument
    with pytest.raises(ValueError, match="names revision 'a', and revision 'b' is given too"):
        hub.resolve("hf://org/name@a", "b")
    with pytest.raises(ValueError, match="not a Hub bundle reference"):
        hub.resolve("hf://name")
    with pytest.raises(ValueError, match="quote them"):
        hub.resolve("hf://org/name", 123)  # lm-eval hands bundle_revision=123 over as a number


@pytest.mark.parametrize("reference,revision", [("org/name", None), ("hf://org/name", None), ("org/name", "COMMIT"),
                                                ("hf://org/name@v1", None), ("hf://org/name", "main")])
def test_hub_bundle_is_the_local_bundle(tmp_path, cache, monkeypatch, reference, revision):
    local = _saved(tmp_path / "b")
    commit = cache_repo(cache, "org/name", local, refs=("main", "v1"))
    monkeypatch.chdir(tmp_path)
    revision = commit if revision == "COMMIT" else revision
    loaded = hub.load_bundle(reference, revision)
    assert loaded.fingerprint() == methods.load_bundle(local).fingerprint()
    asked = revision or (reference.split("@")[1] if "@" in reference else None)
    assert loaded.describe()["source"] == {"hub": "org/name", "repo_type": "model", "revision": asked, "path": "",
                                           "commit": commit, "uri": f"hf://org/name@{commit}"}
    assert "source" not in methods.load_bundle(local).describe()  # local bundles report as before


def test_revision_picks_the_commit(tmp_path, cache):
    old = cache_repo(cache, "org/name", _saved(tmp_path / "old", seed=0), refs=("v1",))
    new = cache_repo(cache, "org/name", _saved(tmp_path / "new", seed=1), refs=("main",))
    fingerprints = {seed: methods.load_bundle(tmp_path / name).fingerprint() for seed, name in ((0, "old"), (1, "new"))}
    assert hub.load_bundle("hf://org/name").fingerprint() == fingerprints[1]
    assert hub.load_bundle("hf://org/name", old).fingerprint() == fingerprints[0]
    assert hub.load_bundle("hf://org/name@v1").describe()["source"]["commit"] == old != new


def test_bundle_in_a_folder_of_the_repository(tmp_path, cache):
    commit = cache_repo(cache, "org/bundles", _saved(tmp_path / "b"), in_repo="tqa/k4")
    loaded = hub.load_bundle("hf://org/bundles/tqa/k4")
    assert loaded.describe()["source"]["uri"] == f"hf://org/bundles@{commit}/tqa/k4"
    with pytest.raises(BundleError, match=f"hf://org/bundles@{commit} holds no bundle.json: it is not a mari-eval bundle"):
        hub.load_bundle("hf://org/bundles")


def test_hub_refusals_name_the_fix(tmp_path, cache):
    # A bare org/name that is no local directory: that comes first (the README's bundles/NAME before training it).
    with pytest.raises(BundleError, match=r"^bundle=org/none: no local directory org/none in .* \(train it first, e\.g\. "
                                          r"`mari-eval train \.\.\. --out org/none`, or give its path\); read as the Hub "
                                          r"repository org/none \(.*\), it is not in the Hugging Face cache .* and "
                                          r"HF_HUB_OFFLINE is set"):
        hub.load_bundle("org/none")
    cache_repo(cache, "org/name", _saved(tmp_path / "b"))
    with pytest.raises(BundleError, match="at revision 'v9' is not in the Hugging Face cache"):
        hub.load_bundle("hf://org/name@v9")
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("a model, not a bundle\n")
    cache_repo(cache, "org/model", card)
    with pytest.raises(BundleError, match="holds no bundle.json: it is not a mari-eval bundle"):
        hub.load_bundle("hf://org/model")
    (card / BUNDLE_JSON).write_bytes((tmp_path / "b" / BUNDLE_JSON).read_bytes())
    cache_repo(cache, "org/half", card)
    # Offline (as every test): the cache alone cannot tell a cut download from an incomplete upload (issue 37).
    with pytest.raises(BundleError, match=r"holds bundle.json but no weights.safetensors in the Hugging Face cache .*"
                                          r"either a download was interrupted .*HF_HUB_OFFLINE.* or the upload is incomplete"):
        hub.load_bundle("hf://org/half")
    damaged = _saved(tmp_path / "damaged")
    (damaged / BUNDLE_WEIGHTS).write_bytes(b"\x80\x04 a pickle")
    commit = cache_repo(cache, "org/damaged", damaged)
    with pytest.raises(BundleError, match=f"^hf://org/damaged@{commit}: .*it is a pickle"):
        hub.load_bundle("hf://org/damaged")


@pytest.mark.parametrize("folder", ["..", "tqa/../..", "./tqa", "../../../etc"])
def test_a_folder_stepping_outside_the_repository_is_refused_when_read_and_pushed(tmp_path, cache, folder):
    # Issue 37: hf://org/name/../x loaded the snapshot's parent (any local directory) while the
    # results recorded the repository and its commit; push --to-dir wrote outside its directory.
    local = _saved(tmp_path / "b")
    cache_repo(cache, "org/name", local, in_repo="tqa")
    with pytest.raises(ValueError, match=r"steps outside the repository .*hf://org/name/bundles/tqa"):
        hub.load_bundle(f"hf://org/name/{folder}")
    out = tmp_path / "upload" / "inner"
    with pytest.raises(ValueError, match=r"steps outside the repository"):
        hub.push(local, f"hf://org/name/{folder}", to_dir=out)
    assert not (tmp_path / "upload").exists()  # nothing written, inside or out
    assert hub.load_bundle("hf://org/name/tqa").fingerprint() == methods.load_bundle(local).fingerprint()


# ----------------------------------------------------------------------------- push


def test_push_to_dir_writes_the_upload_that_loads_back_from_the_hub(tmp_path, cache, capsys):
    local = _saved(tmp_path / "b")
    (local / "repro_config.json").write_text('{"command": "repro"}\n')
    out = tmp_path / "upload"
    assert cli.main(["push", str(local), "hf://org/name/tqa", "--to-dir", str(out)]) == 0
    assert "nothing was uploaded" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "tqa").iterdir()) == [BUNDLE_JSON, "repro_config.json", BUNDLE_WEIGHTS]
    for name in (BUNDLE_JSON, BUNDLE_WEIGHTS, "repro_config.json"):
        assert (out / "tqa" / name).read_bytes() == (local / name).read_bytes()
    cache_repo(cache, "org/name", out)
    assert hub.load_bundle("hf://org/name/tqa").fingerprint() == methods.load_bundle(local).fingerprint()
    assert cli.main(["push", str(local), "org/name", "--to-dir", str(out)]) == 1  # never mixed with other files


def test_push_to_a_dir_that_cannot_be_written_is_refused_before_staging(tmp_path, capsys):
    local = _saved(tmp_path / "b")
    blocker = tmp_path / "file"
    blocker.write_text("x\n")
    assert cli.main(["push", str(local), "org/name", "--to-dir", str(blocker / "upload")]) == 1
    assert f"--to-dir {blocker}/upload cannot be written" in capsys.readouterr().err
    assert cli.main(["push", str(local), "org/name", "--to-dir", str(blocker)]) == 1


def test_push_refuses_what_is_not_a_finished_bundle(tmp_path, capsys):
    def refused(directory, match):
        assert cli.main(["push", str(directory), "org/name", "--to-dir", str(tmp_path / "never")]) == 1
        assert match in capsys.readouterr().err
        assert not (tmp_path / "never").exists()  # nothing written

    local = _saved(tmp_path / "b")
    (local / ".weights.safetensors.x1.tmp").write_bytes(b"half")
    refused(local, "is being written, or a writer died while writing it (.weights.safetensors.x1.tmp)")
    (local / ".weights.safetensors.x1.tmp").unlink()
    (local / "notes.txt").write_text("x")
    refused(local, "holds notes.txt, which are not a bundle's files")
    (local / "notes.txt").unlink()
    checkpoints = tmp_path / "b.checkpoint"
    checkpoints.mkdir()
    (checkpoints / "experts.safetensors").write_bytes(b"x")
    refused(local, f"training into {local} has not finished (its checkpoints are in {checkpoints})")
    refused(checkpoints, "holds the per-epoch checkpoints of an unfinished `mari-eval train`, not a bundle")
    checkpoints.joinpath("experts.safetensors").unlink()
    checkpoints.rmdir()
    meta = json.loads((local / BUNDLE_JSON).read_text())
    meta["site"]["layer"] = 14.5
    (local / BUNDLE_JSON).write_text(json.dumps(meta))
    refused(local, "site.layer is 14.5")  # loaded and checked before anything is written or sent


def test_push_offline_reaches_huggingface_hub_and_says_why_it_stops(tmp_path, capsys):
    """The upload path for real, up to the network: huggingface_hub refuses it under HF_HUB_OFFLINE."""
    assert cli.main(["push", str(_saved(tmp_path / "b")), "org/name"]) == 1
    assert "HF_HUB_OFFLINE is set, so nothing can be uploaded" in capsys.readouterr().err


def test_unreachable_hub_is_named_for_reading_and_pushing(tmp_path):
    """Online (HF_HUB_OFFLINE=0) with the Hub at a closed loopback port: huggingface_hub's real
    requests fail to connect, and both directions say so."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "c"),
           "HF_TOKEN": "hf_test_not_a_token"}
    code = "from mari_eval.methods import hub\ntry:\n    hub.load_bundle('org/name')\nexcept Exception as e:\n    print(e)"
    read = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert "cannot be reached and is not in the Hugging Face cache" in read.stdout, read.stdout + read.stderr
    bundle = _saved(tmp_path / "b")
    pushed = subprocess.run([sys.executable, "-m", "mari_eval.cli", "push", str(bundle), "org/name"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert pushed.returncode == 1 and "error: the Hub cannot be reached (ConnectError" in pushed.stderr, pushed.stderr


def test_help_lists_every_command_on_one_line():
    commands = {name: parser for name, parser in cli.build_parser()._subparsers._group_actions[0].choices.items()}
    assert {"materialize", "splits", "train", "judge", "push"} <= set(commands)
    text = subprocess.run([sys.executable, "-m", "mari_eval.cli", "--help"], capture_output=True, text=True, check=True,
                          env={**os.environ, "COLUMNS": "80"}).stdout
    helps = {a.dest: a.help for a in cli.build_parser()._subparsers._group_actions[0]._choices_actions}
    for name in commands:
        line = next((line for line in text.splitlines() if line.split()[:1] == [name]), None)
        assert line is not None and line.split(None, 1)[1] == helps[name], (name, text)


# ----------------------------------------------------------------------------- through lm-eval


def test_bundle_revision_needs_a_bundle():
    from lm_eval.api.registry import get_model

    with pytest.raises(ValueError, match="bundle_revision in --model_args need a bundle"):
        get_model("mari").create_from_arg_string("bundle_revision=main")
    with pytest.raises(ValueError, match="bundle_revision= is empty"):
        get_model("mari").create_from_arg_string("bundle=org/name,bundle_revision=")


@pytest.mark.needs_data
def test_lm_eval_scores_the_hub_bundle_as_the_local_one(tmp_path, cache, smollm2_path, harness_task_manager):
    """In this process (bundle=org/name) and through the ``lm_eval`` command in another, whose
    HF_HUB_CACHE is the test cache (bundle=hf://org/name,bundle_revision=COMMIT): the local
    bundle's answers, diagnostics and metrics, with the repository and commit in the results."""
    import transformers
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    from .helpers import saved_mari_bundle

    local = saved_mari_bundle(tmp_path, transformers.AutoModelForCausalLM.from_pretrained(smollm2_path))  # its shapes
    commit = cache_repo(cache, "org/mari", local)
    task, limit, manager = "truthfulqa_mc1", 4, harness_task_manager

    def evaluate(bundle):
        lm = get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,batch_size=4,bundle={bundle}")
        out = simple_evaluate(model=lm, tasks=[task], limit=limit, log_samples=True, task_manager=manager, bootstrap_iters=0)
        return out["results"][task], [s["resps"] for s in out["samples"][task]], out["config"]["mari_intervention"]

    want = evaluate(local)
    assert want[1] and "source" not in want[2]
    results, resps, described = evaluate("org/mari")
    assert (results, resps) == want[:2]
    assert described == {**want[2], "source": {"hub": "org/mari", "repo_type": "model", "revision": None, "path": "",
                                                "commit": commit, "uri": f"hf://org/mari@{commit}"}}

    out = tmp_path / "cli"
    proc = subprocess.run(
        ["lm_eval", "--model", "mari", "--model_args",
         f"pretrained=smollm2-135m-instruct,bundle=hf://org/mari,bundle_revision={commit}", "--batch_size", "4",
         "--tasks", task, "--include_path", str(HARNESS_TASKS), "--limit", str(limit), "--output_path", str(out),
         "--log_samples"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = out.rglob("results_*.json")
    written = json.loads(result_file.read_text())
    assert written["results"][task]["acc,none"] == want[0]["acc,none"]
    assert written["config"]["mari_intervention"]["source"]["revision"] == commit
    (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    as_written = [[[[str(x) for x in answer] for answer in resp] for resp in doc] for doc in want[1]]  # lm-eval writes str()
    assert [s["resps"] for s in samples] == as_written
