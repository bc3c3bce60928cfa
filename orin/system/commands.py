"""The one place that runs external programs (systemctl, nvpmodel, jetson_clocks,
tegrastats, sysctl, ...). Everything else takes a CommandRunner, so tests inject
a fake one and assert the exact command lines without running anything."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LineStream(Protocol):
    """Lines of a long-running program's stdout (e.g. tegrastats), until closed."""

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class CommandRunner(Protocol):
    def run(
        self, argv: Sequence[str], timeout: float = 30.0, input: str | None = None
    ) -> CommandResult: ...

    def stream(self, argv: Sequence[str]) -> LineStream: ...

    def which(self, name: str) -> str | None: ...


NOT_FOUND = 127  # what a shell reports for a missing program


class _ProcessLines:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def __iter__(self) -> Iterator[str]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            yield line.rstrip("\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class SubprocessRunner:
    """Runs real programs; a missing program or a timeout is a result, not an exception."""

    def run(
        self, argv: Sequence[str], timeout: float = 30.0, input: str | None = None
    ) -> CommandResult:
        args = tuple(argv)
        try:
            p = subprocess.run(
                args, capture_output=True, text=True, timeout=timeout, input=input, check=False
            )
        except FileNotFoundError:
            return CommandResult(args, NOT_FOUND, "", f"{args[0]}: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(args, 124, "", f"{args[0]}: timed out after {timeout:g} s")
        except OSError as exc:
            return CommandResult(args, 126, "", f"{args[0]}: {exc.strerror or exc}")
        return CommandResult(args, p.returncode, p.stdout, p.stderr)

    def stream(self, argv: Sequence[str]) -> LineStream:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
        )
        return _ProcessLines(proc)

    def which(self, name: str) -> str | None:
        return shutil.which(name)
