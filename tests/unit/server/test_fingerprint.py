"""system_fingerprint changes with what changes the answer to the same request and seed."""

from __future__ import annotations

import pytest

from orin.engine.config import engine_config
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from orin.server.main import fingerprint

BASE = "name: t\nengine: {n_ctx: 512, slots: 2}\n"
TEMPLATE = "model:\n  chat_template: |\n    {% for m in messages %}{{ m.content }}{% endfor %}\n"


def fp(profile_text: str) -> str:
    path = demo.ensure("tiny", "f16")
    profile = parse_profile(profile_text)
    info = read_model_info(path)
    cfg = engine_config(profile, path, info)
    return fingerprint("0.3", "CPU", info, cfg, profile.sampling)


def test_the_same_settings_give_the_same_fingerprint() -> None:
    assert fp(BASE) == fp(BASE)
    assert fp(BASE).startswith("fp_")


@pytest.mark.parametrize(
    "change",
    [
        TEMPLATE,  # the prompt a chat request renders to
        "sampling: {temperature: 0.2}\n",  # a request without temperature samples with it
        "context: {window: 256}\n",  # where a long answer starts to slide
        "engine: {n_ctx: 1024, slots: 2}\n",  # the context layout, as before
    ],
)
def test_a_setting_that_changes_the_answer_changes_the_fingerprint(change: str) -> None:
    section = change.split(":", 1)[0]
    kept = "".join(ln + "\n" for ln in BASE.splitlines() if not ln.startswith(section))
    assert fp(kept + change) != fp(BASE)
