"""profile validate: a profile, optionally with its model file, against every rule.

Findings use the severity scale doctor uses (``orin.severity``); the profile
is invalid when one of them is ``fail``. The memory fit is doctor's check
(``orin.profile.fit``), reported here as a warning at most: the memory read is
this machine's, and a profile is often validated elsewhere than on its board.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orin.errors import OrinError
from orin.llamacpp import BuildInfo
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.fit import draft_info, memory_fit, projector_bytes
from orin.profile.kvmatch import KVDecision, KVFinding, resolve_kv
from orin.profile.schema import Profile
from orin.severity import Severity
from orin.system.memory import read_meminfo
from orin.system.root import SysRoot


@dataclass(frozen=True)
class ValidationReport:
    profile: str
    model: str | None
    type_k: str
    type_v: str
    flash_attn: str
    findings: tuple[KVFinding, ...]

    @property
    def ok(self) -> bool:
        return not any(f.severity == "fail" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "model": self.model,
            "valid": self.ok,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "flash_attn": self.flash_attn,
            "findings": [vars(f) for f in self.findings],
        }


def validate_profile(
    profile: Profile,
    model: Path | None,
    build: BuildInfo | None,
    root: Path = Path("/"),
) -> ValidationReport:
    info = read_model_info(model) if model is not None else None
    try:
        available: int | None = read_meminfo(SysRoot(root)).available
    except OrinError:
        available = None
    findings: list[KVFinding] = []
    quant = profile.model.quantization
    if info is not None:
        findings += _quantization_findings(profile, info)
        quant = info.quantization
    elif quant is None and profile.model.demo is not None:
        quant = profile.model.demo.quant.upper()
    elif quant is None and profile.model.packaged is not None:
        from orin.model import packaged

        quant = packaged.get(profile.model.packaged).quantization
    decision = resolve_kv(profile.engine, quant, info, build, available)
    findings += decision.findings
    if build is None:
        findings.append(
            KVFinding("llama-build", "info", "llama-cpp-python not importable: CUDA rules skipped")
        )
    if info is not None and available is not None:
        findings += _memory_findings(profile, info, decision, available)
    return ValidationReport(
        profile=profile.name,
        model=str(model) if model is not None else None,
        type_k=decision.type_k,
        type_v=decision.type_v,
        flash_attn=decision.flash_attn,
        findings=tuple(findings),
    )


def _quantization_findings(profile: Profile, info: ModelInfo) -> list[KVFinding]:
    expected = profile.model.quantization
    if expected and expected.upper() != info.quantization.upper():
        return [
            KVFinding(
                "model-quantization",
                "warn",
                f"profile was written for {expected} but the file is {info.quantization}: "
                "its KV and memory settings may not suit this file",
            )
        ]
    return []


def _memory_findings(
    profile: Profile, info: ModelInfo, kv: KVDecision, available: int
) -> list[KVFinding]:
    flash = kv.flash_attn != "off"
    draft, proj = draft_info(profile), projector_bytes(profile)
    fit = memory_fit(info, profile.engine, kv.type_k, kv.type_v, flash, available, proj, draft)
    if fit.severity == "ok":
        return []
    # A KV type this model cannot hold fails anywhere; a shortage of memory is this machine's.
    severity: Severity = "fail" if fit.plan is None else "warn"
    message = (
        fit.found + (f": {fit.why}" if fit.why else "") + (f"; fix: {fit.fix}" if fit.fix else "")
    )
    return [KVFinding("memory-fit", severity, message)]
