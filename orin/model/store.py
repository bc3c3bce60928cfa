"""The models directory: which GGUF files are here, where each came from, and which one
a Hugging Face reference (``owner/repo``, ``owner/repo:file.gguf``, ``owner/repo:QUANT``)
names.

Files are kept flat, under their own names (``models/Meta-Llama-3.1-8B-Instruct-
Q4_K_M.gguf``), so a profile that names ``/var/lib/orin-llm/models/<file>`` finds a
pulled file without knowing where it came from. Where a file came from is recorded
next to it, in ``.hub/<file>.json`` (repository, path in the repository, revision,
SHA-256), so that ``owner/repo:QUANT`` is resolved here, offline, to the file that
was pulled for it; serve never asks the hub. Partial downloads wait in ``.partial/``
for the next pull to resume them. Nothing here touches the network (hub.py does).
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from orin.errors import HubError, ModelFileError, OrinError
from orin.model.gguf import SPLIT_PART
from orin.paths import models_cache_dir

# The installed service's models directory (orin.install.layout.MODELS_DIR): profiles
# written for the service name files here, and root pulls into it.
SYSTEM_MODELS_DIR = "/var/lib/orin-llm/models"
META_DIR = ".hub"  # provenance of pulled files, one JSON per file
PARTIAL_DIR = ".partial"  # downloads that have not finished

_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class HubRef:
    """A model on the hub: a repository and, optionally, a file in it or a quantization."""

    repo: str  # owner/name
    selector: str | None = None  # a .gguf path in the repository, or a quantization

    @property
    def file(self) -> str | None:
        """The file named outright (``owner/repo:file.gguf``), else None."""
        if self.selector is not None and self.selector.lower().endswith(".gguf"):
            return self.selector
        return None

    @property
    def quant(self) -> str | None:
        """The quantization asked for (``owner/repo:Q4_K_M``), else None."""
        return self.selector if self.selector is not None and self.file is None else None

    def __str__(self) -> str:
        return self.repo if self.selector is None else f"{self.repo}:{self.selector}"


def parse_ref(spec: str) -> HubRef:
    """``owner/repo[:FILE|:QUANT]`` -> HubRef; ValueError says what is wrong."""
    repo, sep, selector = spec.strip().partition(":")
    if not _REPO.fullmatch(repo) or ".." in repo:
        raise ValueError(
            f"'{spec}' is not a Hugging Face model: use owner/repo, owner/repo:file.gguf "
            "or owner/repo:QUANT (e.g. Q4_K_M)"
        )
    if not sep:
        return HubRef(repo)
    parts = PurePosixPath(selector).parts
    if not selector or selector.startswith("/") or ".." in parts or "\\" in selector:
        raise ValueError(
            f"'{spec}': '{selector}' is not a file in the repository or a quantization"
        )
    return HubRef(repo, selector)


def quant_matches(name: str, quant: str) -> bool:
    """Whether a file name carries this quantization as a whole token, in any case:
    Q4_K_M matches ``Llama-Q4_K_M.gguf`` and ``model.q4_k_m.gguf`` but Q4_K does not
    match Q4_K_M, nor Q4_0 match Q4_0_4_4, nor Q4_XS match IQ4_XS."""
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, name, flags=re.IGNORECASE) is not None


def is_projector_name(name: str) -> bool:
    """Whether a file name says vision projector (``mmproj-model-f16.gguf``): the files a
    repository publishes beside its model for model.mmproj."""
    return quant_matches(PurePosixPath(name).name, "mmproj")


def pick_gguf(ref: HubRef, names: list[str], where: str) -> str:
    """The one GGUF among ``names`` that ``ref`` selects; HubError lists the candidates.
    A quantization or a bare repository that selects a model and its vision projectors
    selects the model; a projector is pulled by its file name (or ``:mmproj``)."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if ref.file is not None:
        if ref.file in names:
            return ref.file
        raise HubError(f"{where} has no file {ref.file}; its GGUF files: {_listing(ggufs)}")
    if ref.quant is not None:
        chosen = [n for n in ggufs if quant_matches(PurePosixPath(n).name, ref.quant)]
        what = f"GGUF file with {ref.quant} in its name"
    else:
        chosen, what = ggufs, "GGUF file"
    models = [n for n in chosen if not is_projector_name(n)]
    if models and len(models) < len(chosen):
        chosen = models  # Q8_0 means the model, not also its mmproj-...-Q8_0.gguf
    if len(chosen) == 1:
        return chosen[0]
    if not ggufs:
        raise HubError(f"{where} has no GGUF file at all; orin-llm serves GGUF models")
    if not chosen:
        raise HubError(f"{where} has no {what}; its GGUF files: {_listing(ggufs)}")
    many = f"GGUF files with {ref.quant} in their names" if ref.quant else "GGUF files"
    splits = {SPLIT_PART.sub("", n) for n in chosen}
    if len(splits) == 1 and all(SPLIT_PART.search(n) for n in chosen):
        first = chosen[0]
        raise HubError(
            f"{where} has {ref.quant or 'the model'} split into {len(chosen)} parts: "
            f"{_listing(chosen)}; orin-llm serves single-file models: pull each part by "
            f"name ({ref.repo}:{first}, ...), merge them with `llama-gguf-split --merge "
            f"{PurePosixPath(first).name} {PurePosixPath(splits.pop()).name}.gguf`, and serve "
            "that file; or pick another quantization"
        )
    raise HubError(
        f"{where} has {len(chosen)} {many}: {_listing(chosen)}; name one: {ref.repo}:FILE"
    )


def _listing(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


@dataclass(frozen=True)
class Provenance:
    """Where a pulled file came from (``.hub/<file>.json``)."""

    repo: str
    path: str  # in the repository
    revision: str  # the commit it was pulled at
    sha256: str
    size: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def default_dir() -> Path:
    return models_cache_dir()


def search_dirs() -> list[Path]:
    """Where a profile's ``hf`` model is looked for: the user's models directory, then
    the installed service's."""
    dirs = [models_cache_dir(), Path(SYSTEM_MODELS_DIR)]
    return list(dict.fromkeys(dirs))


def local_name(repo_path: str) -> str:
    """The name a pulled file gets in the models directory: its own, without folders."""
    return PurePosixPath(repo_path).name


def meta_path(models_dir: Path, name: str) -> Path:
    return models_dir / META_DIR / f"{name}.json"


def write_provenance(models_dir: Path, name: str, prov: Provenance) -> Path:
    """Written to a new file, then renamed into place. Root pulls into the service's
    folder, whose ``.hub`` the service user owns: whatever is at the temporary name (a
    symbolic link to /etc/shadow) is removed, never written through."""
    path = meta_path(models_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(tmp, flags, 0o644), "w", encoding="utf-8") as f:
        f.write(json.dumps(prov.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_provenance(models_dir: Path, name: str) -> Provenance | None:
    try:
        data = json.loads(meta_path(models_dir, name).read_text(encoding="utf-8"))
        return Provenance(
            repo=str(data["repo"]),
            path=str(data["path"]),
            revision=str(data["revision"]),
            sha256=str(data["sha256"]),
            size=int(data["size"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gguf_files(models_dir: Path) -> list[Path]:
    """Every GGUF file in the directory and its folders, hidden folders left out."""
    return [p for p in _gguf_entries(models_dir) if p.is_file()]


def broken_links(models_dir: Path) -> list[Path]:
    """The ``.gguf`` symbolic links whose file is not there (a card not mounted), which
    ``gguf_files`` leaves out: model list shows them, model rm removes them."""
    return [p for p in _gguf_entries(models_dir) if p.is_symlink() and not p.exists()]


def _gguf_entries(models_dir: Path) -> list[Path]:
    if not models_dir.is_dir():
        return []
    found = []
    for p in models_dir.rglob("*.gguf"):
        rel = p.relative_to(models_dir)
        if not any(part.startswith(".") for part in rel.parts[:-1]):
            found.append(p)
    return sorted(found)


def find_pulled(ref: HubRef, models_dir: Path) -> Path | None:
    """The file pulled for ``ref`` into this directory, or None when it is not here.

    A named file is found by its name; a quantization or a bare repository through
    the recorded provenance of the files pulled from that repository. Several
    candidates for one quantization are an error, not a guess."""
    if ref.file is not None:
        p = models_dir / local_name(ref.file)
        return p if p.is_file() else None
    pulled: dict[str, Path] = {}
    for p in gguf_files(models_dir):
        prov = read_provenance(models_dir, p.name)
        if prov is not None and prov.repo == ref.repo:
            pulled[prov.path] = p
    if not pulled:
        return None
    try:
        chosen = pick_gguf(ref, list(pulled), f"{models_dir} (pulled from {ref.repo})")
    except HubError as exc:
        if ref.quant is not None and not any(quant_matches(n, ref.quant) for n in pulled):
            return None
        raise ModelFileError(str(exc)) from None
    return pulled[chosen]


def resolve_pulled(ref: HubRef, dirs: list[Path] | None = None) -> Path:
    """The pulled file for ``ref`` in the first directory that has it; ModelFileError
    naming the pull command when none has."""
    for d in dirs if dirs is not None else search_dirs():
        found = find_pulled(ref, d)
        if found is not None:
            return found
    raise ModelFileError(
        f"the Hugging Face model {ref} is not pulled yet (looked in "
        f"{', '.join(str(d) for d in (dirs or search_dirs()))}): run `orin-llm model pull {ref}`"
    )


def inside(models_dir: Path, path: Path) -> bool:
    """Whether ``path`` really lies inside ``models_dir`` (symlinks and .. resolved)."""
    try:
        path.resolve().relative_to(models_dir.resolve())
    except ValueError:
        return False
    return True


def entry_inside(models_dir: Path, path: Path) -> bool:
    """Whether the entry ``path`` itself lies inside ``models_dir``: a file, or a symbolic
    link (wherever it points). Its folder is resolved, so ``..`` or a linked folder that
    leads elsewhere is outside."""
    return path.name not in ("", ".", "..") and inside(models_dir, path.parent)


def remove(models_dir: Path, path: Path) -> list[Path]:
    """Delete a model file, or a symbolic link to one (only the link: never what it
    points to), and what the directory keeps about it; refuses anything outside the
    directory. Returns what was removed."""
    if not entry_inside(models_dir, path):
        raise ModelFileError(f"{path} is not inside the models directory {models_dir}; not removed")
    if not (path.is_symlink() or path.is_file()):
        raise ModelFileError(f"{path}: no such model file")
    removed = [path]
    meta = meta_path(models_dir, path.name)
    try:
        path.unlink()
        if meta.is_file():
            meta.unlink()
            removed.append(meta)
    except OSError as exc:
        sudo = " (a folder root owns, as the service's, needs sudo)"
        why = f"{exc.strerror or exc}{sudo if exc.errno == errno.EACCES else ''}"
        raise OrinError(f"cannot delete {exc.filename}: {why}") from exc
    return removed
