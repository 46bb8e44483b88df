"""``plancache worker``: claim tuning jobs for this GPU, tune, verify, sign and publish the plans."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .. import logs
from ..errors import GpuUnavailable
from ..settings import WorkerSettings, env_name
from .failures import ExitCode, Failure, command, required
from .inputs import load_signer, writable_folder
from .options import build_processes_option, server_option, signing_key_option
from .server_api import open_jobs_api

if TYPE_CHECKING:
    from ..worker.supervisor import Child

#: How long ``worker --once`` retries an unreachable server before it exits 7 (a worker without --once waits on).
ONCE_RETRY_SECONDS = 120.0


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
    device: int | None = typer.Option(None, "--device", min=0, show_default=False,
                                      help="CUDA device ordinal among those CUDA_VISIBLE_DEVICES leaves visible "
                                           "(default: 0)"),
    all_devices: bool = typer.Option(False, "--all-devices",
                                     help="start one worker process per visible GPU, each with its own device, "
                                          "spool folder SPOOL/gpuN and worker id ID-gpuN"),
    build_processes: int | None = build_processes_option(),
    shutdown_grace: float = typer.Option(25.0, "--shutdown-grace", min=0,
                                         help="on SIGTERM, seconds a running tuning may take to finish before release"),
) -> None:
    """Claim tuning jobs for this GPU's environment, tune, verify, sign and publish the plans."""
    import logging
    import os
    import threading

    from ..errors import InvalidValue
    from ..http import Retry
    from ..worker import GpuTuner, Spool, Worker, check_worker_id, default_worker_id, stop_on_signals

    try:
        worker_id = check_worker_id(worker_id or default_worker_id())
    except InvalidValue as exc:
        raise Failure(exc.message, "give --worker-id a name of printable ASCII characters (letters, digits, "
                      "punctuation)", ExitCode.USAGE) from None
    if all_devices and device is not None:
        raise Failure("--all-devices starts a worker on every visible GPU, and --device picks one",
                      "give one of them (to run on some GPUs only, set CUDA_VISIBLE_DEVICES with --all-devices)",
                      ExitCode.USAGE)
    settings = WorkerSettings()
    server = required(server or settings.server_url, "the worker has no server to claim jobs from",
                      f"give --server URL or set {env_name('server_url')}")
    key_file = required(signing_key or settings.signing_key, "the worker signs every plan, and has no signing key",
                        f"give --signing-key or set {env_name('signing_key')} (create a key pair with "
                        "`plancache keygen`)")
    token = required(token or settings.token, "the worker needs a worker-role token, and none was given",
                     f"give --token or set {env_name('token')} (`plancache token create --role worker`)", ExitCode.AUTH)
    signer = load_signer(key_file)
    spool_root = spool_dir or settings.cache_dir / "worker-spool"
    spool_fix = f"give --spool-dir a folder you can write (default: {env_name('cache_dir')}/worker-spool)"
    logs.configure(settings.log_format)
    if all_devices:
        options = ["--server", server, "--signing-key", str(key_file), "--poll-interval", repr(poll_interval),
                   "--shutdown-grace", repr(shutdown_grace), *(["--once"] if once else [])]
        raise typer.Exit(_supervise(options, token, worker_id, spool_root, spool_fix,
                                    settings.build_processes if build_processes is None else build_processes,
                                    kill_after=shutdown_grace + 60))
    from .. import gpu  # noqa: F401 - the gpu extra: without it exit 4 (MISSING_EXTRA), as tune and --all-devices

    spool = Spool(writable_folder(spool_root, "the worker spool folder", spool_fix))
    # --once exits 7 (SERVER_UNAVAILABLE) when the server stays unreachable, instead of waiting for it forever
    client = open_jobs_api(server, token, settings, retry=Retry(within=ONCE_RETRY_SECONDS) if once else Retry(),
                           agent="worker")
    stop = threading.Event()
    stop_on_signals(stop)
    logging.getLogger("plancache.worker").info("tuning on CUDA device %d of those visible (CUDA_VISIBLE_DEVICES=%s)",
                                               device or 0, os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    tuner = GpuTuner(device or 0,
                     build_processes=settings.build_processes if build_processes is None else build_processes,
                     build_timeout=settings.build_timeout)
    w = Worker(client, tuner, signer, spool, worker_id=worker_id,
               poll_interval=poll_interval, once=once, shutdown_grace=shutdown_grace, job_timeout=settings.job_timeout,
               alive_file=settings.alive_file)
    try:
        w.run(stop)
    finally:
        tuner.close()
        client.close()


def _supervise(options: list[str], token: str, worker_id: str, spool_root: Path, spool_fix: str,
               build_processes: int | None, *, kill_after: float = 60.0) -> int:
    """Run one worker per visible GPU (:func:`worker_children`) under a supervisor; its exit status."""
    import os

    from ..environment import require_device
    from ..gpu.candidates import default_processes, usable_cores
    from ..worker.supervisor import Supervisor

    try:
        require_device(0)
    except GpuUnavailable as exc:
        raise Failure(f"--all-devices found no GPU to start workers on: {exc.message}",
                      "run it on a host with NVIDIA GPUs, their driver and the gpu extra (pip install 'plancache[gpu]'), "
                      "with CUDA_VISIBLE_DEVICES unset or naming the GPUs", ExitCode.GPU) from None
    import torch

    count = torch.cuda.device_count()
    builders = default_processes(max(usable_cores() // count, 1)) if build_processes is None else build_processes
    spools = [writable_folder(spool_root / f"gpu{n}", "the worker spool folder", spool_fix) for n in range(count)]
    supervisor = Supervisor(worker_children(options, token, worker_id, spools, builders, os.environ),
                            kill_after=kill_after)  # a worker stuck past its drain is killed
    supervisor.install_signal_handlers()
    return supervisor.run()


def worker_children(options: list[str], token: str, worker_id: str, spools: list[Path], build_processes: int,
                    environ: Mapping[str, str]) -> list[Child]:
    """One ``plancache worker`` per visible GPU ``N`` (as many as ``spools``): its command line (``options``, then
    ``--device 0``, spool folder ``spools[N]``, worker id ``WORKER_ID-gpuN`` and ``build_processes``) and its
    environment, ``environ`` with the token (never on a command line) and ``CUDA_VISIBLE_DEVICES`` naming GPU ``N``
    alone (:func:`~plancache.environment.device_selector`): a child can touch no other GPU, nor can its builders."""
    import sys

    from ..environment import device_selector
    from ..worker.supervisor import Child

    children = []
    for n, spool in enumerate(spools):
        argv = [sys.executable, "-m", "plancache", "worker", *options, "--device", "0", "--spool-dir", str(spool),
                "--worker-id", f"{worker_id[:248]}-gpu{n}", "--build-processes", str(build_processes)]
        env = {**environ, "CUDA_VISIBLE_DEVICES": device_selector(n, environ), env_name("token"): token}
        children.append(Child(f"gpu{n}", argv, env))
    return children


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
