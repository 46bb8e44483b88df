"""``plancache worker``, ``plancache enqueue`` and ``plancache keygen``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import PlanCacheError
from ..settings import get_settings


def worker(
    server: str = typer.Option(..., "--server", envvar="PLANCACHE_SERVER_URL", help="plancache server URL"),
    token: Optional[str] = typer.Option(None, "--token", envvar="PLANCACHE_TOKEN", help="worker-role token"),
    worker_id: Optional[str] = typer.Option(None, "--worker-id", help="name sent with every claim (default: HOST-PID)"),
    spool_dir: Optional[Path] = typer.Option(None, "--spool-dir", help="finished results wait here for upload "
                                             "(default: PLANCACHE_CACHE_DIR/worker-spool)"),
    once: bool = typer.Option(False, "--once", help="exit when no job is left for this environment instead of polling"),
    poll_interval: float = typer.Option(5.0, "--poll-interval", min=0.05, help="seconds between claims on an empty queue"),
    signing_key: Optional[Path] = typer.Option(None, "--signing-key", envvar="PLANCACHE_SIGNING_KEY",
                                               help="ed25519 private key file (plancache keygen)"),
    device: int = typer.Option(0, "--device", min=0, help="CUDA device ordinal"),
    shutdown_grace: float = typer.Option(25.0, "--shutdown-grace", min=0,
                                         help="on SIGTERM, seconds a running tuning may take to finish before release"),
) -> None:
    """Claim tuning jobs for this GPU's environment, tune, verify, sign and publish the plans."""
    import logging
    import threading

    from ..signing import Signer
    from ..worker import GpuTuner, JobsApi, Spool, Worker, default_worker_id, stop_on_signals

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if signing_key is None:
        raise typer.BadParameter("the worker signs every plan: give --signing-key or set PLANCACHE_SIGNING_KEY "
                                 "(create a key with `plancache keygen`)", param_hint="--signing-key")
    settings = get_settings()
    try:
        signer = Signer.from_file(signing_key)
        client = JobsApi.open(server, token)
    except (OSError, PlanCacheError, ValueError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(2) from None
    stop = threading.Event()
    stop_on_signals(stop)
    w = Worker(client, GpuTuner(device), signer, Spool(spool_dir or settings.cache_dir / "worker-spool"),
               worker_id=worker_id or default_worker_id(), poll_interval=poll_interval, once=once,
               shutdown_grace=shutdown_grace)
    try:
        w.run(stop)
    except PlanCacheError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()


def enqueue(
    files: list[Path] = typer.Argument(..., help="GraphSpec JSON files"),
    server: str = typer.Option(..., "--server", envvar="PLANCACHE_SERVER_URL", help="plancache server URL"),
    token: Optional[str] = typer.Option(None, "--token", envvar=["PLANCACHE_ADMIN_TOKEN", "PLANCACHE_TOKEN"],
                                        help="admin token"),
    sm: Optional[int] = typer.Option(None, "--sm", help="compute capability major*10+minor, e.g. 90 (default: any)"),
    sm_count: Optional[int] = typer.Option(None, "--sm-count", help="(default: any)"),
    cudnn_version: Optional[int] = typer.Option(None, "--cudnn-version", help="e.g. 91900 (default: any)"),
    driver_version: Optional[int] = typer.Option(None, "--driver-version", help="e.g. 13000 (default: any)"),
    frontend_version: Optional[str] = typer.Option(None, "--frontend-version", help="e.g. 1.32.0 (default: any)"),
    priority: int = typer.Option(0, "--priority", help="higher is claimed first"),
) -> None:
    """Register spec files on the server and queue a tuning job for each on the given target
    (a field left out matches any environment)."""
    from pydantic import ValidationError

    from ..client.remote import Remote
    from ..http import Retry
    from ..protocol import TargetEnvironment, TuneRequest
    from ..worker import JobsApi
    from .spec_cmds import load_spec_file

    specs = [(p, load_spec_file(p)) for p in files]
    try:
        target = TargetEnvironment(sm=sm, sm_count=sm_count, cudnn_version=cudnn_version, driver_version=driver_version,
                                   frontend_version=frontend_version)
    except ValidationError as exc:
        raise typer.BadParameter(str(exc.errors()[0]["msg"])) from None
    try:
        with JobsApi.open(server, token, retry=Retry(within=10)) as api:
            for path, spec in specs:
                key = Remote(api.http).register_spec(spec)
                if key != spec.graph_key:
                    raise typer.BadParameter(f"{path}: server computed key {key}, "
                                             f"this client {spec.graph_key}; versions differ?")
            jobs = api.enqueue(TuneRequest(graph_keys=[s.graph_key for _, s in specs], targets=[target],
                                           priority=priority))
    except (PlanCacheError, ValueError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(1) from None
    names = {s.graph_key: p.name for p, s in specs}
    for job in jobs:
        typer.echo(f"job {job.id}  {job.status:<9} {job.graph_key[:12]}  {names.get(job.graph_key, '')}")


def keygen(
    out: Path = typer.Option(Path("."), "--out", help="directory for NAME.key and NAME.pub"),
    name: str = typer.Option("plancache", "--name", help="file name stem"),
) -> None:
    """Create an ed25519 signing key pair: NAME.key for workers, NAME.pub for clients."""
    from ..signing import keygen as make_key

    if not name or "/" in name or name.startswith("."):
        raise typer.BadParameter(f"{name!r} is not a plain file name", param_hint="--name")
    try:
        priv, pub, kid = make_key(out, name)
    except (FileExistsError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"key id {kid}\nprivate key {priv}  (workers: PLANCACHE_SIGNING_KEY)\n"
               f"public key  {pub}  (clients: PLANCACHE_TRUSTED_KEYS)")


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
    app.command("enqueue")(enqueue)
    app.command("keygen")(keygen)
