"""The CLI's conventions, command by command: --json is a switch and files go to
--output, --ctx is the context per slot, exit 2 is for usage errors alone, a closed
stdout ends a command quietly, tables keep names whole at 80 columns, and a bare
`tune` starts nothing."""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from orin.cli import tune as tune_cli
from orin.cli.app import app
from orin.cli.options import CTX_HELP
from orin.cli.output import Output, progress_wanted
from orin.profile.loader import builtin_profiles
from tests.unit.bench.test_loadgen import Answer, FakeServer, Seen, serving

runner = CliRunner()


def invoke(*args: str, columns: int = 240) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": str(columns)})
    return result.exit_code, result.stdout, result.stderr


def options(command: object = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, object]]:
    """Every option of every command, with the command's path."""
    command = command or typer.main.get_command(app)
    for param in getattr(command, "params", []):
        yield " ".join(path), param
    for name, sub in getattr(command, "commands", {}).items():
        yield from options(sub, (*path, name))


def test_json_is_a_switch_and_ctx_is_per_slot_everywhere() -> None:
    seen_json, seen_ctx = set(), set()
    for where, param in options():
        opts = getattr(param, "opts", [])
        if "--json" in opts:
            assert getattr(param, "is_flag", False), f"{where}: --json takes no value"
            seen_json.add(where)
        if "--ctx" in opts:
            assert getattr(param, "help", None) == CTX_HELP, where
            seen_ctx.add(where)
    assert {"bench", "doctor", "monitor", "profile list", "tune run", "tune system"} <= seen_json
    assert {"doctor", "tune run", "profile validate"} <= seen_ctx


def test_bench_help_offers_json_and_output() -> None:
    code, out, _ = invoke("bench", "--help")
    assert code == 0 and "--output" in out and "--json" in out


def test_bench_json_prints_and_output_writes(tmp_path: Path) -> None:
    written = tmp_path / "run.json"
    with serving(FakeServer(usage=True)) as url:
        args = ["bench", "--url", url, "--num-requests", "2", "--input-len", "8",
                "--output-len", "4", "--concurrency", "1", "--warmup", "0"]  # fmt: skip
        code, out, err = invoke(*args, "--json", "--output", str(written))
        assert code == 0, err
        printed = json.loads(out)  # nothing but the JSON on stdout
        assert printed["completed"] == 2 and json.loads(written.read_text()) == printed
        code, out, err = invoke(*args)
        assert code == 0, err
        assert "latency (ms)" in out


def test_bench_output_that_cannot_be_written_at_the_end_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--output is checked at the start; a folder replaced by a file during the run is
    reported with the path (exit 1) after the tables, not as an internal error (70)."""
    from orin.cli import bench as bench_cli

    folder = tmp_path / "runs"
    folder.mkdir()
    measure = bench_cli._run_with_progress

    def run_then_lose_the_folder(*args: Any) -> Any:
        done = measure(*args)
        folder.rmdir()
        folder.write_text("now a file")
        return done

    monkeypatch.setattr(bench_cli, "_run_with_progress", run_then_lose_the_folder)
    with serving(FakeServer(usage=True)) as url:
        args = ["bench", "--url", url, "--num-requests", "1", "--input-len", "8",
                "--output-len", "4", "--concurrency", "1", "--warmup", "0"]  # fmt: skip
        code, out, err = invoke(*args, "--output", str(folder / "run.json"))
    assert code == 1, err
    assert "latency (ms)" in out
    assert f"orin-llm: cannot write {folder / 'run.json'}: " in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--slo", "ttft=5"), "ttft_p95_ms"),
        (("--input-len", "ten"), "comma-separated"),
        (("--input-len", "8,1048577"), "'--input-len': token counts must be at most 1048576"),
        (("--input-len", "8,16,8"), "'--input-len': 8 given twice; list each once"),
        ((), "--concurrency"),  # neither --concurrency nor --request-rate
        (("--request-rate", "nan"), "'--request-rate': the request rate must be positive"),
        (("--request-rate", "0"), "'--request-rate': the request rate must be positive"),
        (("--request-rate", "-2"), "'--request-rate': the request rate must be positive"),
        (("--concurrency", "1", "--burstiness", "nan"), "'--burstiness': burstiness must be"),
        (("--concurrency", "1", "--burstiness", "inf"), "'--burstiness': burstiness must be"),
        (("--concurrency", "1", "--burstiness", "0"), "'--burstiness': burstiness must be"),
        (("--concurrency", "1", "--timeout", "inf"), "inf is not a finite number"),
        (("--concurrency", "1", "--mem-bandwidth", "inf"), "inf is not a finite number"),
        (("--concurrency", "1", "--slo", "tpot_p90_ms=nan"), "positive and finite"),
        (("--concurrency", "1", "--slo", "ttft_p95_ms=nan"), "a target must be positive and"),
        (("--concurrency", "1", "--slo", "tpot_p90_ms=inf"), "a target must be positive and"),
    ],
)
def test_bench_usage_mistakes_exit_2(args: tuple[str, ...], message: str) -> None:
    code, out, err = invoke("bench", "--url", "http://127.0.0.1:9", *args)
    assert code == 2, err
    assert message in err and "internal error" not in err and "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("name", ["missing.gguf", "not-gguf.txt"])
def test_bench_reads_the_model_file_it_is_given_before_it_sends_anything(
    tmp_path: Path, name: str
) -> None:
    (tmp_path / "not-gguf.txt").write_text("hello")
    fake = FakeServer(usage=True)
    with serving(fake) as url:
        code, out, err = invoke(
            "bench", "--url", url, "--concurrency", "1", "--num-requests", "1",
            "--model-file", str(tmp_path / name),
        )  # fmt: skip
    assert code == 3, err
    assert err.startswith(f"orin-llm: {tmp_path / name}: ") and out == ""
    assert fake.bodies == []


def test_bench_with_a_model_the_server_does_not_list_is_a_usage_error() -> None:
    fake = FakeServer(usage=True)
    with serving(fake) as url:
        code, out, err = invoke(
            "bench", "--url", url, "--model", "nosuch", "--num-requests", "1", "--concurrency", "1"
        )
    assert code == 2, err
    assert "Invalid value for '--model'" in err and "lists: fake" in err
    assert "Traceback" not in err and out == ""
    assert fake.bodies == []  # no completion was sent


def with_context(fake: FakeServer, n_ctx: int) -> Callable[[Seen], Answer]:
    """``fake``, its /v1/models saying orin-llm's context per slot, as orin-llm does."""

    def sized(seen: Seen) -> Answer:
        if seen.path == "/v1/models":
            meta = {"n_ctx_per_slot": n_ctx}
            return Answer(body={"data": [{"id": "m", "owned_by": "orin-llm", "meta": meta}]})
        return fake(seen)

    return sized


def test_bench_with_an_input_length_beyond_the_servers_context_is_a_usage_error() -> None:
    """orin-llm says its context per slot in /v1/models: a prompt it cannot take is
    refused before any completion is sent or any prompt of that length is built."""
    fake = FakeServer(usage=True)
    with serving(with_context(fake, 512)) as url:
        code, out, err = invoke("bench", "--url", url, "--input-len", "8,600", "--concurrency", "1")
    assert code == 2, err
    assert "Invalid value for '--input-len'" in err and "context of 512 tokens" in err
    assert "an input of at most 448 with this output" in " ".join(err.split())
    assert out == "" and fake.bodies == []


def test_bench_with_input_and_output_beyond_the_servers_context_is_a_usage_error() -> None:
    """Only the input was checked: 500 + 64 tokens on a 512-token slot ran a whole
    bench of refused (or context-shifted) requests."""
    fake = FakeServer(usage=True)
    with serving(with_context(fake, 512)) as url:
        code, out, err = invoke(
            "bench", "--url", url, "--input-len", "8,500", "--output-len", "64",
            "--concurrency", "1",
        )  # fmt: skip
    assert code == 2, err
    assert "Invalid value for '--input-len' / '--output-len'" in err
    assert "500 input tokens and 64 output tokens" in " ".join(err.split())
    assert "context of 512 tokens" in " ".join(err.split())
    assert out == "" and fake.bodies == []


def test_bench_json_with_every_request_failed_says_why_on_stderr() -> None:
    """Exit 1 comes with a line on stderr naming the errors, not only in the JSON."""
    fake = FakeServer(usage=True)

    def refusing(seen: Seen) -> Answer:
        if seen.body.get("stream"):
            return Answer(400, {"error": {"code": "context_length_exceeded"}})
        return fake(seen)

    with serving(refusing) as url:
        code, out, err = invoke(
            "bench", "--url", url, "--num-requests", "3", "--input-len", "8",
            "--concurrency", "1", "--warmup", "0", "--json",
        )  # fmt: skip
    assert code == 1
    assert json.loads(out)["errors"] == {"http 400 context_length_exceeded": 3}
    assert err == "orin-llm: every request failed: http 400 context_length_exceeded 3\n"


def test_bench_exits_1_when_a_slo_target_is_missed() -> None:
    """Targets are a test for CI: a missed one fails the run, after the figures are
    printed; targets that are met, or none given, leave exit 0."""
    args = ["bench", "--num-requests", "2", "--input-len", "8", "--output-len", "4",
            "--concurrency", "1", "--warmup", "0"]  # fmt: skip
    with serving(FakeServer(usage=True)) as url:
        code, out, err = invoke(*args, "--url", url, "--json",
                                "--slo", "ttft_p95_ms=0.000001,tpot_p90_ms=1e9")  # fmt: skip
        assert code == 1, err
        slo = json.loads(out)["slo"]  # everything printed as before
        assert slo["ttft_p95_ms"]["met"] is False and slo["tpot_p90_ms"]["met"] is True
        assert err.startswith("orin-llm: SLO missed: ttft_p95_ms ") and "> 1e-06 ms" in err
        assert "tpot_p90_ms" not in err
        code, out, err = invoke(*args, "--url", url, "--slo", "ttft_p95_ms=0.000001")
        assert code == 1 and "SLO" in out and "NO" in out
        code, _, err = invoke(*args, "--url", url, "--slo", "ttft_p95_ms=1e9,tpot_p90_ms=1e9")
        assert code == 0 and "SLO missed" not in err
        code, _, err = invoke(*args, "--url", url)
        assert code == 0, err


def test_bench_says_a_target_it_could_not_measure_is_missed() -> None:
    """One output token has no TPOT: a TPOT target is not met, and the line says why."""
    with serving(FakeServer(usage=True)) as url:
        code, _, err = invoke(
            "bench", "--url", url, "--num-requests", "2", "--input-len", "8",
            "--output-len", "1", "--concurrency", "1", "--warmup", "0",
            "--slo", "tpot_p90_ms=50",
        )  # fmt: skip
    assert code == 1
    assert err.endswith("orin-llm: SLO missed: tpot_p90_ms not measured (target 50 ms)\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "--url", "127.0.0.1:8080", "--concurrency", "1"), "give the scheme"),
        (("monitor", "--url", "127.0.0.1:8080", "--once"), "give the scheme"),
        (("tune", "run", "--telemetry", "bogus"), "auto, off or one of"),
        (("tune", "system", "--apply", "--revert"), "not both"),
        (("doctor", "--ctx", "100"), "--ctx"),
    ],
)
def test_more_usage_mistakes_exit_2(args: tuple[str, ...], message: str) -> None:
    code, out, err = invoke(*args)
    assert code == 2 and message in err and "internal error" not in err
    assert out == ""


@pytest.mark.parametrize("command", [("profile", "validate"), ("doctor", "--profile")])
def test_a_ctx_the_profiles_rules_refuse_is_a_usage_error(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: p\ncontext: {keep: 300}\n")
    code, out, err = invoke(*command, str(f), "--ctx", "256")
    assert code == 2, err
    assert "--ctx 256: context.keep (300) must be below the window (256)" in err
    assert "internal error" not in err and out == ""


def test_a_bare_tune_starts_nothing() -> None:
    code, out, _ = invoke("tune")
    assert code == 2  # as `orin-llm` alone: the help, and the usage error's code
    assert "Usage: orin-llm tune" in out and "run" in out and "system" in out


@pytest.mark.parametrize(
    ("group", "help_on_stdout"),
    [
        ((), True),
        (("tune",), True),
        (("deploy",), True),
        (("model",), False),
        (("profile",), False),
    ],
)
def test_a_bare_group_starts_nothing_and_exits_2(
    group: tuple[str, ...], help_on_stdout: bool
) -> None:
    """docs/cli.md: the top level, tune and deploy print their help on stdout; model
    and profile their usage line on stderr."""
    code, out, err = invoke(*group)
    assert code == 2
    usage = " ".join(("Usage: orin-llm", *group))
    if help_on_stdout:
        assert usage in out and "Commands" in out
    else:
        assert out == "" and usage in err and "Missing command" in err


def test_every_group_is_in_the_bare_group_test() -> None:
    command = typer.main.get_command(app)
    groups = {
        name for name, sub in getattr(command, "commands", {}).items() if hasattr(sub, "commands")
    }
    assert groups == {"tune", "deploy", "model", "profile"}


def test_tune_options_before_a_subcommand_are_a_usage_error() -> None:
    code, _, err = invoke("tune", "--budget", "2", "system")
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and "--budget: with `tune run`; `tune system` takes its own" in said
    code, _, err = invoke("tune", "--budget", "2", "run")
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and "--budget: after `tune run`, not before it" in said


@pytest.mark.parametrize(
    "args",
    [
        ("tune", "run", "--budget", "inf"),
        ("monitor", "--url", "http://127.0.0.1:9", "--interval", "inf"),
    ],
)
def test_an_infinite_time_is_a_usage_error(args: tuple[str, ...]) -> None:
    """inf passed the lower bound and overflowed inside the command (exit 70)."""
    code, _, err = invoke(*args)
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and f"{args[-2]}': inf is not a finite number" in said


@pytest.mark.parametrize(
    "args",
    [
        ("model", "rm", ""),
        ("profile", "show", ""),
        ("profile", "validate", " "),
        ("serve", "--profile", ""),
        ("doctor", "--profile", ""),
        ("tune", "run", "--profile", ""),
        ("tune", "system", "--profile", ""),
        ("install", "--profile", "", "--dry-run"),
        ("deploy", "k8s", "--profile", ""),
    ],
)
def test_an_empty_name_is_a_usage_error(args: tuple[str, ...]) -> None:
    """An empty name (a shell variable that expanded to nothing) was read as the
    current folder: ".: a folder, not a profile file", exit 3 or 4."""
    code, _, err = invoke(*args)
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and "an empty name" in said, said


def path_options() -> Iterator[tuple[tuple[str, ...], str]]:
    """Every option whose value is a path (``Path`` or ``Path | None`` in the command's
    signature), as (the command's path, its longest flag)."""
    for path in commands():
        command: Any = typer.main.get_command(app)
        for name in path:
            command = command.commands[name]
        callback = getattr(command, "callback", None)
        if callback is None:
            continue
        hints = typing.get_type_hints(inspect.unwrap(callback))
        paths = {k for k, v in hints.items() if v in (Path, Path | None)}
        for param in command.params:
            if param.name in paths and getattr(param, "opts", None) and param.opts[0][:1] == "-":
                yield path, max(param.opts, key=len)


def test_an_empty_path_is_a_usage_error_for_every_path_option() -> None:
    """``--output ''`` (a variable that expanded to nothing) was the current folder:
    `deploy k8s` wrote its manifests there, `rpc-worker --cache ''` cached in it,
    `serve --model ''` ended in an internal error (exit 70), `doctor --root ''` read
    the board under it."""
    checked = list(path_options())
    assert (("deploy", "k8s"), "--output") in checked and (("doctor",), "--root") in checked
    assert len(checked) >= 30
    for path, flag in checked:
        code, _, err = invoke(*path, flag, "")
        said = " ".join(err.replace("│", " ").split())
        assert code == 2 and "an empty name" in said, (path, flag, code, said)


def test_tune_options_before_a_subcommand_are_named_as_typed() -> None:
    """The message names the options the user gave, not their parameters' names."""
    code, _, err = invoke("tune", "--profile", "demo", "-q", "system")
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and "--profile, --quiet: with `tune run`" in said


def test_tune_progress_only_on_a_terminal_without_quiet() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    assert progress_wanted(False, tty, tty)
    assert not progress_wanted(True, tty, tty)  # --quiet
    assert not progress_wanted(False, pipe, tty)  # stdout piped or redirected
    assert not progress_wanted(False, tty, pipe)


def test_tune_quiet_drops_the_measurement_lines(capsys: pytest.CaptureFixture[str]) -> None:
    for quiet in (True, False):
        with tune_cli.TuneProgress.open(Output(), 60.0, quiet) as bar:
            assert bar.bar is None  # not a terminal here
            bar.say("round 0 x1: b128/u128 ...")
            bar.stage("writing the tuned profile and the report")
        err = capsys.readouterr().err
        assert ("round 0 x1" in err) is not quiet


def _closed_stdout_run(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The command with a stdout whose reader has already gone (as `| head` leaves it
    once it has read enough): every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "orin", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "args",
    [("profile", "list", "--json"), ("profile", "list"), ("--help",), ("bench", "--help")],
)
def test_a_closed_stdout_ends_the_command_quietly(args: tuple[str, ...]) -> None:
    done = _closed_stdout_run(*args)
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE
    assert done.stderr == b""  # no traceback, no "Exception ignored" at exit


def first_cells(out: str) -> set[str]:
    """What each row starts with: a table's first cell, or the line a row printed as a
    list starts with (the lines under it are indented)."""
    lines = out.splitlines()
    if any(line.startswith("│") for line in lines):
        return {line.split("│")[1].strip() for line in lines if line.startswith("│")}
    return {line.strip() for line in lines[1:] if line and not line.startswith(" ")}


def words_whole(out: str, texts: list[str]) -> list[str]:
    """The words of ``texts`` (up to output.LONG_WORD long) that ``out`` does not hold
    whole: a word cut across two lines of a cell is missing."""
    from orin.cli.output import LONG_WORD

    found = set(out.replace("│", " ").split())
    words = {w for t in texts for w in t.split() if len(w) <= LONG_WORD}
    return sorted(w for w in words if w not in found)


def test_tables_keep_names_and_words_whole_at_80_columns() -> None:
    from orin.profile.loader import load_profile

    code, out, _ = invoke("profile", "list", columns=80)
    assert code == 0
    assert all(len(line) <= 80 for line in out.splitlines())
    assert set(builtin_profiles()) <= first_cells(out)  # every name whole on one line
    descriptions = [load_profile(name).description for name in builtin_profiles()]
    assert "Llama-3.1-8B-Instruct" in " ".join(descriptions)
    assert words_whole(out, descriptions) == []  # not 'Llama-3.1-8B-Instruc' 't'
    code, out, _ = invoke("profile", "show", "smollm2", columns=80)
    assert code == 0
    assert all(len(line) <= 80 for line in out.splitlines())
    assert {"engine.n_ctx", "speculative.draft_model", "server.metrics_public"} <= first_cells(out)
    assert words_whole(out, ["smollm2-135m-instruct SmolLM2-135M-Instruct"]) == []


def test_table_columns_hold_their_longest_word_where_the_width_allows() -> None:
    from rich.console import Console

    from orin.cli.output import Output

    out = Output()
    out.out = Console(width=80, record=True, file=io.StringIO())
    description = "Llama-3.1-8B-Instruct Q4_K_M, 4 slots x 8192 tokens, q8_0 KV, AGX Orin 64GB"
    rows = [("a-long-profile-name", "agx-orin-64gb", "Q4_K_M", description)]
    out.table("profiles", ("name", "board", "quantization", "description"), rows, keep=("name",))
    text = out.out.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert text.splitlines()[1].startswith("┏")  # still a table
    assert words_whole(text, [description, "agx-orin-64gb quantization"]) == []


def test_a_title_is_not_cut_to_the_tables_width(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.ggufutil import LLAMA2_7B, write_gguf

    monkeypatch.chdir(tmp_path)
    path = Path("root/.cache/orin-llm/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    path.parent.mkdir(parents=True)
    write_gguf(path, params=LLAMA2_7B)
    code, out, _ = invoke("model", "inspect", str(path), columns=80)
    assert code == 0
    lines = out.splitlines()
    assert len(lines[1]) < len(str(path)) < 80  # the table is narrower than its title
    assert lines[0] == str(path)  # on one line, not split before '.gguf'


def commands(command: object = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command and group, the root's included."""
    command = command or typer.main.get_command(app)
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def test_help_has_no_placeholder_on_switches_and_names_arguments_plainly() -> None:
    seen_usage = set()
    for path in commands():
        code, out, _ = invoke(*path, "--help", columns=100)
        assert code == 0, path
        assert "<bool>" not in out, path  # a switch takes no value
        assert "--no-once" not in out and "--no-json" not in out, path
        usage = next(line for line in out.splitlines() if "Usage:" in line)
        assert "{" not in usage and "}" not in usage, usage
        seen_usage.add(usage.split("Usage: ", 1)[1].strip())
    assert "orin-llm model inspect [OPTIONS] PATH" in seen_usage
    assert "orin-llm model pull [OPTIONS] OWNER/REPO[:FILE|:QUANT]" in seen_usage
    assert "orin-llm profile validate [OPTIONS] FILE" in seen_usage
    code, out, _ = invoke("--help", columns=100)
    assert any(
        line.split() == ["│", "--version", "Print", "the", "version.", "│"]
        for line in out.splitlines()
    )


def test_help_texts_are_paragraphs_not_the_sources_line_breaks() -> None:
    root = typer.main.get_command(app)
    for path in commands():
        command = root
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        for paragraph in (command.help or "").split("\n\n"):
            assert "\n" not in paragraph, (path, paragraph)
    code, out, _ = invoke("--help", columns=200)
    install = next(line for line in out.splitlines() if "│ install " in line)
    assert "the profile, a boot-time tuning unit" in install  # one line, not cut after 'for the'
    code, out, _ = invoke("deploy", "--help", columns=200)
    assert code == 0
    assert "/health probes, the drain's grace period" in out


def test_shell_completion_is_on() -> None:
    code, out, _ = invoke("--help")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out
    done = subprocess.run(
        [sys.executable, "-m", "orin", "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout and "COMP_WORDS" in done.stdout


@pytest.mark.parametrize(
    "command",
    [("monitor", "--once"), ("bench", "--num-requests", "1", "--concurrency", "1")],
)
def test_clients_say_when_nothing_answers(command: tuple[str, ...]) -> None:
    from tests.serverutil import free_port

    url = f"http://127.0.0.1:{free_port()}"  # bound and let go: nobody listens there
    code, _, err = invoke(*command, "--url", url)
    assert code != 0
    assert err.strip() == f"orin-llm: nothing answers at {url}: connection refused"


BENCH = ("bench", "--url", "http://127.0.0.1:1", "--concurrency", "1")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((*BENCH, "--output", "{dir}"), "is a folder; give a file name in it"),
        ((*BENCH, "--output", "{dir}/no/b.json"), "no folder {dir}/no: create it first"),
        (("serve", "--profile", "demo", "--record", "{dir}"), "is a folder; give a file name"),
        (("tune", "run", "--profile", "demo", "--report", "{file}"), "is a file; give a folder"),
        (("tune", "run", "--profile", "demo", "--out", "{dir}"), "is a folder; give a file name"),
        (("tune", "run", "--profile", "demo", "--out", "{dir}/no/t.yaml"),
         "no folder {dir}/no: create it first"),
        (("deploy", "k8s", "--profile", "demo", "--output", "{file}"), "is a file; give a folder"),
        (("model", "demo", "--out", "{dir}"), "is a folder; give a file name in it"),
        (("model", "demo", "--out", "{dir}/no/m.gguf"), "no folder {dir}/no: create it first"),
        (("model", "demo", "--out", "{file}/m.gguf"), "{file} is a file, not a folder"),
        ((*BENCH, "--output", "{file}/b.json"), "{file} is a file, not a folder"),
        (("model", "pull", "a/b:Q4_K_M", "--dir", "{file}"), "is a file; give a folder"),
        (("model", "pull", "a/b:Q4_K_M", "--dir", "{file}/m"), "is a file, so {file}/m cannot"),
    ],
)  # fmt: skip
def test_a_path_a_command_could_not_write_is_refused_before_it_starts(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    (tmp_path / "f").write_text("")
    paths = {"dir": str(tmp_path), "file": str(tmp_path / "f")}
    code, _, err = invoke(*(a.format(**paths) for a in args))
    assert code == 2 and says.format(**paths) in " ".join(err.replace("│", " ").split())


@pytest.mark.parametrize("command", [("model", "list"), ("model", "rm", "m.gguf")])
def test_a_models_folder_that_is_a_file_is_a_usage_error(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """(`model list` said "no such folder" and exited 0; `model rm` found no model.)"""
    (tmp_path / "f").write_text("")
    code, out, err = invoke(*command, "--dir", str(tmp_path / "f"))
    said = " ".join(err.replace("│", " ").split())
    assert code == 2 and f"{tmp_path / 'f'} is a file; give a folder" in said and out == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("model", "demo", "--size", "huge"), "'huge': give one of tiny, small, medium"),
        (("model", "demo", "--quant", "q9_9"), "'q9_9': give one of f32, f16,"),
    ],
)
def test_a_demo_model_the_generator_cannot_make_is_a_usage_error(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    code, out, err = invoke(*args, "--out", str(tmp_path / "m.gguf"))
    assert code == 2 and says in err and out == ""
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("monitor", "--recording", "r.jsonl", "--url", "http://127.0.0.1:1"),
         "--recording and --url exclude each other"),
        (("deploy", "k8s", "--kind", "daemonset", "--replicas", "3"),
         "--replicas is for a Deployment"),
    ],
)  # fmt: skip
def test_options_that_exclude_each_other_are_a_usage_error(
    args: tuple[str, ...], says: str
) -> None:
    code, _, err = invoke(*args)
    assert code == 2 and says in err


def test_a_line_to_a_pipe_is_never_wrapped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output that is not a terminal (a log, a pipe to grep) keeps each line whole,
    unless COLUMNS asks for a width."""
    monkeypatch.delenv("COLUMNS", raising=False)
    long = " ".join(f"word{i}" for i in range(40))  # 300 characters
    out = Output()
    out.line(long)
    out.note(long)
    captured = capsys.readouterr()
    assert captured.out == long + "\n" and captured.err == long + "\n"


@pytest.mark.parametrize("columns", [80, 240])
@pytest.mark.parametrize("command", [("profile", "list"), ("profile", "show", "demo")])
def test_tables_in_a_pipe_have_no_trailing_spaces(command: tuple[str, ...], columns: int) -> None:
    """rich pads each cell to its column's width: in a file or a pipe a line ends at its
    last character, as a table as labelled lines (80 columns) as in a grid (240)."""
    code, out, err = invoke(*command, columns=columns)
    assert code == 0, err
    assert out.count("\n") > 10
    padded = [line for line in out.splitlines() if line != line.rstrip()]
    assert padded == []


def _command_paths(command: object = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    command = command or typer.main.get_command(app)
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _command_paths(sub, (*path, name))


def test_help_in_a_pipe_has_no_trailing_spaces() -> None:
    """rich pads each line of --help's panels to the width; in a pipe they end at their
    last character, for every command and group."""
    paths = list(_command_paths())
    assert ("model", "pull") in paths and ("deploy", "k8s") in paths
    for path in paths:
        code, out, err = invoke(*path, "--help", columns=80)
        assert code == 0, (path, err)
        assert "Usage: orin-llm" in out
        padded = [line for line in out.splitlines() if line != line.rstrip()]
        assert padded == [], path


def test_a_cache_folder_that_cannot_be_made_is_said_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORIN_LLM_CACHE_DIR naming a file: the demo model cannot be written, exit 7 with
    the folder named, not an internal error."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "file"))
    from orin.model.demo import file_name

    code, out, err = invoke("model", "demo", "--size", "tiny", "--quant", "f32")
    models = tmp_path / "file" / "models"
    assert code == 7, err
    assert err.strip() == (
        f"orin-llm: cannot write the demo model {models / file_name('tiny', 'f32')}: "
        f"{models}: not a directory"
    )
    assert out == ""


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
@pytest.mark.parametrize("command", [("monitor", "--once"), ("status",)])
def test_a_server_url_with_the_openai_path_reaches_the_servers_root(
    suffix: str, command: tuple[str, ...]
) -> None:
    """An OpenAI client's base URL (http://host:8080/v1) given to --url: the routes these
    commands read (/health, /telemetry, /metrics) are at the root, not under /v1."""
    seen: list[str] = []

    def app(s: Seen) -> Answer:
        seen.append(s.path)
        if s.path == "/health":
            return Answer(body={"status": "ok"})
        if s.path == "/telemetry":
            return Answer(body={"source": None, "phase": None})
        return Answer(404, {"error": {"message": f"Not Found: GET {s.path}"}})

    with serving(app) as url:  # http://127.0.0.1:PORT/v1
        root = url.removesuffix("/v1")
        invoke(*command, "--url", root + suffix)
    assert "/health" in seen
    assert not [path for path in seen if path.startswith("/v1/health")]
    assert "/v1/telemetry" not in seen
