"""``plancache worker``: claim tuning jobs for this GPU, tune, verify, sign and publish the plans."""

from __future__ import annotations

from pathlib import Path

import typer

from ..settings import WorkerSettings, env_name
from .common import (
    ExitCode,
    build_processes_option,
    command,
    load_signer,
    open_jobs_api,
    required,
    server_option,
    signing_key_option,
    writable_folder,
)


@command
def worker(
    server: str | None = server_option("plancache server URL"),
    token: str | None = typer.Option(None, "--token", show_default=False,
                                        help="worker-role token (`plancache token create --role worker`) "
                                             "(default: PLANCACHE_TOKEN)"),
    worker_id: str | None = typer.Option(None, "--worker-id", help="name sent with every claim (default: HOST-PID)"),
    spool_dir: Path | None = typer.Option(None, "--spool-dir", help="finished results wait here for upload "
                                             "(default: PLANCACHE_CACHE_DIR/worker-spool)"),
    once: bool = typer.Option(False, "--once", help="exit when no job is left for this environment instead of polling"),
    poll_interval: float = typer.Option(5.0, "--poll-interval", min=0.05, help="seconds between claims on an empty queue"),
    signing_key: Path | None = signing_key_option("ed25519 private key file (plancache keygen)"),
    device: int = typer.Option(0, "--device", min=0, help="CUDA device ordinal"),
    build_processes: int | None = build_processes_option(),
    shutdown_grace: float = typer.Option(25.0, "--shutdown-grace", min=0,
                                         help="on SIGTERM, seconds a running tuning may take to finish before release"),
) -> None:
    """Claim tuning jobs for this GPU's environment, tune, verify, sign and publish the plans."""
    import logging
    import threading

    from ..http import Retry
    from ..worker import GpuTuner, Spool, Worker, default_worker_id, stop_on_signals

    settings = WorkerSettings()
    server = required(server or settings.server_url, "the worker has no server to claim jobs from",
                      f"give --server URL or set {env_name('server_url')}")
    key_file = required(signing_key or settings.signing_key, "the worker signs every plan, and has no signing key",
                        f"give --signing-key or set {env_name('signing_key')} (create a key pair with "
                        "`plancache keygen`)")
    token = required(token or settings.token, "the worker needs a worker-role token, and none was given",
                     f"give --token or set {env_name('token')} (`plancache token create --role worker`)", ExitCode.AUTH)
    signer = load_signer(key_file)
    spool = Spool(writable_folder(spool_dir or settings.cache_dir / "worker-spool", "the worker spool folder",
                                  "give --spool-dir a folder you can write (default: "
                                  f"{env_name('cache_dir')}/worker-spool)"))
    client = open_jobs_api(server, token, settings, retry=Retry())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    stop_on_signals(stop)
    tuner = GpuTuner(device, build_processes=settings.build_processes if build_processes is None else build_processes,
                     build_timeout=settings.build_timeout)
    w = Worker(client, tuner, signer, spool, worker_id=worker_id or default_worker_id(),
               poll_interval=poll_interval, once=once, shutdown_grace=shutdown_grace, job_timeout=settings.job_timeout)
    try:
        w.run(stop)
    finally:
        tuner.close()
        client.close()


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
