"""Bundles on the Hugging Face Hub: ``bundle=`` given as a repository, and ``mari-eval push``.

A bundle reference (``--model_args bundle=...``) is read by ``resolve``:

* an existing local path is the bundle, whatever it looks like: a local directory always wins
  (write ``hf://org/name`` to mean the Hub although a directory ``org/name`` exists here);
* ``hf://org/name``, ``hf://org/name@REVISION`` or ``hf://org/name/sub/folder`` (a bundle kept in
  a folder of the repository; huggingface_hub's URI grammar) is a Hub repository;
* ``org/name`` (exactly one slash, a valid repository id) is a Hub repository when no such local
  path exists; anything else is a local path, and a missing one fails as before.

A Hub bundle is fetched with ``huggingface_hub.snapshot_download`` into its cache (HF_HUB_CACHE),
its two files only, at ``bundle_revision=`` (a branch, tag or commit; default the repository's
main branch), then loaded and checked like a local one (``methods.load_bundle``: never a pickle).
With HF_HUB_OFFLINE set, only what the cache holds is read. Where it came from (repository,
revision asked, commit read) is reported with the bundle (``Intervention.describe``), so results
name the exact commit.

``push`` uploads a bundle directory to a repository with ``HfApi.upload_folder``: the bundle's
files are copied to a staging folder, loaded from there (the bytes checked are the bytes sent),
and that folder is uploaded; partial writes, training checkpoints and foreign files are refused.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mari_eval import methods
from mari_eval.methods.bundle_spec import BUNDLE_JSON, BUNDLE_WEIGHTS, BundleError
from mari_eval.storage.checkpoint import checkpoint_dir
from mari_eval.storage.files import check_writable_dir

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention

HF_PREFIX = "hf://"
# What a pushed repository holds: the bundle, its provenance beside it (repro/), a model card.
PROVENANCE = "repro_config.json"
PUSHED_FILES = (BUNDLE_JSON, BUNDLE_WEIGHTS, PROVENANCE, "README.md")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")  # a snapshot folder of the cache is named by its commit


@dataclass(frozen=True)
class HubRef:
    """A bundle in a Hub repository: its id, type, revision asked for (None: the default branch)
    and the folder of the repository that holds it ("" for the root)."""

    repo_id: str
    repo_type: str = "model"
    revision: str | None = None
    path: str = ""

    def uri(self, revision: str | None = None) -> str:
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        at = revision or self.revision
        return f"{HF_PREFIX}{kind}{self.repo_id}{'@' + at if at else ''}{'/' + self.path if self.path else ''}"


@dataclass(frozen=True)
class Resolved:
    """A bundle reference read: the local directory to load, and for a Hub bundle where it came from."""

    directory: Path
    hub: HubRef | None = None
    commit: str | None = None  # the commit the files were read at (Hub bundles)

    def source(self) -> dict[str, Any] | None:
        """What results record of a Hub bundle's origin (None for a local directory)."""
        if self.hub is None:
            return None
        return {"hub": self.hub.repo_id, "repo_type": self.hub.repo_type, "revision": self.hub.revision,
                "path": self.hub.path, "commit": self.commit, "uri": self.hub.uri(self.commit)}


def parse_hub(reference: str, revision: str | None = None, *, bare_ok: bool = True) -> HubRef | None:
    """``reference`` read as a Hub repository, or None when it is not one (a local path).

    ``hf://...`` always names the Hub; a bare ``org/name`` does when ``bare_ok`` (the caller has
    found no local path of that name). A revision given in the URI and as ``revision`` is refused."""
    from huggingface_hub.errors import (HfUriError,  # deferred: huggingface_hub is heavy; only this path needs it
                                        HFValidationError)
    from huggingface_hub.utils import (parse_hf_uri,  # deferred: huggingface_hub is heavy; only this path needs it
                                       validate_repo_id)

    if reference.startswith(HF_PREFIX):
        try:
            uri = parse_hf_uri(reference)
        except HfUriError as e:
            raise ValueError(f"{reference!r} is not a Hub bundle reference ({e}); write hf://org/name, "
                             "hf://org/name@REVISION or hf://org/name/folder") from None
        if uri.is_bucket:
            raise ValueError(f"{reference!r} is a bucket: bundles are read from a repository (hf://org/name)")
        if uri.revision is not None and revision is not None and uri.revision != revision:
            raise ValueError(f"{reference!r} names revision {uri.revision!r}, and revision {revision!r} is given "
                             "too (bundle_revision=, --revision): give it once")
        return HubRef(uri.id, uri.type, uri.revision or revision, _folder(reference, uri.path_in_repo))
    if not bare_ok or reference.count("/") != 1 or reference.startswith((".", "/", "~")):
        return None
    try:
        validate_repo_id(reference)
    except HFValidationError:
        return None
    return HubRef(reference, revision=revision)


def _folder(reference: str, path_in_repo: str) -> str:
    """The repository folder of ``reference``: refused when a part is ``..`` or ``.`` (it would reach
    outside the snapshot, or outside ``push --to-dir``, while the results name the repository)."""
    parts = [part for part in path_in_repo.strip("/").split("/") if part]
    if any(part in ("..", ".") for part in parts) or "\\" in path_in_repo:
        raise ValueError(f"{reference!r}: the folder {path_in_repo!r} steps outside the repository ('..', '.' or a "
                         "backslash); name the folder as the repository holds it, e.g. hf://org/name/bundles/tqa")
    return "/".join(parts)


def resolve(reference: str | Path, revision: str | None = None) -> Resolved:
    """The local directory of bundle ``reference`` (see the module's docstring), fetched into
    the Hugging Face cache for a Hub bundle. ``revision`` (``bundle_revision=``) is for Hub
    bundles only: given with a local directory it is refused, never ignored. A ``Path`` is local."""
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"bundle_revision={revision!r} in --model_args: give a branch, tag or commit hash (lm-eval reads "
                         "digits as a number: quote them, bundle_revision='0123')")
    text = str(reference)
    local = Path(text).expanduser()
    # A Path object is a file system path by the caller's own choice: never the Hub.
    hub = None if isinstance(reference, Path) else parse_hub(text, revision, bare_ok=not local.exists())
    if hub is None:
        if revision is not None:
            raise ValueError(f"bundle_revision={revision} applies to a Hub bundle, and bundle={text} is a local "
                             f"{'directory' if local.exists() else 'path'}: drop bundle_revision, or name the "
                             "repository as bundle=hf://org/name")
        return Resolved(local)
    return _download(hub, text)


def _download(hub: HubRef, reference: str) -> Resolved:
    from huggingface_hub import constants  # deferred: huggingface_hub is heavy; only this path needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError,  # deferred: huggingface_hub is heavy; only this path needs it
                                        HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {hub.revision!r}" if hub.revision else ""
    where = f"bundle={reference}: Hub repository {hub.repo_id}{at}"
    if not reference.startswith(HF_PREFIX):  # a bare org/name: most often a local directory not made yet
        where = (f"bundle={reference}: no local directory {reference} in {Path.cwd()} (train it first, e.g. `mari-eval "
                 f"train ... --out {reference}`, or give its path); read as the Hub repository {hub.repo_id}{at} "
                 "(bundle=hf://org/name names one unambiguously), it")
    prefix = f"{hub.path}/" if hub.path else ""
    try:
        snapshot = Path(snapshot_download(hub.repo_id, repo_type=hub.repo_type, revision=hub.revision,
                                          allow_patterns=[prefix + BUNDLE_JSON, prefix + BUNDLE_WEIGHTS]))
    except GatedRepoError:
        raise BundleError(f"{where} is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise BundleError(f"{where} does not exist, or is private and you are not logged in (`hf auth login` or "
                          "HF_TOKEN); check the name") from None
    except RevisionNotFoundError:
        raise BundleError(f"{where}: the repository has no such revision; give an existing branch, tag or commit "
                          "as bundle_revision") from None
    except IncompleteSnapshotError as e:
        raise BundleError(f"{where}: the cached copy is incomplete and the Hub cannot be reached ({e}); "
                          "run once with the Hub reachable") from None
    except LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        if constants.is_offline_mode():
            raise BundleError(f"{where} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set, so "
                              "it cannot be downloaded: run once without HF_HUB_OFFLINE to fetch it, point "
                              "HF_HUB_CACHE at a cache that holds it, or give a local directory") from None
        raise BundleError(f"{where} cannot be reached and is not in the Hugging Face cache ({cache}); check the "
                          "connection (or HF_ENDPOINT) and retry, or give a local directory") from None
    except HFValidationError as e:
        raise ValueError(f"{where}: {e}") from None
    commit = snapshot.name if _COMMIT.match(snapshot.name) else None
    directory = snapshot / hub.path if hub.path else snapshot
    shown = hub.uri(commit)
    if not (directory / BUNDLE_JSON).is_file():
        raise BundleError(f"{shown} holds no {prefix}{BUNDLE_JSON}: it is not a mari-eval bundle (`mari-eval push` "
                          "uploads one; for a bundle in a folder of the repository write hf://org/name/FOLDER)")
    if not (directory / BUNDLE_WEIGHTS).is_file():
        if constants.is_offline_mode():  # read from the cache alone: a download cut short looks the same
            raise BundleError(f"{shown} holds {prefix}{BUNDLE_JSON} but no {prefix}{BUNDLE_WEIGHTS} in the Hugging Face "
                              f"cache ({snapshot}): either a download was interrupted (run once without "
                              "HF_HUB_OFFLINE to fetch the missing file) or the upload is incomplete (push the "
                              "bundle again)")
        raise BundleError(f"{shown} holds {prefix}{BUNDLE_JSON} but no {prefix}{BUNDLE_WEIGHTS}, read from the Hub just "
                          "now: the upload is incomplete; push the bundle again")
    return Resolved(directory, hub, commit)


def load_bundle(reference: str | Path, revision: str | None = None) -> Intervention:
    """The bundle ``reference`` names (local directory or Hub repository), loaded and checked;
    a Hub bundle reports its origin in ``describe()``."""
    resolved = resolve(reference, revision)
    if resolved.hub is None:
        return methods.load_bundle(resolved.directory)
    try:
        return methods.load_bundle(resolved.directory, source=resolved.source())
    except BundleError as e:
        raise BundleError(f"{resolved.hub.uri(resolved.commit)}: {e}") from None


# ----------------------------------------------------------------------------- push


def bundle_files(directory: str | Path) -> list[str]:
    """The files of bundle ``directory`` that a push sends, after refusing a directory that is
    not a finished bundle: a training checkpoint, a bundle whose training has not finished, one
    being saved, partial writes, or files that are not a bundle's."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BundleError(f"{directory} is not a directory: push the directory `mari-eval train --out` wrote")
    if directory.name.endswith(".checkpoint"):
        raise BundleError(f"{directory} holds the per-epoch checkpoints of an unfinished `mari-eval train`, not a "
                          "bundle: finish the training (rerun the same command) and push its --out directory")
    checkpoints = checkpoint_dir(directory)
    if checkpoints.exists():
        raise BundleError(f"training into {directory} has not finished (its checkpoints are in {checkpoints}): rerun "
                          f"the same `mari-eval train` to finish it, or delete {checkpoints} if it was abandoned")
    saving = sorted(p.name for p in directory.parent.glob(f".{directory.name}.saving-*"))
    names = sorted(p.name for p in directory.iterdir())
    partial = [n for n in names if n.startswith(".") and n.endswith(".tmp")]
    if saving or partial:
        raise BundleError(f"{directory} is being written, or a writer died while writing it ({', '.join(saving + partial)}): "
                          "wait for it to finish, or train the bundle again")
    others = [n for n in names if n not in PUSHED_FILES or not (directory / n).is_file()]
    if others:
        raise BundleError(f"{directory} holds {', '.join(others)}, which are not a bundle's files ({', '.join(PUSHED_FILES)}): "
                          "move them away so that the repository holds the bundle alone")
    return [n for n in PUSHED_FILES if n in names]


@dataclass(frozen=True)
class Pushed:
    where: str  # hf://org/name@COMMIT[/folder], which loads this very upload, or the folder written
    commit: str | None
    files: list[str]


def push(directory: str | Path, repo: str, *, revision: str | None = None, private: bool = False,
         commit_message: str | None = None, to_dir: str | Path | None = None) -> Pushed:
    """Upload bundle ``directory`` to Hub repository ``repo`` (``org/name`` or ``hf://org/name[/folder]``).

    The files are checked and staged first (``bundle_files``, then loaded from the staged copy);
    the repository (a model repository unless the URI says otherwise) is created when missing,
    ``revision`` as a branch when missing. ``to_dir``: send nothing, write the staged files (the
    exact upload) under ``to_dir`` as the repository would hold them."""
    hub = parse_hub(repo if repo.startswith(HF_PREFIX) else HF_PREFIX + repo, revision)
    assert hub is not None
    files = bundle_files(directory)
    target = None if to_dir is None else Path(to_dir)
    if target is not None and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"--to-dir {target} exists and is not an empty directory: give a new one, so that it "
                              "holds exactly what would be uploaded")
    if target is not None:
        check_writable_dir(target, "--to-dir ")
    with tempfile.TemporaryDirectory(prefix="mari-push-") as tmp:
        staged = Path(tmp) / "bundle"
        staged.mkdir()
        for name in files:
            shutil.copyfile(Path(directory) / name, staged / name)
        bundle = methods.load_bundle(staged)  # checked as sent: a bundle replaced meanwhile cannot slip through
        if target is not None:
            shutil.copytree(staged, target / hub.path, dirs_exist_ok=True)
            return Pushed(str(target), None, files)
        message = commit_message or f"mari-eval push: {bundle.method} bundle for {bundle.config['base_model']['name']}"
        info = _upload(hub, staged, private, message, stale=[n for n in (PROVENANCE,) if n not in files])
    return Pushed(hub.uri(info.oid), info.oid, files)


def _unreachable() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection errors (huggingface_hub 2.x sends its requests with httpx2)."""
    try:
        import httpx2  # optional: huggingface_hub 2.x only
    except ImportError:
        return ()
    return (httpx2.TransportError,)


def _upload(hub: HubRef, staged: Path, private: bool, message: str, stale: list[str]):
    from huggingface_hub import HfApi  # deferred: huggingface_hub is heavy; only this path needs it
    from huggingface_hub.errors import (HfHubHTTPError,  # deferred: huggingface_hub is heavy; only this path needs it
                                        LocalTokenNotFoundError, RepositoryNotFoundError)
    from huggingface_hub.utils import \
        OfflineModeIsEnabled  # deferred: huggingface_hub is heavy; only this path needs it

    api = HfApi()
    try:
        try:
            info = api.repo_info(hub.repo_id, repo_type=hub.repo_type)
        except RepositoryNotFoundError:
            api.create_repo(hub.repo_id, repo_type=hub.repo_type, private=private or None)
        else:
            if private and not info.private:
                raise ValueError(f"{hub.repo_id} exists and is public: --private applies when a repository is created; "
                                 "make it private in its settings on the Hub first, or drop --private")
        if hub.revision and hub.revision != "main":
            api.create_branch(hub.repo_id, repo_type=hub.repo_type, branch=hub.revision, exist_ok=True)
        # A provenance file of an earlier push that this bundle lacks would describe other weights: deleted
        # (upload_folder matches delete_patterns within path_in_repo).
        return api.upload_folder(repo_id=hub.repo_id, repo_type=hub.repo_type, folder_path=staged,
                                 path_in_repo=hub.path or None, revision=hub.revision, commit_message=message,
                                 delete_patterns=stale or None)
    except OfflineModeIsEnabled:
        raise OSError("HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it to push (or give --to-dir DIR to "
                      "write the files that would be sent)") from None
    except _unreachable() as e:
        raise OSError(f"the Hub cannot be reached ({type(e).__name__}: {e}); check the connection (or HF_ENDPOINT) and "
                      "push again") from None
    except LocalTokenNotFoundError:
        raise OSError("not logged in to the Hub: run `hf auth login` or set HF_TOKEN, then push again") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        fix = ("check that your token may write to it (`hf auth whoami`)" if status in (401, 403)
               else "check the repository name and retry")
        raise OSError(f"pushing to {hub.repo_id} failed ({e}); {fix}") from None
