"""A CommandRunner for tests: records every command line and answers from a script."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from orin.system.commands import NOT_FOUND, CommandResult

Answer = CommandResult | Callable[[tuple[str, ...]], CommandResult]


@dataclass
class FakeLines:
    lines: list[str]
    closed: bool = False

    def __iter__(self) -> Iterator[str]:
        for line in self.lines:
            if self.closed:
                return
            yield line

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeRunner:
    """``answers`` maps a command prefix (e.g. ("nvpmodel", "-q")) to its result."""

    answers: dict[tuple[str, ...], Answer] = field(default_factory=dict)
    streams: dict[tuple[str, ...], list[str]] = field(default_factory=dict)
    programs: set[str] = field(default_factory=set)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(
        self, argv: Sequence[str], timeout: float = 30.0, input: str | None = None
    ) -> CommandResult:
        args = tuple(argv)
        self.calls.append(args)
        for n in range(len(args), 0, -1):
            answer = self.answers.get(args[:n])
            if answer is not None:
                return answer(args) if callable(answer) else answer
        if args[0] in self.programs:
            return CommandResult(args, 0)
        return CommandResult(args, NOT_FOUND, "", f"{args[0]}: command not found")

    def stream(self, argv: Sequence[str]) -> FakeLines:
        args = tuple(argv)
        self.calls.append(args)
        for n in range(len(args), 0, -1):
            if args[:n] in self.streams:
                return FakeLines(list(self.streams[args[:n]]))
        return FakeLines([])

    def which(self, name: str) -> str | None:
        known = self.programs | {a[0] for a in self.answers} | {s[0] for s in self.streams}
        return f"/usr/bin/{name}" if name in known else None
