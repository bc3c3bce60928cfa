"""Pull a GGUF file from the Hugging Face Hub into the models directory.

Everything goes through ``huggingface_hub``: the repository's file list with each
file's LFS SHA-256 (``HfApi.model_info(files_metadata=True)``), the file's
metadata (``get_hf_file_metadata``: size, ETag, where the bytes are) and the
download itself (``http_get``). ``HF_ENDPOINT`` (a mirror) and ``HF_TOKEN`` (a
private or gated repository) work as they do for every Hugging Face tool;
the endpoint is read at each call, not when the library is imported.

A download is resumable: the bytes go to ``.partial/<file>.<sha>.part`` in the
models directory, under a name fixed by the file's SHA-256, so an interrupted pull
(a dropped connection, Ctrl-C, a reboot) continues on the next run with an HTTP
Range request from where it stopped. The file is moved into place only after its
SHA-256 matches the hub's; a mismatch deletes it and raises HubError, leaving
nothing in the models directory. The repository, path, revision and SHA-256 are
recorded (store.py) so that a profile's ``hf:`` reference resolves offline.

Serve never calls this: a profile names a pulled file, and an unpulled one is an
error that says which ``orin-llm model pull`` to run.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlparse

from orin.errors import HubError
from orin.model.store import (
    PARTIAL_DIR,
    HubRef,
    Provenance,
    local_name,
    pick_gguf,
    read_provenance,
    write_provenance,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
HASH_BLOCK = 1 << 20
FILE_MODE = 0o644  # the service user reads what root pulled


class ProgressBar(Protocol):
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


# (description, total bytes or None, bytes already there) -> a bar
ProgressFactory = Callable[[str, "int | None", int], ProgressBar]
Chown = Callable[[Path], None]  # give a pulled file or folder to the service user
DiskFree = Callable[[Path], int]  # free bytes on the filesystem holding a folder


def free_bytes(folder: Path) -> int:
    """The free bytes on the filesystem holding ``folder`` (pull and doctor ask it)."""
    return shutil.disk_usage(folder).free


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repository
    size: int | None
    sha256: str | None  # LFS files only


@dataclass(frozen=True)
class PullResult:
    ref: HubRef
    file: RemoteFile
    path: Path  # in the models directory
    revision: str
    downloaded: bool  # False: the same file was already here
    resumed_from: int = 0  # bytes a previous, interrupted pull had fetched

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": str(self.ref),
            "repo": self.ref.repo,
            "file": self.file.path,
            "path": str(self.path),
            "revision": self.revision,
            "sha256": self.file.sha256,
            "size": self.file.size,
            "downloaded": self.downloaded,
            "resumed_from": self.resumed_from,
        }


class PullInterrupted(KeyboardInterrupt):
    """Ctrl-C while a file was fetched or checked: where its bytes wait for the next pull."""

    def __init__(self, what: str, part: Path, size: int | None) -> None:
        super().__init__(what)
        self.what, self.part, self.size = what, part, size
        self.have = part.stat().st_size if part.is_file() else 0


def hub_endpoint(endpoint: str | None = None) -> str:
    """The hub to ask: the argument, else HF_ENDPOINT at call time, else huggingface.co."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def list_files(
    ref: HubRef, revision: str | None = None, endpoint: str | None = None
) -> tuple[str, list[RemoteFile]]:
    """The commit ``revision`` resolves to and the repository's files at it."""
    from huggingface_hub import HfApi

    ep = hub_endpoint(endpoint)
    with _hub_errors(ref, ep, revision=revision):
        info = HfApi(endpoint=ep).model_info(ref.repo, revision=revision, files_metadata=True)
    files = [
        RemoteFile(
            s.rfilename,
            s.lfs.size if s.lfs is not None else s.size,
            s.lfs.sha256 if s.lfs is not None else None,
        )
        for s in info.siblings or ()
    ]
    return info.sha or revision or "main", files


def choose(ref: HubRef, files: list[RemoteFile], endpoint: str | None = None) -> RemoteFile:
    """The one GGUF file ``ref`` selects among the repository's files."""
    by_path = {f.path: f for f in files}
    where = f"{ref.repo} on {hub_endpoint(endpoint)}"
    return by_path[pick_gguf(ref, list(by_path), where)]


def pull(
    ref: HubRef,
    models_dir: Path,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    progress: ProgressFactory | None = None,
    chown: Chown | None = None,
    force: bool = False,
    disk_free: DiskFree = free_bytes,
) -> PullResult:
    """Fetch the file ``ref`` selects into ``models_dir``, checked against its SHA-256.

    An identical file already there (same SHA-256) is kept without downloading; a
    different file of the same name is refused unless ``force``. ``chown`` is called
    on the file and its provenance record once they are in place."""
    ep = hub_endpoint(endpoint)
    commit, files = list_files(ref, revision, ep)
    remote = choose(ref, files, ep)
    if remote.sha256 is None:
        raise HubError(
            f"{ref.repo}/{remote.path} on {ep} has no SHA-256 in the hub's metadata (not an "
            "LFS file), so it cannot be checked; not pulling it"
        )
    name = local_name(remote.path)
    target = models_dir / name
    prov = Provenance(ref.repo, remote.path, commit, remote.sha256, remote.size or 0)
    if target.exists() and not target.is_file():  # os.replace could not put it there
        raise HubError(f"{target} is a folder or another non-file; move it away, then pull again")
    if target.is_file() and _already_here(models_dir, target, prov, force):
        _record(models_dir, name, prov, chown, target)
        return PullResult(ref, remote, target, commit, downloaded=False)
    part = models_dir / PARTIAL_DIR / f"{name}.{remote.sha256[:16]}.part"
    _log_once()
    try:
        resumed = _download(ref, remote, commit, part, ep, progress, disk_free)
        digest = sha256_file(part)
    except KeyboardInterrupt as exc:
        raise PullInterrupted(f"{ref.repo}/{remote.path}", part, remote.size) from exc
    if digest != remote.sha256:
        part.unlink(missing_ok=True)
        _prune(part.parent)
        raise HubError(
            f"{ref.repo}/{remote.path} from {ep} has SHA-256 {digest}, but the hub says "
            f"{remote.sha256}: refused and deleted (a proxy or mirror changed it, or the "
            "download was corrupted); pull again"
        )
    os.chmod(part, FILE_MODE)
    os.replace(part, target)
    _prune(part.parent)
    _record(models_dir, name, prov, chown, target)
    return PullResult(ref, remote, target, commit, downloaded=True, resumed_from=resumed)


def _already_here(models_dir: Path, target: Path, prov: Provenance, force: bool) -> bool:
    """Whether ``target`` already is the wanted file; refuse to replace another one."""
    have = read_provenance(models_dir, target.name)
    if have is not None and have.sha256 == prov.sha256 and target.stat().st_size == prov.size:
        return True
    if sha256_file(target) == prov.sha256:
        return True  # e.g. fetched by hand before: adopted, with its provenance recorded
    if force or (have is not None and (have.repo, have.path) == (prov.repo, prov.path)):
        return False  # a newer revision of the same file, or replacing on purpose
    origin = f"pulled from {have.repo}/{have.path}" if have else "not pulled from the hub"
    raise HubError(
        f"{target} already exists ({origin}) and is not {prov.repo}/{prov.path}; "
        f"remove it (orin-llm model rm {target.name}) or pull with --force to replace it"
    )


def _record(
    models_dir: Path, name: str, prov: Provenance, chown: Chown | None, target: Path
) -> None:
    meta = write_provenance(models_dir, name, prov)
    os.chmod(meta, FILE_MODE)
    if chown is not None:
        for p in (target, meta.parent, meta):
            chown(p)


def _download(
    ref: HubRef,
    remote: RemoteFile,
    commit: str,
    part: Path,
    endpoint: str,
    progress: ProgressFactory | None,
    disk_free: DiskFree,
) -> int:
    """Fetch ``remote`` into ``part``, resuming from what is there; the bytes resumed.
    A file the disk cannot hold is refused before a byte is fetched: a download that
    stops at a full disk leaves the disk full of a part file."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(ref.repo, remote.path, revision=commit, endpoint=endpoint)
    with _hub_errors(ref, endpoint, path=remote.path):
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    if None not in (meta.size, remote.size) and meta.size != remote.size:
        raise HubError(
            f"{endpoint} announces {meta.size:,} bytes for {ref.repo}/{remote.path}, but the "
            f"hub's file list gives {remote.size:,} with its SHA-256: the server (a mirror or a "
            "proxy) has another file; not downloading it (check HF_ENDPOINT)"
        )
    expected = meta.size if meta.size is not None else remote.size
    with _hub_errors(ref, endpoint):
        part.parent.mkdir(parents=True, exist_ok=True)
    if part.is_symlink():  # in a folder another user may own: never written through
        part.unlink()
    for stale in part.parent.glob(f"{glob.escape(local_name(remote.path))}.*.part"):
        if stale != part and len(stale.name) == len(part.name):
            stale.unlink()  # an earlier version's, which would never resume: its space back
    have = part.stat().st_size if part.is_file() else 0
    if expected is not None and have > expected:
        part.unlink()  # not a prefix of this file
        have = 0
    free = disk_free(part.parent)
    if expected is not None and expected - have > free:
        gib = 1 << 30
        _prune(part.parent)
        raise HubError(
            f"{ref.repo}/{remote.path} needs {(expected - have) / gib:.2f} GiB more, and the "
            f"filesystem of {part.parent.parent} has {free / gib:.2f} GiB free: free space, "
            "or pull into a folder on another disk with --dir"
        )
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"  # the bytes as stored, so Range offsets hold
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address needs no token
    with (
        part.open("r+b" if have else "wb") as f,
        _hub_errors(ref, endpoint, resumable=True, path=remote.path),
    ):
        f.seek(have)
        watched = _Restarts(f)
        try:
            http_get(
                meta.location,
                watched,  # type: ignore[arg-type]
                resume_size=have,
                headers=headers,
                expected_size=expected,
                displayed_filename=local_name(remote.path),
                tqdm_class=_bar_class(progress),
            )
        except OSError as exc:
            if type(exc) is not OSError or exc.errno is not None:
                raise  # the disk, a permission: _hub_errors says which
            # http_get's size check: the body ended, without an error, at another length
            # than announced. Resuming would ask for the same wrong bytes again.
            got = f.seek(0, os.SEEK_END)
            f.close()
            part.unlink(missing_ok=True)
            _prune(part.parent)
            raise HubError(
                f"{endpoint} sent {got:,} bytes of {ref.repo}/{remote.path}, which has "
                f"{expected:,}: the server or a proxy in between cut or changed it; the "
                "partial download is deleted: pull again, or from another HF_ENDPOINT"
            ) from exc
    return 0 if watched.restarted else have


class _Restarts:
    """The part file, noting whether the download started it over: http_get truncates
    it when a server answers a Range request with the whole file (200)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f, self.restarted = f, False

    def truncate(self, size: int | None = None) -> int:
        self.restarted = True
        return self._f.truncate(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _log_once() -> None:
    """huggingface_hub prints its warnings (a dropped connection it resumes) through a
    stderr handler of its own and passes them on to the root logger too: where the
    application has configured logging (the CLI does), each would be printed twice.
    Its own handler goes then, and the application's prints them in its format."""
    if logging.getLogger().handlers:
        library = logging.getLogger("huggingface_hub")
        for handler in list(library.handlers):
            if type(handler) is logging.StreamHandler:  # the one it adds when imported
                library.removeHandler(handler)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _prune(folder: Path) -> None:
    """Remove the partial-downloads folder once nothing waits in it."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def _bar_class(progress: ProgressFactory | None) -> Any:
    """A tqdm stand-in for huggingface_hub's http_get that feeds ``progress`` (or nothing)."""

    class _Bar:
        def __init__(self, *, desc: str = "", total: int | None = None, initial: int = 0, **_: Any):
            self._bar = progress(desc, total, initial) if progress is not None else None

        def update(self, n: int = 1) -> None:
            if self._bar is not None:
                self._bar.update(n)

        def close(self) -> None:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    return _Bar


class _hub_errors:
    """huggingface_hub's and the network's exceptions -> one-line HubErrors."""

    def __init__(
        self,
        ref: HubRef,
        endpoint: str,
        resumable: bool = False,
        path: str | None = None,
        revision: str | None = None,
    ) -> None:
        """``path``: the file being fetched, named in an HTTP error (else the repo);
        ``revision``: the one asked for, named when the hub does not know it."""
        self.ref, self.endpoint, self.resumable, self.path = ref, endpoint, resumable, path
        self.revision = revision

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, HubError):
            return
        raise HubError(self._message(exc)) from exc

    def _message(self, exc: Exception) -> str:
        import httpx2
        from huggingface_hub import errors as hf

        ep, repo = self.endpoint, self.ref.repo
        what = f"{repo}/{self.path}" if self.path else repo
        again = "; run the same pull again to resume" if self.resumable else ""
        if isinstance(exc, hf.GatedRepoError):
            return (
                f"{repo} on {ep} is gated: accept its terms on the hub's page, then set HF_TOKEN "
                "to a token of that account"
            )
        if isinstance(exc, hf.RepositoryNotFoundError):
            return (
                f"no model repository {repo} on {ep} (a private one needs HF_TOKEN); "
                "check the owner/repo spelling"
            )
        if isinstance(exc, hf.RevisionNotFoundError):
            return (
                f"{repo} on {ep} has no revision {self.revision or 'main'!r} (a branch, tag "
                "or commit of the repository); leave --revision out for main"
            )
        if isinstance(exc, hf.RemoteEntryNotFoundError):
            return f"{what} on {ep}: the file is not there"
        if isinstance(exc, hf.OfflineModeIsEnabled):
            return f"HF_HUB_OFFLINE is set, so {ep} is not asked for {repo}; unset it to pull"
        if isinstance(exc, hf.HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else "?"
            if status == 401:
                token = (
                    "HF_TOKEN is not a valid token"
                    if os.environ.get("HF_TOKEN")
                    else "a private or gated repository needs HF_TOKEN"
                )
                return f"{ep} answered HTTP 401 (unauthorized) for {what}: {token}"
            if status == 403:
                return (
                    f"{ep} answered HTTP 403 (forbidden) for {what}: the account of HF_TOKEN "
                    "has no access (a gated repository's terms are accepted on its page)"
                )
            return f"{ep} answered HTTP {status} for {what}{again}"
        if isinstance(exc, httpx2.TooManyRedirects):
            return (
                f"{ep} redirected the request for {what} in a loop ({exc}): a mirror or "
                f"proxy set up wrong; check HF_ENDPOINT{again}"
            )
        if isinstance(exc, json.JSONDecodeError):
            return (
                f"{ep} did not answer for {repo} as a Hugging Face Hub does (not JSON: a "
                "network's login page, or a proxy); check the network, or HF_ENDPOINT"
            )
        if isinstance(exc, (httpx2.TransportError, ConnectionError)):
            return (
                f"cannot reach the Hugging Face Hub at {ep} ({type(exc).__name__}: {exc}); "
                f"check the network, or set HF_ENDPOINT to a reachable mirror{again}"
            )
        if isinstance(exc, PermissionError):
            return f"cannot write {exc.filename}: permission denied (a system folder needs sudo)"
        if isinstance(exc, OSError):
            return f"downloading {repo} from {ep} failed: {exc}{again}"
        return f"{repo} on {ep}: {type(exc).__name__}: {exc}"
