"""docs/architecture.md names every module where it lives, and pyproject.toml's
contracts cover every package, so neither falls behind the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "orin"


def tree_blocks() -> dict[str, str]:
    """The code tree of architecture.md: each top-level entry's text under its name."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = text.split("```", 2)[1]
    blocks: dict[str, str] = {}
    name = ""
    for line in tree.splitlines():
        entry = re.match(r"^  (\S+)", line)
        if entry:
            name = entry.group(1)
            blocks[name] = line[len(entry.group(0)) :]
        elif name:
            blocks[name] += "\n" + line
    return blocks


def modules(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("__"))


def test_every_package_and_module_is_in_the_tree() -> None:
    blocks = tree_blocks()
    missing = []
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        block = blocks.get(f"{folder.name}/")
        if block is None:
            missing.append(f"{folder.name}/")
            continue
        missing += [f"{folder.name}/{m}" for m in modules(folder) if m not in block]
    missing += [m for m in modules(PACKAGE) if m not in blocks]
    assert missing == []


def test_the_llama_cpp_contract_names_every_package_but_its_two_owners() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, which pytest needs there
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "forbidden" and c["forbidden_modules"] == ["llama_cpp"]
    ]
    packages = {f"orin.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    packages |= {f"orin.{m.removesuffix('.py')}" for m in modules(PACKAGE)}
    assert set(contract["source_modules"]) == packages - {"orin.engine", "orin.llamacpp"}
