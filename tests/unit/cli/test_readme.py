"""README.md says what the code does: one default port, the exit-code table, completion."""

from __future__ import annotations

import re
from pathlib import Path

from orin.cli.errors import EXIT_CODES, EXIT_INTERNAL, EXIT_STDOUT_CLOSED, EXIT_USAGE
from orin.errors import BindError, HubError, ModelFileError, OrinError, ProfileError
from orin.profile.schema import ServerSection

README = Path(__file__).resolve().parents[3] / "README.md"


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
    mapped = set(EXIT_CODES.values()) | {0, EXIT_USAGE, EXIT_INTERNAL, EXIT_STDOUT_CLOSED}
    assert set(table) == mapped
    assert EXIT_CODES[OrinError] == 1 and "failed check" in table[1]
    assert EXIT_USAGE == 2 and "usage" in table[2]
    assert EXIT_CODES[ModelFileError] == 3 and "model file" in table[3]
    assert EXIT_CODES[ProfileError] == 4 and "profile" in table[4]
    assert EXIT_CODES[BindError] == 8 and "address is in use" in table[8]
    assert EXIT_CODES[HubError] == 9 and "download" in table[9]
    assert "internal" in table[EXIT_INTERNAL] and "SIGPIPE" in table[EXIT_STDOUT_CLOSED]


def test_shell_completion_is_documented() -> None:
    text = readme()
    assert "## Shell completion" in text
    assert "orin-llm --install-completion" in text and "orin-llm --show-completion bash" in text
