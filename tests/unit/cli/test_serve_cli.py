from __future__ import annotations

import logging
from pathlib import Path

import pytest
import typer

from orin.cli.errors import UsageError
from orin.cli.serve import _apply_overrides, _window
from orin.errors import ProfileError
from orin.profile.loader import parse_profile
from orin.profile.schema import Profile
from orin.server.main import _api_key, _is_loopback, http_stack, served_name


def profile() -> Profile:
    return parse_profile("name: p\nengine: {n_ctx: 4096, slots: 4, n_batch: 512}\n")


def test_ctx_is_the_context_per_slot_as_everywhere() -> None:
    p = profile()
    p.context.window = 1024
    p = _apply_overrides(p, None, None, 8, 16384, None)
    assert (p.engine.slots, p.engine.n_ctx) == (8, 16384)  # not 16384 / 8
    assert p.context.window is None and p.context.sliding is True  # the window follows


def test_serve_ctx_is_the_shared_option() -> None:
    import inspect

    from orin.cli.options import CtxOpt
    from orin.cli.serve import serve

    assert inspect.signature(serve).parameters["ctx"].annotation in (CtxOpt, "CtxOpt")


def test_an_unknown_log_format_is_a_usage_error() -> None:
    from typer.testing import CliRunner

    from orin.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--log-format", "xml"], env={"COLUMNS": "200"})
    assert result.exit_code == 2  # usage, not an internal error (70)
    assert "xml" in result.output and "internal error" not in result.output


def test_window_number_and_off() -> None:
    p = _apply_overrides(profile(), "0.0.0.0", 9000, None, None, "1024")
    assert (p.server.host, p.server.port, p.context.window) == ("0.0.0.0", 9000, 1024)
    q = _apply_overrides(profile(), None, None, None, None, "off")
    assert q.context.sliding is False
    for bad in ("wide", "10", "2000000"):
        with pytest.raises(typer.BadParameter, match="64 to 1048576"):
            _window(bad)


def test_overrides_obey_the_profile_bounds() -> None:
    p = profile()
    p.context.keep = 300
    with pytest.raises(UsageError) as exc:
        _apply_overrides(p, None, None, 4, 256, None)  # 256 per slot: keep no longer fits
    assert (
        str(exc.value) == "--slots 4, --ctx 256: context.keep (300) must be below the window (256)"
    )


def test_overrides_keep_the_profiles_file() -> None:
    p = profile()
    p.source = Path("/profiles/p.yaml")
    assert _apply_overrides(p, None, None, None, 2048, "512").source == Path("/profiles/p.yaml")


def serve(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from orin.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--profile", "demo", *args], env={"COLUMNS": "240"})
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--window", "10"), "'10': give a number of tokens from 64 to 1048576, or 'off'"),
        (("--ctx", "2000000"), "2000000 is out of range: give 256 to 1048576"),
        (("--ctx", "100"), "100 is out of range: give 256 to 1048576"),
        (("--slots", "65"), "65 is out of range: give 1 to 64"),
        (("--port", "70000"), "70000 is out of range: give 1 to 65535"),
        (("--telemetry-hz", "0"), "0 is out of range: give 0.1 to 1000"),
        (("--telemetry", "bogus"), "'bogus': give auto, off or one of jetson_sysfs"),
    ],
)
def test_an_override_out_of_its_range_is_a_usage_error(args: tuple[str, ...], message: str) -> None:
    code, err = serve(*args)
    assert code == 2, err  # usage, not an internal error (70)
    assert f"Invalid value for '{args[0]}'" in err and message in err
    assert "internal error" not in err and "ValidationError" not in err


def test_overrides_that_break_a_profile_rule_fail_as_the_profile_would() -> None:
    code, err = serve("--window", "100000", "--ctx", "256")
    assert code == 2, err  # not clamped to 256 behind the user's back
    assert "--ctx 256, --window 100000: context.window (100000) exceeds engine.n_ctx (256)" in err
    code, err = serve("--window", "2048")  # the demo profile's engine.n_ctx is 1024
    assert code == 2, err
    assert "--window 2048: context.window (2048) exceeds engine.n_ctx (1024)" in err


def test_model_replacing_a_profiles_model_is_served_under_its_own_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    demo = parse_profile("name: demo\nmodel: {demo: {size: small, quant: q4_k_m}}\n")
    with caplog.at_level(logging.INFO, logger="orin.server"):
        assert served_name(demo, Path("/models/other.gguf")) == "other"
    assert "replaces profile demo's model (demo small q4_k_m)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orin.server"):
        assert served_name(demo, None) == "demo"  # the profile's own model
        named = parse_profile("name: d\nmodel: {path: a.gguf}\nserver: {model_name: mine}\n")
        assert served_name(named, Path("b.gguf")) == "mine"  # server.model_name wins
        assert served_name(Profile(name="b"), Path("b.gguf")) == "b"  # no model of its own
    assert [r.getMessage() for r in caplog.records if "replaces" in r.getMessage()] == [
        "--model b.gguf replaces profile d's model (a.gguf): serving it as 'mine'"
    ]


def test_loopback_detection() -> None:
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("192.168.1.5")


def test_public_bind_without_key_warns_loudly(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORIN_LLM_API_KEY", raising=False)
    p = profile()
    p.server.host = "0.0.0.0"
    with caplog.at_level(logging.WARNING, logger="orin.server"):
        assert _api_key(p) is None
    assert "WITHOUT an API key" in caplog.text
    caplog.clear()
    monkeypatch.setenv("ORIN_LLM_API_KEY", "k")
    with caplog.at_level(logging.WARNING, logger="orin.server"):
        assert _api_key(p) == "k"
    assert caplog.text == ""


def test_unknown_profile_is_a_profile_error() -> None:
    from orin.profile.select import serve_profile

    with pytest.raises(ProfileError):
        serve_profile("no-such-profile", None)


def test_http_stack_prefers_uvloop_and_httptools_and_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    fast = {"uvloop", "httptools"}
    here = {"uvloop", "httptools"}

    def find_spec(name: str, *a: object) -> object:
        if name in fast:
            return real("json") if name in here else None  # any spec stands for "installed"
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert http_stack() == ("uvloop", "httptools")
    here.clear()
    assert http_stack() == ("asyncio", "h11")
