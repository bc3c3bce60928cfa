"""The orin-llm command: registers the command groups and stores the commands'
dependencies (``Deps``) on the context; nothing else."""

from __future__ import annotations

import logging
import os

import typer

from orin import __version__
from orin.cli import bench, deploy, doctor, install, model, monitor, profile, rpc, serve, tune
from orin.cli.deps import Deps
from orin.cli.help import Typer
from orin.cli.logs import StderrHandler, text_formatter

app = Typer(
    name="orin-llm",
    help="Run large language models on NVIDIA Jetson AGX Orin as a dependable local service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion (README.md)
)
app.add_typer(model.app, name="model")
app.add_typer(profile.app, name="profile")
app.command("serve")(serve.serve)
app.command("monitor")(monitor.monitor)
app.command("bench")(bench.bench)
app.command("doctor")(doctor.doctor)
app.add_typer(tune.app, name="tune")
app.command("install")(install.install)
app.command("uninstall")(install.uninstall)
app.command("status")(install.status)
app.add_typer(deploy.app, name="deploy")
app.command("rpc-worker")(rpc.rpc_worker)
app.command("install-rpc-worker")(rpc.install_rpc_worker)


def _version(value: bool) -> None:
    if value:
        print(f"orin-llm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """orin-llm: serve, tune and diagnose LLMs on Jetson AGX Orin."""
    ctx.ensure_object(Deps)  # production defaults, unless a test passed its own


def main() -> None:
    level = logging.DEBUG if os.environ.get("ORIN_LLM_DEBUG") else logging.WARNING
    handler = StderrHandler()
    handler.setFormatter(text_formatter("%(levelname)s %(name)s: %(message)s", None))
    logging.basicConfig(level=level, handlers=[handler])
    app()
