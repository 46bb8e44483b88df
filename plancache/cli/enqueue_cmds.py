"""``plancache enqueue``: register spec files on a server and queue tuning jobs for them (admin)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..settings import AdminSettings, env_name
from .common import (
    ExitCode,
    Failure,
    command,
    load_spec_file,
    open_jobs_api,
    quiet_retries,
    required,
    server_option,
)

_GIVE_ADMIN_TOKEN = (f"give --token or set {env_name('admin_token')} to an admin token (the server's bootstrap "
                     "token, or one from `plancache token create --role admin`)")


@command
def enqueue(
    files: list[Path] = typer.Argument(..., help="GraphSpec JSON files"),
    server: str | None = server_option("plancache server URL"),
    token: str | None = typer.Option(None, "--token", show_default=False,
                                        help="admin token (default: PLANCACHE_ADMIN_TOKEN, else PLANCACHE_TOKEN)"),
    sm: int | None = typer.Option(None, "--sm", help="compute capability major*10+minor, e.g. 90 (default: any)"),
    sm_count: int | None = typer.Option(None, "--sm-count", help="number of SMs, e.g. 132 (default: any)"),
    cudnn_version: int | None = typer.Option(None, "--cudnn-version", help="e.g. 91900 (default: any)"),
    driver_version: int | None = typer.Option(None, "--driver-version", help="e.g. 13000 (default: any)"),
    frontend_version: str | None = typer.Option(None, "--frontend-version", help="e.g. 1.32.0 (default: any)"),
    priority: int = typer.Option(0, "--priority", help="higher is claimed first"),
    wait: float = typer.Option(5.0, "--wait", min=0.0,
                               help="seconds to keep trying an unreachable or failing server before giving up"),
) -> None:
    """Register spec files on the server and queue a tuning job for each on the given target
    (a field left out matches any environment)."""
    from pydantic import ValidationError

    from ..client.remote import Remote
    from ..errors import Forbidden, Unauthorized
    from ..http import Backoff, Retry
    from ..protocol import TargetEnvironment, TuneRequest

    specs = [(p, load_spec_file(p)) for p in files]
    try:
        target = TargetEnvironment(sm=sm, sm_count=sm_count, cudnn_version=cudnn_version, driver_version=driver_version,
                                   frontend_version=frontend_version)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "--" + str(first["loc"][0]).replace("_", "-") if first.get("loc") else "the target"
        raise Failure(f"{field}: {first['msg']}", "see `plancache enqueue --help`", ExitCode.USAGE) from None
    settings = AdminSettings()
    server = required(server or settings.server_url, "enqueue has no server to send the jobs to",
                      f"give --server URL or set {env_name('server_url')}")
    token = required(token or settings.admin_token or settings.token, "enqueue needs an admin token, and none was "
                     "given", _GIVE_ADMIN_TOKEN, ExitCode.AUTH)
    retry = Retry(Backoff(initial=0.2, cap=2.0), within=wait)
    try:
        with quiet_retries(), open_jobs_api(server, token, settings, retry=retry) as api:
            for path, spec in specs:
                key = Remote(api.http).register_spec(spec)
                if key != spec.graph_key:
                    raise Failure(f"{path}: the server computed graph key {key}, this client {spec.graph_key}",
                                  "use the same plancache version on both sides", ExitCode.FAILED)
            jobs = api.enqueue(TuneRequest(graph_keys=[s.graph_key for _, s in specs], targets=[target],
                                           priority=priority))
    except (Unauthorized, Forbidden) as exc:
        raise Failure(f"{exc.message} (enqueue needs an admin token)", _GIVE_ADMIN_TOKEN, ExitCode.AUTH) from None
    names = {s.graph_key: p.name for p, s in specs}
    for job in jobs:
        typer.echo(f"job {job.id}  {job.status:<9} {job.graph_key[:12]}  {names.get(job.graph_key, '')}")


def register(app: typer.Typer) -> None:
    app.command("enqueue")(enqueue)
