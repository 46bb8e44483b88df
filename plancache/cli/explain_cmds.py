"""``plancache explain``: why the server has no plan for spec files or graph keys on an environment."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ..settings import ClientSettings, env_name
from .failures import ExitCode, Failure, command, required
from .inputs import load_environment, load_spec_file
from .options import server_option
from .output import printable
from .server_api import http_client, pick_token


def _graph_key(item: str) -> tuple[str, str]:
    """``(graph key, label)`` of a spec file or a graph key given on the command line."""
    from ..protocol import GRAPH_KEY_PATTERN

    if re.fullmatch(GRAPH_KEY_PATTERN.strip("^$"), item):
        return item, ""
    path = Path(item)
    return load_spec_file(path).graph_key, path.name


@command
def explain(
    items: list[str] = typer.Argument(..., help="GraphSpec JSON files or graph keys (64 hex)"),
    environment: str | None = typer.Option(None, "--environment",
                                           help="the environment: a JSON file or inline JSON (default: this GPU's)"),
    server: str | None = server_option("plancache server URL"),
    token: str | None = typer.Option(None, "--token", show_default=False,
                                     help="reader token (default: PLANCACHE_TOKEN, else PLANCACHE_ADMIN_TOKEN)"),
) -> None:
    """Say, per graph, why the server has no plan for it on the environment: never registered, registered but
    never queued, queued, running, failed (with the job's error), tuned only for other environments (and in
    which validity fields the nearest differs), or that it has one."""
    from ..client.remote import Remote

    keys = [_graph_key(item) for item in items]
    settings = ClientSettings()
    server = required(server or settings.server_url, "explain has no server to ask",
                      f"give --server URL or set {env_name('server_url')}")
    if environment is not None:
        env = load_environment(environment, "--environment")
    else:
        from ..environment import detect  # this GPU's fingerprint (torch and cudnn)
        from ..errors import GpuUnavailable

        try:
            env = detect(0)
        except (GpuUnavailable, ImportError, RuntimeError) as exc:
            raise Failure(f"no GPU here to take the environment from ({exc})",
                          "give --environment FILE (the environment JSON of a plan, e.g. from `plancache plans list "
                          "--json`)", ExitCode.USAGE) from None
    remote = Remote(http_client(server, pick_token(token, admin=False), connect_timeout=settings.connect_timeout,
                                read_timeout=settings.read_timeout))
    try:
        reasons = remote.explain(env, [k for k, _ in keys])
    finally:
        remote.close()
    typer.echo(f"on {printable(env.describe())}:")
    for key, label in keys:
        reason = reasons[key]
        typer.echo(f"{key[:12]}  {label + '  ' if label else ''}{reason.reason}: {printable(reason.message)}")


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)
