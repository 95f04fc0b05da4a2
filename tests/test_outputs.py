"""Outputs (issue 56, item 4): nothing but a regular file or a directory the tool made is ever replaced;
``--out`` over an existing bundle needs ``--force``; ``lm_eval``'s output options are read as lm-eval reads
them; every output place is checked writable before the work and every write after it; a full disk or a
read-only place is reported with the path the user gave, and long work is kept rather than lost.

Faults are simulated at the operating system's door (``Disk``): a full disk answers ENOSPC when a file
written there is flushed (``os.fsync``), a read-only place refuses to create or replace anything there
(``os.open`` with O_CREAT or for writing, ``os.mkdir``, ``os.replace``). Tests run as root here, where
permissions would not stop a write, so they never rely on chmod.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from mari_eval import cli, methods
from mari_eval.evaluation import lm_checks
from mari_eval.storage import files
from mari_eval.vectors.control_vector_files import write_gguf

from .tiny import tiny_caa

HIDDEN = 32


class Disk:
    """A folder whose file system fails as a test asks (module docstring)."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch):
        self.folder, self.monkeypatch = folder, monkeypatch
        folder.mkdir(parents=True, exist_ok=True)

    def holds(self, path) -> bool:
        try:
            return Path(os.path.abspath(os.fsdecode(path))).is_relative_to(self.folder)
        except (TypeError, ValueError):
            return False

    def fail(self, code: int, where) -> OSError:
        return OSError(code, os.strerror(code), os.fsdecode(where))

    def full(self) -> None:
        real = os.fsync

        def fsync(fd: int) -> None:
            where = os.readlink(f"/proc/self/fd/{fd}")
            if self.holds(where):
                raise self.fail(errno.ENOSPC, where)
            real(fd)

        self.monkeypatch.setattr(os, "fsync", fsync)

    def read_only(self, code: int = errno.EROFS) -> None:
        real_open, real_mkdir, real_replace, real_rename = os.open, os.mkdir, os.replace, os.rename
        writing = os.O_CREAT | os.O_WRONLY | os.O_RDWR

        def open_(path, flags, *args, **kwargs):
            if flags & writing and self.holds(path):
                raise self.fail(code, path)
            return real_open(path, flags, *args, **kwargs)

        def mkdir(path, *args, **kwargs):
            if self.holds(path) and not os.path.lexists(path):
                raise self.fail(code, path)
            return real_mkdir(path, *args, **kwargs)

        def moved(real):
            def move(src, dst, *args, **kwargs):
                if self.holds(dst):
                    raise self.fail(code, dst)
                return real(src, dst, *args, **kwargs)
            return move

        for name, fake in (("open", open_), ("mkdir", mkdir), ("replace", moved(real_replace)),
                           ("rename", moved(real_rename))):
            self.monkeypatch.setattr(os, name, fake)


@pytest.fixture
def disk(tmp_path, monkeypatch) -> Disk:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "elsewhere"))  # unsaved work goes here, not /tmp
    (tmp_path / "elsewhere").mkdir()
    return Disk(tmp_path / "disk", monkeypatch)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny Llama's config (all import-vector reads of --model)."""
    path = tmp_path / "model"
    transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64).save_pretrained(path)
    return path


def _vector(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "v.gguf", {1: torch.ones(HIDDEN), 3: torch.full((HIDDEN,), 2.0)}, "llama")


def _kind(path: Path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def _special(tmp_path: Path, kind: str) -> Path:
    """A node of ``kind`` at a fresh path under ``tmp_path`` (skips where this system cannot make one)."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # a socket's path is limited to ~100 characters: the caller is in tmp_path, bind the name
        server = socket.socket(socket.AF_UNIX)
        server.bind(path.name)
        server.close()
    elif kind == "link":
        (tmp_path / "real.gguf").write_bytes(b"the user's file")
        path.symlink_to(tmp_path / "real.gguf")
    else:  # a character device like /dev/null (1, 3), made here so that no real device is at stake
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except OSError:
            pytest.skip("this system does not let the test make a device node")
    return path


# ----------------------------------------------------------------------------- never replaced


@pytest.mark.parametrize("kind", ["device", "fifo", "socket", "link"])
def test_export_vector_force_never_replaces_a_device_fifo_socket_or_link(tmp_path, monkeypatch, capsys, kind):
    # Issue 56: `export-vector --force` onto /dev/null replaced the device node with a regular file.
    monkeypatch.chdir(tmp_path)
    target = _special(tmp_path, kind)
    before = _kind(target)
    bundle = tiny_caa(layer=2).save(tmp_path / "caa")
    assert cli.main(["export-vector", str(bundle), str(target), "--force", "--model-hint", "llama"]) == 1
    err = capsys.readouterr().err
    assert f"error: {target} is a" in err and ("link" in err if kind == "link" else "not a regular file" in err)
    assert _kind(target) == before  # still the node (or the link) it was
    if kind == "link":
        assert (tmp_path / "real.gguf").read_bytes() == b"the user's file"


def test_output_files_are_checked_for_special_nodes_before_the_work_and_at_the_write(tmp_path):
    # /dev/null is only looked at here, never written: the check refuses it before anything runs.
    with pytest.raises(ValueError, match=r"diagnostics=/dev/null is a character device, not a regular file"):
        files.check_writable_file(Path("/dev/null"), "diagnostics=", "diagnostics.json")
    for kind in ("fifo", "link"):
        target = _special(tmp_path, kind)
        with pytest.raises(FileExistsError, match=rf"{target} is a"):
            files.write_results_json(target, {"n": 1})  # judge --out, repro's tables
        assert _kind(target) == (stat.S_IFIFO if kind == "fifo" else stat.S_IFLNK)


def test_a_directory_holding_a_link_or_a_folder_is_not_replaced_with_a_bundle(tmp_path):
    # A link named like a bundle file points out of the directory: replacing the directory would delete it.
    outside = tmp_path / "shared.safetensors"
    outside.write_bytes(b"someone's weights")
    out = tmp_path / "b"
    out.mkdir()
    (out / "weights.safetensors").symlink_to(outside)
    with pytest.raises(FileExistsError, match=r"holds weights\.safetensors \(a symbolic link\), not files this tool wrote"):
        tiny_caa().save(out)
    assert (out / "weights.safetensors").is_symlink() and outside.read_bytes() == b"someone's weights"


# ----------------------------------------------------------------------------- --out over a bundle


def test_import_vector_or_train_over_an_existing_bundle_needs_force(tmp_path, model_dir, monkeypatch, capsys):
    # Issue 56: `import-vector --out` onto a trained bundle replaced it without --force.
    trained = tiny_caa(layer=2).save(tmp_path / "trained")
    weights = (trained / "weights.safetensors").read_bytes()
    command = ["import-vector", str(_vector(tmp_path)), "--model", str(model_dir), "--out", str(trained)]
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert f"error: --out {trained} already holds a caa bundle" in err and "pass --force to replace it" in err
    assert (trained / "weights.safetensors").read_bytes() == weights and methods.load_bundle(trained).method == "caa"

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mari_eval.training.train.Session", no_model)
    assert cli.main(["train", "--method", "caa", "--attribute", "truthfulqa", "--out", str(trained)]) == 1
    assert f"--out {trained} already holds a caa bundle" in capsys.readouterr().err
    assert cli.main([*command, "--force"]) == 0
    assert methods.load_bundle(trained).method == "control_vector"


# ----------------------------------------------------------------------------- lm_eval's output options


def test_lm_evals_output_options_are_read_as_its_own_parser_reads_them(tmp_path):
    # Issue 56: `--output` (an abbreviation lm-eval accepts) and a repeated --output_path bypassed the check.
    read = lm_checks.lm_eval_output_path
    assert read(["run", "--model", "mari", "--output", "a"]) == "a"
    assert read(["--model", "mari", "-ob"]) == "b" and read(["--output_p=c"]) == "c"
    assert read(["-o", "d", "--output_path", "d"]) == "d"  # repeated, the same: what lm-eval uses
    config = tmp_path / "eval.yaml"
    config.write_text("output_path: from-yaml\n")
    assert read(["--config", str(config)]) == "from-yaml" and read(["--model", "mari"]) is None
    with pytest.raises(ValueError, match=r"--output_path is given 2 times \('x', 'y'.*keep the last one"):
        read(["--output_path", "x", "--output", "y"])
    with pytest.raises(ValueError, match=r"--output_path is empty"):
        read(["-o", ""])
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    with pytest.raises(ValueError, match=rf"lm_eval --output_path {blocker}/out cannot be written"):
        lm_checks.check_lm_eval_output(["run", "--model", "mari", "--output", str(blocker / "out")])
    with pytest.raises(ValueError, match=r"given 2 times"):  # the first writable, the last (used) not
        lm_checks.check_lm_eval_output(["--output_path", str(tmp_path / "ok"), "--output_path", str(blocker / "out")])


SAMPLE = {"doc_id": 0, "doc_hash": "d", "prompt_hash": "p", "target_hash": "t"}


def _tracker(tmp_path: Path):
    from lm_eval.loggers import EvaluationTracker

    out = tmp_path / "disk" / "results"
    lm_checks.check_lm_eval_output(["run", "--model", "mari", "--output_path", str(out)])  # as MariLM does
    return EvaluationTracker(output_path=str(out))


def test_a_full_disk_at_lm_evals_results_write_stops_the_run_naming_the_file_and_keeps_the_results(
        tmp_path, disk, monkeypatch):
    # Issue 56: on a full disk, `--output_path` left a 0-byte results file and lm_eval exited 0.
    tracker = _tracker(tmp_path)
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if disk.holds(self):
            real(self, "")  # created, then the disk is full: what lm-eval's write leaves
            raise disk.fail(errno.ENOSPC, self)
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError, match=r"lm_eval --output_path .*/disk/results: cannot write .*/results_[^ ]+\.json: "
                                      r"No space left on device; free some space") as raised:
        tracker.save_results_aggregated(results={"results": {"t": {"acc": 0.5}}}, samples={"t": [SAMPLE]})
    kept = Path(str(raised.value).rsplit("kept in ", 1)[1])
    assert json.loads((kept / "results.json").read_text())["results"] == {"t": {"acc": 0.5}}
    assert "(the damaged file was removed)" in str(raised.value)
    assert not list((tmp_path / "disk").rglob("results_*.json"))  # no 0-byte file to be read as results
    assert json.loads((kept / "samples_t.jsonl").read_text()) == SAMPLE


def test_a_samples_file_cut_short_stops_the_run_naming_it(tmp_path, disk, monkeypatch):
    from lm_eval.loggers import evaluation_tracker

    tracker = _tracker(tmp_path)
    tracker.save_results_aggregated(results={"results": {}}, samples=None)
    samples = [{"arguments": [("q", " a")], "resps": [["x"]], "filtered_resps": ["x"], "target": "a", "doc_id": i}
               for i in range(3)]

    class Full:  # the first sample fits, then the disk is full
        def __init__(self, path, *args, **kwargs):
            self.fh, self.lines = open(path, *args, **kwargs), 0

        def write(self, text):
            if self.lines:
                raise disk.fail(errno.ENOSPC, self.fh.name)
            self.lines += 1
            return self.fh.write(text)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(evaluation_tracker, "open", Full, raising=False)
    with pytest.raises(OSError, match=r"cannot write .*/samples_t_[^ ]+\.jsonl: No space left on device.*kept in"):
        tracker.save_results_samples("t", samples)
    assert not list((tmp_path / "disk").rglob("samples_t_*.jsonl"))  # the file of one sample in three: removed


# ----------------------------------------------------------------------------- train --out


def test_train_into_a_read_only_place_is_refused_before_the_model_loads(tmp_path, disk, monkeypatch, capsys):
    # Issue 56: `mari-eval train --out` in a read-only place trained, then lost the bundle at save.
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mari_eval.training.train.Session", no_model)
    disk.read_only()
    out = disk.folder / "bundle"
    assert cli.main(["train", "--method", "caa", "--attribute", "truthfulqa", "--out", str(out)]) == 1
    assert f"error: --out {out} cannot be written (Read-only file system): choose a writable path" in capsys.readouterr().err


def test_a_full_disk_at_the_end_of_training_keeps_the_trained_bundle(tmp_path, disk, smollm2_path):
    # Issue 56: a full disk at save discarded the trained bundle.
    from mari_eval.evaluation.lm import MariLM
    from mari_eval.training.train import train

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048)).eval()
    lm = MariLM(pretrained=model, tokenizer=tok, device="cpu", dtype="float32", batch_size=2)
    out = disk.folder / "bundle"
    disk.full()
    with pytest.raises(OSError, match=rf"cannot write {out}: No space left on device; .*the trained bundle is kept in"
                       ) as raised:
        train("caa", "truthfulqa", "tiny", 0, out, max_train=2, max_ctrl=1, lm=lm)
    kept = Path(str(raised.value).split("kept in ", 1)[1].split(":", 1)[0])
    assert kept.is_relative_to(tmp_path / "elsewhere") and methods.load_bundle(kept).method == "caa"
    assert not out.exists() and ".saving-" not in str(raised.value)


# ----------------------------------------------------------------------------- errors name the user's path


def _import_vector(tmp_path, model_dir, out):
    code = cli.main(["import-vector", str(_vector(tmp_path)), "--model", str(model_dir), "--out", str(out)])
    assert code == 1


def _export_vector(tmp_path, model_dir, out):
    bundle = tiny_caa(layer=2).save(tmp_path / "caa")
    assert cli.main(["export-vector", str(bundle), str(out), "--model-hint", "llama"]) == 1


def _results(tmp_path, model_dir, out):  # judge --out, and repro's tables under --out
    with pytest.raises(OSError) as raised:
        files.write_results_json(out, {"n": 1})
    print(f"error: {raised.value}", file=sys.stderr)


def _bundle(tmp_path, model_dir, out):  # repro's bundles under --runs
    with pytest.raises(OSError) as raised:
        tiny_caa().save(out)
    print(f"error: {raised.value}", file=sys.stderr)


@pytest.mark.parametrize("fault", ["full", "EPERM", "EACCES"])
@pytest.mark.parametrize("write, name", [(_import_vector, "b"), (_export_vector, "v2.gguf"), (_results, "judge.json"),
                                         (_bundle, "bundle")])
def test_a_full_disk_or_a_refused_write_names_the_path_the_user_gave(tmp_path, disk, model_dir, capsys, write, name,
                                                                      fault):
    # Issue 56: ENOSPC and EPERM came without the path, or naming a hidden temporary file.
    if fault == "full":
        disk.full()
    else:
        disk.read_only(getattr(errno, fault))
    out = disk.folder / name
    write(tmp_path, model_dir, out)
    err = capsys.readouterr().err
    reason = os.strerror(errno.ENOSPC if fault == "full" else getattr(errno, fault))
    assert f"error: cannot write {out}: {reason}; " in err, err
    assert ".tmp" not in err and ".saving-" not in err and not out.exists()


# ----------------------------------------------------------------------------- every write checked after


def test_a_file_that_reaches_the_disk_short_or_empty_is_an_error_naming_it(tmp_path, monkeypatch):
    import gguf

    class Half:  # a write that reports success but keeps half the bytes
        def __init__(self, path, mode):
            self.fh = open(path, mode)

        def write(self, data):
            return self.fh.write(data[: len(data) // 2])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(files, "open", Half, raising=False)
    target = tmp_path / "table.json"
    with pytest.raises(OSError, match=rf"cannot write {target}: the file written was \d+ bytes of \d+"):
        files.atomic_write(target, "0123456789")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    class Silent(gguf.GGUFWriter):  # a writer that leaves its file empty
        def write_header_to_file(self, *args, **kwargs): pass
        def write_kv_data_to_file(self): pass
        def write_tensors_to_file(self, *args, **kwargs): pass
        def close(self): pass

    monkeypatch.setattr(gguf, "GGUFWriter", Silent)
    with pytest.raises(OSError, match=rf"cannot write {tmp_path / 'v.gguf'}: the file written was empty \(0 bytes\)"):
        write_gguf(tmp_path / "v.gguf", {1: torch.ones(HIDDEN)}, "llama")
    assert not (tmp_path / "v.gguf").exists()


def test_a_folder_another_process_checks_and_removes_meanwhile_is_checked_again(tmp_path, monkeypatch):
    # Two torchrun ranks check one new --output_path: the first removes the folder its check made
    # between the second's mkdir and its test file. The second must check again, not refuse.
    target = tmp_path / "new" / "out"
    real = tempfile.NamedTemporaryFile
    calls = []

    def other_rank_removed_it(*args, **kwargs):
        calls.append(kwargs["dir"])
        if len(calls) == 1:
            Path(kwargs["dir"]).rmdir()
            Path(kwargs["dir"]).parent.rmdir()
        return real(*args, **kwargs)

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", other_rank_removed_it)
    files.check_writable_dir(target, "lm_eval --output_path ")
    assert len(calls) == 2 and not (tmp_path / "new").exists()  # checked again; nothing left behind

    def always_missing(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", always_missing)
    with pytest.raises(ValueError, match="cannot be written .No such file or directory.: choose a writable path"):
        files.check_writable_dir(target, "lm_eval --output_path ")
