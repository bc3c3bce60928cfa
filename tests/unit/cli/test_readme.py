"""README.md says what the code does: one default port, the exit-code table, completion,
the commands and options of its command table; the guides it sends a new user to
list every option of a command where they give its usage or a table of its options;
the Python examples of the README and of every page in docs/ import every name
they use."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest
import typer.main

from orin.cli.app import app
from orin.cli.errors import (
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_STDOUT_CLOSED,
    EXIT_TERMINATED,
    EXIT_USAGE,
)
from orin.errors import BindError, HubError, ModelFileError, OrinError, ProfileError
from orin.profile.schema import ServerSection

README = Path(__file__).resolve().parents[3] / "README.md"
DOCS = README.parent / "docs"
GUIDES = ("quickstart", "install", "profiles", "models", "bench", "tune", "cli")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_every_local_address_uses_the_profile_default_port() -> None:
    default = ServerSection.model_fields["port"].default
    ports = re.findall(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\]):(\d+)", readme())
    assert ports, "the README shows the server's address"
    assert set(ports) == {str(default)}


def exit_table() -> dict[int, str]:
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", readme(), flags=re.MULTILINE)
    return {int(code): meaning for code, meaning in rows}


def test_the_exit_code_table_matches_the_code() -> None:
    table = exit_table()
    signals = {EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_STDOUT_CLOSED}
    mapped = set(EXIT_CODES.values()) | {0, EXIT_USAGE, EXIT_INTERNAL} | signals
    assert set(table) == mapped
    assert EXIT_CODES[OrinError] == 1 and "failed check" in table[1]
    assert "`--slo` target missed (`bench`)" in table[1]
    assert EXIT_USAGE == 2 and "usage" in table[2]
    assert EXIT_CODES[ModelFileError] == 3 and "model file" in table[3]
    assert EXIT_CODES[ProfileError] == 4 and "profile" in table[4]
    assert EXIT_CODES[BindError] == 8 and "address is in use" in table[8]
    assert EXIT_CODES[HubError] == 9 and "download" in table[9]
    assert "internal" in table[EXIT_INTERNAL] and "SIGPIPE" in table[EXIT_STDOUT_CLOSED]
    assert "Ctrl-C" in table[EXIT_INTERRUPTED] and "SIGTERM" in table[EXIT_TERMINATED]


def test_shell_completion_is_documented() -> None:
    text = readme()
    assert "## Shell completion" in text
    assert "orin-llm --install-completion" in text and "orin-llm --show-completion bash" in text


def test_every_command_and_option_in_the_command_table_exists() -> None:
    """A user copies the table's commands: each names a real command, and each of its
    options is one that command takes."""
    root = typer.main.get_command(app)
    rows = re.findall(r"^\| `(?:sudo )?orin-llm ([^`]+)` \|", readme(), flags=re.MULTILINE)
    assert len(rows) > 15
    for usage in rows:
        cmd = root
        for word in usage.split():
            sub = getattr(cmd, "commands", {}).get(word)
            if sub is None:
                break
            cmd = sub
        assert not hasattr(cmd, "commands"), f"{usage}: names a group, not a command"
        taken = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        named = set(re.findall(r"--[a-z][a-z0-9-]*", usage))
        assert named <= taken, f"orin-llm {usage}: no option {sorted(named - taken)}"


def python_examples() -> list[tuple[str, str]]:
    pages = [README, *sorted(DOCS.glob("*.md"))]  # every page, the guides among them
    return [
        (page.name, block)
        for page in pages
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)
    ]


def unbound_names(source: str) -> set[str]:
    """Names the example reads that it neither imports, assigns nor gets from builtins."""
    tree = ast.parse(source)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - bound


def test_python_examples_run_as_pasted() -> None:
    """A user pastes an example into a file: no name in it is left undefined."""
    examples = python_examples()
    assert {page for page, _ in examples} >= {"README.md", "bench.md", "tune.md", "engine.md"}
    for page, source in examples:
        unbound = unbound_names(source)
        assert not unbound, f"{page}: {sorted(unbound)} undefined in {source.splitlines()[0]!r}..."


def command(path: str) -> object:
    cmd = typer.main.get_command(app)
    for word in path.split():
        cmd = cmd.commands[word]  # type: ignore[attr-defined]
    return cmd


def visible_options(cmd: object) -> dict[str, object]:
    """Each option --help lists, by its first name."""
    params = getattr(cmd, "params", [])
    return {p.opts[0]: p for p in params if p.param_type_name == "option" and not p.hidden}


def test_the_guides_usage_lines_list_every_option() -> None:
    """`orin-llm CMD [--opt ...]` at the top of a guide is the whole usage: what --help
    lists, no more and no less."""
    seen = set()
    for name in GUIDES:
        page = (DOCS / f"{name}.md").read_text(encoding="utf-8")
        text = "".join(re.findall(r"^```\n(.*?)^```", page, re.M | re.S))  # code blocks
        text = re.sub(r"\n {10,}\[", " [", text)  # a usage line continued under itself
        usages = re.findall(
            r"^(?:sudo )?orin-llm ([a-z][a-z-]*(?: [a-z][a-z-]*)?) (?=[A-Z\[])(.*)$", text, re.M
        )
        for path, rest in usages:
            taken = set(visible_options(command(path)))
            named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
            assert named == taken, (
                f"docs/{name}.md: orin-llm {path}: missing {sorted(taken - named)}, "
                f"unknown {sorted(named - taken)}"
            )
            seen.add(path)
    assert {"install", "uninstall", "status", "model pull", "model list", "model rm"} <= seen


@pytest.mark.parametrize(
    ("page", "path"), [("bench", "bench"), ("tune", "tune run"), ("install", "install")]
)
def test_the_option_tables_match_help(page: str, path: str) -> None:
    """A guide's `| option | default | meaning |` table has a row for each option --help
    lists, and a number in the default column is the option's default."""
    text = (DOCS / f"{page}.md").read_text(encoding="utf-8")
    table = text.split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (`--[^|]+) \| ([^|]+) \|", table, re.M)
    options = visible_options(command(path))
    documented = set()
    for first, default in rows:
        names = re.findall(r"`(--[a-z][a-z0-9-]*)", first)
        documented |= set(names)
        if re.fullmatch(r"[0-9.]+", default.strip()) and names[0] in options:
            given = options[names[0]].default  # type: ignore[attr-defined]
            assert float(default) == float(given), f"{page}.md: {names[0]} defaults to {given}"
    assert documented >= set(options), f"{page}.md lacks {sorted(set(options) - documented)}"
    assert documented <= set(options), f"{page}.md: no option {sorted(documented - set(options))}"
