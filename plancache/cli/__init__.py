"""The ``plancache`` command line. Each command lives in the module named after it and registers itself on the
app with ``register(app)``. What the modules share is a module per job: :mod:`~plancache.cli.failures` (the
error convention), :mod:`~plancache.cli.options`, :mod:`~plancache.cli.database`, :mod:`~plancache.cli.inputs`,
:mod:`~plancache.cli.output` and :mod:`~plancache.cli.server_api`. Heavy imports (torch, cudnn, SQLAlchemy,
FastAPI) happen inside the commands, so a client-only install can run the client commands.

=========================  ===================================
command                    module
=========================  ===================================
``serve``                  :mod:`plancache.cli.serve_cmds`
``db upgrade|migrate-blobs``  :mod:`plancache.cli.db_cmds`
``token create|revoke|list``  :mod:`plancache.cli.token_cmds`
``plans list|gc``          :mod:`plancache.cli.plans_cmds`
``bundle export|import``   :mod:`plancache.cli.bundle_cmds`
``index publish``          :mod:`plancache.cli.index_cmds`
``spec key|canonical``     :mod:`plancache.cli.spec_cmds`
``tune``                   :mod:`plancache.cli.tune_cmds` (tables: :mod:`plancache.cli.report`)
``worker``                 :mod:`plancache.cli.worker_cmds`
``enqueue``                :mod:`plancache.cli.enqueue_cmds`
``capture``                :mod:`plancache.cli.capture_cmds`
``explain``                :mod:`plancache.cli.explain_cmds`
``jobs list|cancel``       :mod:`plancache.cli.jobs_cmds`
``keygen``                 :mod:`plancache.cli.keygen_cmds`
=========================  ===================================
"""

from __future__ import annotations

import importlib
import warnings

import typer

from .. import __version__
from .help import use_plain_help

#: Modules that define ``register(app)``, in the order ``plancache --help`` lists their commands.
COMMAND_MODULES = [
    "plancache.cli.serve_cmds",
    "plancache.cli.db_cmds",
    "plancache.cli.token_cmds",
    "plancache.cli.plans_cmds",
    "plancache.cli.bundle_cmds",
    "plancache.cli.index_cmds",
    "plancache.cli.spec_cmds",
    "plancache.cli.tune_cmds",
    "plancache.cli.worker_cmds",
    "plancache.cli.enqueue_cmds",
    "plancache.cli.capture_cmds",
    "plancache.cli.explain_cmds",
    "plancache.cli.jobs_cmds",
    "plancache.cli.keygen_cmds",
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"plancache {__version__}")
        raise typer.Exit()


def make_app() -> typer.Typer:
    """A new app with every command (tests build their own)."""
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False,
                      help="plancache: a plan cache for cuDNN Frontend graphs. Exit codes: docs/CLI.md.")

    @app.callback()
    def root(
        version: bool | None = typer.Option(None, "--version", callback=_version, is_eager=True,
                                               help="print the plancache version and exit"),
    ) -> None:
        pass  # the options of `plancache` itself; the app's help is the Typer's

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    use_plain_help(app)
    return app


app = make_app()


def main() -> None:
    # torch warns at import when numpy is absent; plancache never hands torch a numpy array, so the warning at the
    # top of every tune and worker run says nothing to its users
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    app(prog_name="plancache")
