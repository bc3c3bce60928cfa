"""orin-llm deploy k8s: Kubernetes manifests for a fleet of Orins (orin/deploy/k8s.py).

The YAML goes to stdout (``| kubectl apply -f -``), or one file per object into
``--output DIR``; what the cluster needs besides (the API key's Secret, node
labels, the models folder on each board) is said on stderr, as are the names of
the files written (stdout stays empty then), as for every command (docs/cli.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.errors import fail, handle_errors, usage_error
from orin.cli.help import Typer
from orin.cli.options import ProfileOpt, folder_to_write, path_named
from orin.cli.output import human_bytes
from orin.deploy import k8s
from orin.profile.loader import load_profile

app = Typer(help="Deploy orin-llm to a cluster.", no_args_is_help=True)


class WorkloadKind(str, Enum):
    """--kind: a choice, so another value is a usage error (exit 2)."""

    deployment = "deployment"
    daemonset = "daemonset"


class VolumeKind(str, Enum):
    hostpath = "hostpath"
    pvc = "pvc"


class MonitorKind(str, Enum):
    podmonitor = "podmonitor"
    servicemonitor = "servicemonitor"
    none = "none"


def _checked(check: Callable[[str], str]) -> Callable[[str | None], str | None]:
    """An option callback from one of k8s's checks: its ValueError is a usage error."""

    def callback(value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    return callback


def _labels(values: list[str] | None) -> list[str] | None:
    try:
        k8s.parse_labels(values or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return values


def _check_combinations(
    ctx: typer.Context,
    volume: VolumeKind,
    pvc_size: str | None,
    storage_class: str | None,
    monitor: MonitorKind,
    monitor_label: list[str] | None,
) -> None:
    """An option that only applies to another choice would be ignored: a usage error."""
    if volume is VolumeKind.hostpath:
        given = [o for o, v in (("--pvc-size", pvc_size), ("--storage-class", storage_class)) if v]
        if given:
            raise usage_error(f"{' and '.join(given)}: for --volume pvc, not hostpath")
    source = ctx.get_parameter_source("host_path")  # its default is a value, not None
    if volume is VolumeKind.pvc and source is not None and source.name == "COMMANDLINE":
        raise usage_error("--host-path is for --volume hostpath: the models are on the claim")
    if monitor is MonitorKind.none and monitor_label:
        raise usage_error("--monitor-label labels the monitor, and --monitor none renders none")


@app.command("k8s")
@handle_errors
def kubernetes(
    ctx: typer.Context,
    profile_name: ProfileOpt = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas", min=1, help="Pods of the Deployment (one per board; default 1)."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            parser=path_named,
            callback=folder_to_write,
            help="Write one YAML file per object into this folder.",
        ),
    ] = None,
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", callback=_checked(k8s.check_namespace))
    ] = k8s.DEFAULT_NAMESPACE,
    image: Annotated[
        str,
        typer.Option(
            "--image",
            callback=_checked(k8s.check_image),
            help="The image built from deploy/Dockerfile.",
        ),
    ] = k8s.DEFAULT_IMAGE,
    kind: Annotated[
        WorkloadKind,
        typer.Option(
            "--kind", help="A Deployment of --replicas pods, or a DaemonSet: one pod per board."
        ),
    ] = WorkloadKind.deployment,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            parser=path_named,
            help="A copy of the profile's GGUF file (only its header is read) for the memory "
            "limits, when the file the profile names is not on this machine.",
        ),
    ] = None,
    mmproj: Annotated[
        Path | None,
        typer.Option(
            "--mmproj",
            parser=path_named,
            help="A copy of the profile's vision projector (model.mmproj) for the memory "
            "limits, when the file the profile names is not on this machine.",
        ),
    ] = None,
    draft_model: Annotated[
        Path | None,
        typer.Option(
            "--draft-model",
            parser=path_named,
            help="A copy of the profile's speculative draft model (speculative.draft_model) "
            "for the memory limits, when the file the profile names is not on this machine.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            callback=_checked(k8s.check_name),
            help="The objects' name (default: orin-llm-<profile>).",
        ),
    ] = None,
    volume: Annotated[
        VolumeKind,
        typer.Option(
            "--volume",
            help="The models: a folder on each board (hostpath) or a PersistentVolumeClaim.",
        ),
    ] = VolumeKind.hostpath,
    host_path: Annotated[
        str,
        typer.Option(
            "--host-path",
            callback=_checked(k8s.check_host_path),
            help="The models folder on each board (hostpath).",
        ),
    ] = k8s.MODELS_DIR,
    pvc_size: Annotated[
        str | None,
        typer.Option(
            "--pvc-size",
            callback=_checked(k8s.check_size),
            help="The claim's size (pvc; default: the model's and a quarter).",
        ),
    ] = None,
    storage_class: Annotated[
        str | None,
        typer.Option(
            "--storage-class",
            callback=_checked(k8s.check_storage_class),
            help="The claim's storage class (pvc).",
        ),
    ] = None,
    node_selector: Annotated[
        list[str] | None,
        typer.Option(
            "--node-selector",
            callback=_labels,
            help="KEY=VALUE, repeatable (default: arm64 and orin-llm/board=<profile's board>).",
        ),
    ] = None,
    gpu_group: Annotated[
        list[int] | None,
        typer.Option(
            "--gpu-group",
            min=0,
            help="A group id that owns the GPU's device nodes, repeatable (default: 44, video; "
            "add the board's render group).",
        ),
    ] = None,
    api_key_secret: Annotated[
        str | None,
        typer.Option(
            "--api-key-secret",
            callback=_checked(k8s.check_name),
            help="The Secret holding the API key under 'api-key' (default: <name>-api-key).",
        ),
    ] = None,
    monitor: Annotated[
        MonitorKind,
        typer.Option("--monitor", help="The Prometheus Operator object that scrapes /metrics."),
    ] = MonitorKind.podmonitor,
    monitor_label: Annotated[
        list[str] | None,
        typer.Option(
            "--monitor-label",
            callback=_labels,
            help="KEY=VALUE on the monitor, repeatable: what your Prometheus selects "
            "(e.g. release=kube-prometheus-stack).",
        ),
    ] = None,
) -> None:
    """Kubernetes manifests for the profile: memory limits from its memory plan, /health
    probes, the drain's grace period, the profile as a ConfigMap, the API key from a
    Secret, a Service and a Prometheus monitor."""
    if replicas is not None and kind.value == "daemonset":
        raise usage_error("--replicas is for a Deployment: a DaemonSet runs one pod per board")
    _check_combinations(ctx, volume, pvc_size, storage_class, monitor, monitor_label)
    profile = load_profile(profile_name or "demo")
    if mmproj is not None and profile.model.mmproj is None:
        raise usage_error(f"--mmproj: profile '{profile.name}' names no model.mmproj")
    if draft_model is not None and profile.speculative.mode != "draft":
        raise usage_error(
            f"--draft-model: profile '{profile.name}' does not set speculative.mode: draft"
        )
    path, info = k8s.model_for_plan(profile, model)
    plan = k8s.plan_for(profile, info, mmproj, draft_model)
    opts = k8s.K8sOptions(
        name=name,
        namespace=namespace,
        image=image,
        replicas=replicas or 1,
        kind=kind.value,
        volume=volume.value,
        host_path=host_path,
        pvc_size=pvc_size,
        storage_class=storage_class,
        node_selector=k8s.parse_labels(node_selector) if node_selector else None,
        gpu_groups=tuple(gpu_group) if gpu_group else (k8s.VIDEO_GID,),
        api_key_secret=api_key_secret,
        monitor=monitor.value,
        monitor_labels=k8s.parse_labels(monitor_label or []),
    )
    rendered = k8s.render(profile, plan, opts)
    limits = rendered.limits
    summary = (
        f"memory plan {human_bytes(plan.total_bytes)} ({path.name}): request "
        f"{human_bytes(limits.memory_high)}, limit {human_bytes(limits.memory_max)}"
    )
    if output is None:
        sys.stdout.write(rendered.yaml())
    else:
        try:
            written, removed = rendered.write(output)
        except OSError as exc:  # a folder the check at the start could not foresee (/proc/x)
            raise fail(
                f"cannot write the manifests into {output}: {exc.strerror or exc}", 1
            ) from None
        for path in removed:
            print(f"removed {path} (not part of this rendering)", file=sys.stderr)
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    for line in (summary, *rendered.notes):
        print(f"# {line}", file=sys.stderr)
