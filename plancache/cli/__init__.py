"""The ``plancache`` command line. Each sub-module registers its commands on :data:`app`;
heavy imports (torch, cudnn, SQLAlchemy, FastAPI) happen inside the commands, so a
client-only install can run the client commands."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="plancache: a plan cache for cuDNN Frontend graphs.")

# Modules that define ``register(app)``; each owns one group of commands.
_COMMAND_MODULES = [
    "plancache.cli.spec_cmds",
    "plancache.cli.worker_cmds",
    "plancache.cli.db_cmds",
    "plancache.cli.bundle_cmds",
    "plancache.cli.serve_cmds",
]


def _load() -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app)


def main() -> None:
    _load()
    app()
