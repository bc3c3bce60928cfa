"""orin-llm status: the units' state, /health, and TTFT/TPOT from /metrics (or, with
--url, those of a server started by hand).

Latency comes from the server's own histograms, which are cumulative since
the server started: p50 and p95 are estimated from the buckets the way
PromQL's histogram_quantile does (linear inside the bucket the rank falls
in, so accurate to that bucket's width), and the mean is sum / count.
Prometheus with rate() over a window gives recent figures; status shows the
whole life of the current process.
"""

from __future__ import annotations

import itertools
import math
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from orin.errors import OrinError, unreachable
from orin.install.layout import (
    ENV_FILE,
    PROFILE_FILE,
    SERVICE,
    UNIT_DIRS,
    UNITS,
    env_values,
    unit_path,
)
from orin.install.plan import probe_url
from orin.install.probe import HttpGet
from orin.install.steps import read_file
from orin.profile.loader import parse_profile
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot

LATENCY_METRICS = {
    "ttft": "orin_llm_time_to_first_token_seconds",
    "tpot": "orin_llm_time_per_output_token_seconds",
}
SHOW_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "MemoryCurrent")
HTTP_TIMEOUT_S = 3.0
KEY_NEEDED = (
    "the server refused the request (401): it requires an API key for /v1/models and "
    "/metrics; give it with --api-key or ORIN_LLM_API_KEY"
)
KEY_REFUSED = (
    "the server refused the API key (401) for /v1/models and /metrics: check --api-key or "
    "ORIN_LLM_API_KEY"
)


def _refusal(with_key: bool) -> str:
    return KEY_REFUSED if with_key else KEY_NEEDED


@dataclass(frozen=True)
class Latency:
    count: int
    mean_s: float | None
    p50_s: float | None
    p95_s: float | None


@dataclass(frozen=True)
class UnitStatus:
    unit: str
    installed: bool
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> str:
        return self.properties.get("ActiveState", "unknown")


@dataclass(frozen=True)
class ServiceStatus:
    units: tuple[UnitStatus, ...]
    url: str | None
    health_status: int | None = None
    health: dict[str, Any] | None = None
    error: str | None = None
    latency: dict[str, Latency] = field(default_factory=dict)
    models: tuple[str, ...] | None = None  # /v1/models ids (status --url)
    refused: bool = False  # /v1/models or /metrics answered 401: the API key is missing or wrong

    @property
    def healthy(self) -> bool:
        return self.health_status == 200

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": [
                {"unit": u.unit, "installed": u.installed, **u.properties} for u in self.units
            ],
            "url": self.url,
            "health_status": self.health_status,
            "health": self.health,
            "error": self.error,
            "latency": {k: asdict(v) for k, v in self.latency.items()},
            "healthy": self.healthy,
            "refused": self.refused,
            **({"models": list(self.models)} if self.models is not None else {}),
        }


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative ``(upper bound, count)`` buckets, as PromQL computes it."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):  # in the overflow bucket: the highest finite bound
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def parse_latency(metrics_text: str) -> dict[str, Latency]:
    """TTFT and TPOT summaries from a /metrics body; a histogram not exported is left out,
    and a body that is not the Prometheus text format (another program on the port, a
    proxy's error page) exports none."""
    try:
        return _latency(metrics_text)
    except (ValueError, KeyError, TypeError):  # the parser's and float()'s complaints
        return {}


def _latency(metrics_text: str) -> dict[str, Latency]:
    wanted = {name: key for key, name in LATENCY_METRICS.items()}
    out: dict[str, Latency] = {}
    for family in text_string_to_metric_families(metrics_text):
        key = wanted.get(family.name)
        if key is None or family.type != "histogram":
            continue
        buckets: list[tuple[float, float]] = []
        total = count = 0.0
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), float(s.value)))
            elif s.name.endswith("_count"):
                count = float(s.value)
            elif s.name.endswith("_sum"):
                total = float(s.value)
        out[key] = Latency(
            count=int(count),
            mean_s=total / count if count else None,
            p50_s=histogram_quantile(0.5, buckets),
            p95_s=histogram_quantile(0.95, buckets),
        )
    return out


def service_url(root: SysRoot, unit_dir: str) -> str | None:
    """The address the installed service listens on, with serve's precedence.

    ``--port``/``--host`` in ExecStart beat ORIN_LLM_PORT/ORIN_LLM_HOST in the
    environment file, which beat the installed profile.
    """
    profile_text = read_file(root, PROFILE_FILE)
    if profile_text is None:
        return None
    try:
        profile = parse_profile(profile_text, PROFILE_FILE)
    except OrinError:
        return None
    host, port = profile.server.host, str(profile.server.port)
    exec_start, env = _service_settings(root, unit_dir)
    # the environment file's variables override Environment='s (systemd.exec(5))
    env.update(env_values(root.read_text(ENV_FILE) or ""))  # root-only: unreadable for users
    host, port = env.get("ORIN_LLM_HOST", host), env.get("ORIN_LLM_PORT", port)
    flags = _exec_flags(exec_start)
    host, port = flags.get("--host", host), flags.get("--port", port)
    return probe_url(host, int(port)) if port.isdigit() else None


def _service_settings(root: SysRoot, unit_dir: str) -> tuple[str, dict[str, str]]:
    """The server unit's ExecStart= and its Environment= variables, with the drop-ins
    in ``orin-llm.service.d/`` folders (``systemctl edit orin-llm``, where
    docs/install.md sends local changes) applied in the order systemd applies them: by file name,
    after the unit; an empty assignment resets the setting."""
    texts = [read_file(root, unit_path(unit_dir, SERVICE)) or ""]
    texts += [read_file(root, path) or "" for path in _dropins(root, SERVICE)]
    exec_start, env = "", dict[str, str]()
    for line in "\n".join(texts).splitlines():
        key, _, value = line.strip().partition("=")
        words = _words(value)
        if words is None:  # systemd, too, passes over a line it cannot split
            continue
        if key == "ExecStart":
            exec_start = value
        elif key == "Environment" and not value:
            env.clear()
        elif key == "Environment":
            env.update(w.partition("=")[::2] for w in words if "=" in w)
    return exec_start, env


def _words(value: str) -> list[str] | None:
    """A setting's value split as a shell would, or None where a quote is not closed."""
    try:
        return shlex.split(value)
    except ValueError:
        return None


def _dropins(root: SysRoot, unit: str) -> list[str]:
    """The drop-ins of ``unit`` in the order systemd applies them (systemd.unit(5)):
    those of every unit folder, whichever holds the unit (``systemctl edit`` writes
    to /etc/systemd/system), sorted by file name; of two with one name, the one in
    the folder first in UNIT_DIRS."""
    found: dict[str, str] = {}
    for folder in UNIT_DIRS:
        dropins = root.path(f"{folder}/{unit}.d")
        if dropins.is_dir():
            for p in dropins.glob("*.conf"):
                found.setdefault(p.name, f"{folder}/{unit}.d/{p.name}")
    return [found[name] for name in sorted(found)]


def _exec_flags(exec_start: str) -> dict[str, str]:
    words = _words(exec_start) or []
    flags = {w: v for w, v in itertools.pairwise(words) if w.startswith("--")}
    flags.update(w.partition("=")[::2] for w in words if w.startswith("--") and "=" in w)
    return flags


def read_status(
    root: SysRoot, runner: CommandRunner, get: HttpGet, unit_dir: str, with_key: bool = False
) -> ServiceStatus:
    units = tuple(_unit_status(root, runner, unit_dir, u) for u in UNITS)
    url = service_url(root, unit_dir)
    if url is None:
        return ServiceStatus(units, None, error=f"not installed ({PROFILE_FILE} is missing)")
    health = get(f"{url}/health", HTTP_TIMEOUT_S)
    if health.status is None:
        return ServiceStatus(units, url, error=unreachable(url, health.error))
    metrics = get(f"{url}/metrics", HTTP_TIMEOUT_S)
    latency = parse_latency(metrics.body) if metrics.status == 200 else {}
    refused = metrics.status == 401
    error = _refusal(with_key) if refused else None
    return ServiceStatus(units, url, health.status, health.json(), error, latency, refused=refused)


def read_server_status(get: HttpGet, url: str, with_key: bool = False) -> ServiceStatus:
    """A server started by hand (``orin-llm serve``), at ``url``: /health, /v1/models and
    the latency from /metrics; no units. ``with_key``: the requests carried an API key
    (a 401 then means the wrong one)."""
    url = url.rstrip("/")
    health = get(f"{url}/health", HTTP_TIMEOUT_S)
    if health.status is None:
        return ServiceStatus((), url, error=unreachable(url, health.error))
    listed = get(f"{url}/v1/models", HTTP_TIMEOUT_S)
    data = listed.json() if listed.status == 200 else None
    entries = data.get("data") if data is not None else None
    if not isinstance(entries, list):  # not OpenAI's list: no models to name
        entries = []
    models = tuple(str(m["id"]) for m in entries if isinstance(m, dict) and "id" in m)
    metrics = get(f"{url}/metrics", HTTP_TIMEOUT_S)
    latency = parse_latency(metrics.body) if metrics.status == 200 else {}
    refused = 401 in (listed.status, metrics.status)
    error = _refusal(with_key) if refused else None
    return ServiceStatus(
        (),
        url,
        health.status,
        health.json(),
        error,
        latency,
        models if not refused else None,
        refused,
    )


def _unit_status(root: SysRoot, runner: CommandRunner, unit_dir: str, unit: str) -> UnitStatus:
    props = ",".join(SHOW_PROPERTIES)
    res = runner.run(("systemctl", "show", unit, f"--property={props}"), timeout=10.0)
    values = dict(line.partition("=")[::2] for line in res.stdout.splitlines() if "=" in line)
    return UnitStatus(unit, root.exists(unit_path(unit_dir, unit)), values)
