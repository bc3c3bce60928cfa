"""Metadata-only models for every built-in profile, and the manifests rendered from them."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from orin.deploy import k8s
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.loader import builtin_profiles, load_profile
from orin.profile.schema import Profile
from tests.ggufutil import LLAMA2_7B, write_gguf

BUILTIN = sorted(builtin_profiles())


def model_info(folder: Path, quantization: str | None) -> ModelInfo:
    """A llama GGUF header (no weights) of the profile's quantization: what
    ``deploy k8s --model`` reads for the memory plan."""
    quant = (quantization or "Q4_K_M").upper()
    path = folder / f"model-{quant}.gguf"
    if not path.is_file():
        file_type = int(gguf.LlamaFileType[f"MOSTLY_{quant}"])
        write_gguf(path, params=LLAMA2_7B, file_type=file_type)
    return read_model_info(path)


def render(
    folder: Path, profile: Profile | str, opts: k8s.K8sOptions | None = None
) -> k8s.Manifests:
    p = load_profile(profile) if isinstance(profile, str) else profile
    info = model_info(folder, p.model.quantization)
    return k8s.render(p, k8s.plan_for(p, info), opts)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")
