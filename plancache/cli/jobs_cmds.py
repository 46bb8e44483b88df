"""``plancache jobs list|cancel``: the server's tuning jobs (admin)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from ..protocol import JobStatus
from .failures import ExitCode, command
from .options import admin_token_option, server_option
from .output import printable
from .server_api import open_admin_api, quiet_retries

if TYPE_CHECKING:
    from ..protocol import Job

jobs_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       help="List the server's tuning jobs; cancel queued or running ones (admin).")


@jobs_app.command("list")
@command
def jobs_list(
    status: JobStatus | None = typer.Option(None, "--status", help="only jobs in this state"),
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="at most this many, newest first"),
    server: str | None = server_option("plancache server URL"),
    token: str | None = admin_token_option(),
) -> None:
    """Print the newest jobs under a header: id, status, attempts, source, graph key, target and error."""
    with quiet_retries(), open_admin_api(server, token, "jobs list") as api:
        jobs = api.jobs(status=status, limit=limit)
    if not jobs:
        typer.echo("no jobs", err=True)
        return
    typer.echo(jobs_table(jobs), nl=False)


def jobs_table(jobs: list[Job]) -> str:
    """`jobs list`'s lines: a header, then one line per job (its error's first line last, cut at 120 characters)."""
    lines = [f"{'id':>8}  {'status':<9}  {'tries':<5}  {'source':<8}  {'graph key':<16}  target / error"]
    for job in jobs:
        target = ", ".join(f"{k}={v}" for k, v in job.target.model_dump(exclude_none=True).items()) or "any"
        error = f"  {printable(job.error.splitlines()[0][:120])}" if job.error else ""
        lines.append(f"{job.id:>8}  {job.status:<9}  {f'{job.attempts}/{job.max_attempts}':<5}  "
                     f"{printable(job.source):<8}  {job.graph_key[:16]}  [{target}]{error}")
    return "\n".join(lines) + "\n"


@jobs_app.command("cancel")
@command
def jobs_cancel(
    job_ids: list[int] = typer.Argument(..., min=1, help="ids of queued or running jobs (`plancache jobs list`)"),
    reason: str = typer.Option("", "--reason", help="why; kept in each job's error"),
    server: str | None = server_option("plancache server URL"),
    token: str | None = admin_token_option(),
) -> None:
    """End queued or running jobs as failed: no worker claims them again, and a worker tuning one stops at its
    next heartbeat. Exits 1 if any could not be cancelled (unknown, or ended already), after trying each."""
    from ..errors import Conflict, NotFound

    refused = 0
    with quiet_retries(), open_admin_api(server, token, "jobs cancel") as api:
        for job_id in job_ids:
            try:
                job = api.cancel(job_id, reason)
            except (NotFound, Conflict) as exc:
                typer.echo(f"error: job {job_id}: {exc.message}", err=True)
                refused += 1
            else:
                typer.echo(f"cancelled job {job.id} ({job.graph_key[:16]})")
    if refused:
        raise typer.Exit(int(ExitCode.FAILED))


def register(app: typer.Typer) -> None:
    app.add_typer(jobs_app, name="jobs")
