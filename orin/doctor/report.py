"""Run the checks and turn their findings into a report and an exit code.

A check that raises is a bug in doctor, not a finding about the board: it is
reported as such, with the check's id, and makes the exit code 70 (the CLI's
"internal error"), so a broken check never passes for a healthy board. Exit
code 2 stays click's, for bad command-line usage alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orin.doctor.checks import CHECKS, Check
from orin.doctor.context import DoctorContext
from orin.doctor.findings import Finding

log = logging.getLogger("orin.doctor")

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_CHECK_CRASHED = 70  # a check raised: a bug in doctor (cli/errors.py EXIT_INTERNAL)


@dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]
    crashed: tuple[str, ...]
    seconds: float

    @property
    def exit_code(self) -> int:
        if self.crashed:
            return EXIT_CHECK_CRASHED
        if any(f.severity == "fail" for f in self.findings):
            return EXIT_FAIL
        return EXIT_OK

    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "info": 0, "warn": 0, "fail": 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def by_id(self) -> dict[str, Finding]:
        return {f.id: f for f in self.findings}

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "crashed": list(self.crashed),
            "seconds": round(self.seconds, 3),
            "findings": [f.to_dict() for f in self.findings],
        }


def run_checks(ctx: DoctorContext, checks: Sequence[tuple[str, Check]] = CHECKS) -> Report:
    start = time.perf_counter()
    findings, crashed = [], []
    for check_id, check in checks:
        try:
            finding = check(ctx)
        except Exception as exc:  # a doctor bug: report it, keep checking the rest
            log.debug("check %s raised", check_id, exc_info=True)
            crashed.append(check_id)
            finding = Finding(
                check_id,
                "warn",
                f"the check itself failed: {type(exc).__name__}: {exc}",
                why="doctor could not make this check",
                fix="run with ORIN_LLM_DEBUG=1 and report the traceback",
            )
        findings.append(finding)
    return Report(tuple(findings), tuple(crashed), time.perf_counter() - start)
