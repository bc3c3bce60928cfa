"""orin-llm rpc-worker: llama.cpp's RPC server, so a server on another board can
put part of a model's layers into this board's memory (docs/fleet.md).

The server runs in this process through ggml's backend registry (the same
pinned llama.cpp build the engine uses; no separate binary). It serves one
client at a time, holds the weights the client sent while that client stays
connected, and has no authentication or encryption: it listens on 127.0.0.1
unless told otherwise, and says so loudly whenever it listens anywhere else.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.errors import handle_errors
from orin.cli.logs import setup_logging
from orin.cli.options import path_named, service_user
from orin.cli.options import unit_dir as unit_dir_option
from orin.errors import LlamaCppError
from orin.install.steps import InstallError

log = logging.getLogger("orin.rpc")

SECURITY_WARNING = (
    "WARNING: the llama.cpp RPC protocol has no authentication and no encryption. "
    "Anyone who can reach {endpoint} can run computations on this board and read or "
    "overwrite the tensors it holds. Listen only on a private network between the "
    "boards (a dedicated link or VLAN, or a firewall that admits only the serving "
    "board), never on an interface the internet or untrusted hosts can reach."
)


@handle_errors
def rpc_worker(
    host: Annotated[
        str,
        typer.Option(
            envvar="ORIN_LLM_RPC_HOST",
            help="Address to listen on; anything but 127.0.0.1 must be given explicitly "
            "and is reachable without authentication.",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(envvar="ORIN_LLM_RPC_PORT", min=1, max=65535, help="TCP port.")
    ] = 50052,
    threads: Annotated[
        int, typer.Option(min=0, max=256, help="CPU threads; 0 = one per physical core.")
    ] = 0,
    cache: Annotated[
        Path | None,
        typer.Option(
            parser=path_named,
            help="llama.cpp's tensor cache: large tensors are kept here by hash, so a "
            "restarted server does not send them again.",
        ),
    ] = None,
) -> None:
    """Lend this board's memory and compute to `orin-llm serve --rpc` on another board."""
    from orin.engine import rpc

    setup_logging("text")
    _host(host)
    if cache is not None:
        _cache_dir(cache)
    if not rpc.is_loopback(host):
        print(SECURITY_WARNING.format(endpoint=f"{host}:{port}"), file=sys.stderr, flush=True)
    rpc.ggml().rpc_reg()
    rpc.check_bindable(host, port)
    from orin.engine.config import default_threads

    devs = rpc.worker_devices()
    for line in rpc.describe_devices(devs):
        log.info("device %s", line)
    n_threads = threads or default_threads()
    failed: list[bool] = []

    def serve() -> None:
        rpc.start_server(host, port, n_threads, cache, devs)
        failed.append(True)  # start_server returns only when it could not start
        stop.set()

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # llama.cpp's accept loop never returns: it runs on a daemon thread so that the
    # main thread can take SIGINT/SIGTERM and end the process
    threading.Thread(target=serve, name="orin-rpc-server", daemon=True).start()
    log.info("RPC worker listening on %s:%d (%d threads)", host, port, n_threads)
    while not stop.wait(0.5):
        pass
    if failed:
        raise LlamaCppError(f"the RPC server could not start on {host}:{port} (see above)")
    log.info("stopping")


def _cache_dir(path: Path) -> None:
    """``--cache``: a folder the worker can write (made when missing); llama.cpp's
    server would only fail later, on the first tensor it keeps."""
    import os

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(
            f"{path}: cannot make the folder: {exc.strerror or exc}", param_hint="--cache"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"{path}: this user cannot write there", param_hint="--cache")


_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def _host(value: str) -> str:
    """``--host``: an IPv4 address or a host name, nothing the unit's command line would
    read as more arguments (llama.cpp's RPC server splits its endpoint at the first
    colon, so it cannot listen on an IPv6 address)."""
    import ipaddress

    try:
        if ipaddress.ip_address(value).version == 6:
            raise typer.BadParameter(
                f"{value} is an IPv6 address; llama.cpp's RPC server listens on an IPv4 "
                "address or a host name",
                param_hint="--host",
            )
    except ValueError:
        if not _HOST_NAME.fullmatch(value):
            raise typer.BadParameter(
                f"{value!r} is not an IP address or host name", param_hint="--host"
            ) from None
    return value


def _peer(value: str) -> str:
    """An ``--allow`` value: one address or CIDR, as systemd's IPAddressAllow= takes it;
    never a list, a keyword (``any``) or a network that admits every address."""
    import ipaddress

    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not an address or CIDR (one per --allow)", param_hint="--allow"
        ) from None
    if net.prefixlen == 0:
        raise typer.BadParameter(
            f"{value} admits every address, which would undo the unit's IPAddressDeny=any: "
            "give the serving board's address",
            param_hint="--allow",
        )
    return str(net) if net.num_addresses > 1 else str(net.network_address)


@handle_errors
def install_rpc_worker(
    ctx: typer.Context,
    host: Annotated[
        str,
        typer.Option(
            help="Address of this board's private interface to the serving board (required: "
            "the worker is reachable there without authentication)."
        ),
    ],
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 50052,
    threads: Annotated[
        int, typer.Option(min=0, max=256, help="CPU threads; 0 = one per physical core.")
    ] = 0,
    cache: Annotated[
        bool, typer.Option(help="Keep llama.cpp's tensor cache in /var/cache/orin-llm/rpc.")
    ] = True,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            help="Address or CIDR of a serving board that may connect (repeatable); "
            "the unit drops every other peer (IPAddressDeny=any)."
        ),
    ] = None,
    user: Annotated[
        str, typer.Option(callback=service_user, help="System user the worker runs as (not root).")
    ] = "orin-llm",
    unit_dir: Annotated[
        str,
        typer.Option(
            "--unit-dir",
            callback=unit_dir_option,
            help="Folder for the unit file (a path systemd loads units from).",
        ),
    ] = "/etc/systemd/system",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the unit; change nothing.")
    ] = False,
    no_start: Annotated[
        bool, typer.Option("--no-start", help="Install and enable, but do not start.")
    ] = False,
    root: Annotated[Path, typer.Option(parser=path_named, hidden=True)] = Path("/"),
) -> None:
    """Install `orin-llm rpc-worker` as a hardened systemd service on this board."""
    from orin.cli.deps import deps
    from orin.engine.rpc import is_loopback
    from orin.install.host import gather, require_systemd
    from orin.install.units import (
        RPC_WORKER_SERVICE,
        RpcWorkerUnit,
        find_gpu_devices,
        protect_home_for,
        render_rpc_worker_unit,
    )
    from orin.system.root import SysRoot

    _host(host)
    allowed = tuple(_peer(a) for a in allow or ())
    if host == "0.0.0.0" and not allowed:
        raise typer.BadParameter(
            "0.0.0.0 listens on every interface of this board, with no authentication: "
            "give the address of its private interface to the serving board, or fence "
            "the worker with --allow",
            param_hint="--host",
        )
    d = deps(ctx)
    runner = d.runner
    facts = gather(runner, user, (RPC_WORKER_SERVICE,))
    exe = d.orin_executable()
    unit = RpcWorkerUnit(
        executable=exe,
        user=user,
        groups=facts.groups_present,
        host=host,
        port=port,
        devices=find_gpu_devices(SysRoot(root)),
        threads=threads,
        cache=cache,
        allow=allowed,
        protect_home=protect_home_for((exe,)),
    )
    text = render_rpc_worker_unit(unit)
    path = f"{unit_dir.rstrip('/')}/{RPC_WORKER_SERVICE}"
    if not is_loopback(host):
        print(SECURITY_WARNING.format(endpoint=unit.endpoint), file=sys.stderr)
    if dry_run:
        print(f"# {path}\n{text}", end="")
        print("dry run: nothing was changed")
        return
    if d.effective_uid() != 0:
        raise InstallError("install-rpc-worker changes the system: run it as root (sudo)")
    require_systemd(SysRoot(root))
    steps: list[tuple[str, ...]] = []
    if not facts.user_exists:
        steps.append(
            ("useradd", "--system", "--user-group", "--home-dir", "/var/lib/orin-llm",
             "--no-create-home", "--shell", "/usr/sbin/nologin",
             *(("--groups", ",".join(facts.groups_present)) if facts.groups_present else ()),
             user)
        )  # fmt: skip
    elif facts.missing_groups:  # the GPU nodes belong to video and render
        steps.append(("usermod", "--append", "--groups", ",".join(facts.missing_groups), user))
    target = SysRoot(root).path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    steps.append(("systemctl", "daemon-reload"))
    steps.append(("systemctl", "enable", *(() if no_start else ("--now",)), RPC_WORKER_SERVICE))
    if not no_start and facts.active.get(RPC_WORKER_SERVICE) == "active":
        steps.append(("systemctl", "restart", RPC_WORKER_SERVICE))  # the unit may have changed
    for argv in steps:
        res = runner.run(argv, timeout=60.0)
        if not res.ok:
            raise InstallError(f"`{' '.join(argv)}` failed: {(res.stderr or res.stdout).strip()}")
    print(f"installed {RPC_WORKER_SERVICE}: rpc-worker on {unit.endpoint} ({path})")
