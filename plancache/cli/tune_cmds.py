"""``plancache tune``: autotune spec files on this GPU; write the winners to a folder and/or upload them."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ..settings import WorkerSettings, env_name
from .failures import ExitCode, Failure, as_failure, command, required
from .inputs import load_signer, load_spec_file, writable_folder
from .options import admin_token_option, build_processes_option, server_option, signing_key_option
from .output import plain_console
from .server_api import pick_token

if TYPE_CHECKING:
    from ..spec import GraphSpec


@command
def tune(
    files: list[Path] = typer.Argument(..., help="GraphSpec JSON files"),
    out: Path | None = typer.Option(None, "--out", help="write <name>.blob and <name>.json per spec here"),
    server: str | None = server_option("upload each plan to this server"),
    token: str | None = admin_token_option("admin token for --server (a worker token uploads only the plans of "
                                           "jobs it holds)"),
    signing_key: Path | None = signing_key_option("ed25519 private key that signs uploaded plans"),
    repeats: int = typer.Option(20, "--repeats", min=3, help="timed runs per candidate (fewer for slow ones)"),
    warmup: int = typer.Option(3, "--warmup", min=0, help="untimed runs per candidate before timing"),
    device: int = typer.Option(0, "--device", min=0, help="CUDA device ordinal"),
    build_processes: int | None = build_processes_option(),
    show_candidates: bool = typer.Option(False, "--candidates", help="print every candidate's row"),
) -> None:
    """Autotune specs on this GPU; write the winners to --out and/or upload them to --server."""
    worker = WorkerSettings()
    server = server or worker.server_url
    if out is None and server is None:
        raise Failure("nowhere to put the tuned plans",
                      f"give --out DIR, --server URL (or set {env_name('server_url')}), or both", ExitCode.USAGE)
    specs = [(p, load_spec_file(p)) for p in files]
    signer = None
    if server is not None:
        token = required(pick_token(token, admin=True),
                         "uploading to --server needs an admin token, and none was given",
                         f"give --token or set {env_name('admin_token')} (`plancache token create --role admin`)",
                         ExitCode.AUTH)
        key_file = signing_key or worker.signing_key
        signer = load_signer(key_file) if key_file else None

    from rich.progress import Progress

    from .. import (
        gpu,  # the gpu extra (torch, cudnn): without it, MISSING_EXTRA (after the arguments are checked)
    )
    from ..errors import PlanCacheError
    from ..gpu.candidates import BuildPool, default_processes
    from ..gpu.runtime import require_gpu
    from .report import candidate_table, summary_table

    require_gpu(device)  # no GPU: GpuUnavailable before anything is written
    if out is not None:
        writable_folder(out, "the --out folder", "give --out a folder you can write")

    console = plain_console()
    results = []
    processes = build_processes if build_processes is not None else worker.build_processes
    processes = default_processes() if processes is None else processes
    builders = BuildPool(processes, device=device, build_timeout=worker.build_timeout) if processes else None
    with Progress(console=console, transient=True) as bar, builders or contextlib.nullcontext():
        for n, (path, spec) in enumerate(specs):
            following = specs[n + 1][1] if n + 1 < len(specs) else None  # its builds queued behind this one's
            task = bar.add_task(f"tuning {path.name}", total=None)

            def progress(done: int, total: int, cand: Any, task: Any = task) -> None:
                bar.update(task, completed=done, total=total)

            try:
                tuned = gpu.autotune(spec, device=device, warmup=warmup, repeats=repeats, progress=progress,
                                     builders=builders, following=following)
            except PlanCacheError as exc:
                raise failure_of_spec(path, exc) from None
            bar.remove_task(task)
            results.append((path, spec, tuned))
            if show_candidates:
                console.print(candidate_table(path.name, tuned))
            if out is not None:
                write_result(out, path.stem, spec, tuned)
            if server is not None:
                from ..worker.tuner import GpuTuner
                from ..worker.upload import upload_tuned

                upload_tuned(server, token, spec, tuned, signer, worker_id="plancache-tune", tuner=GpuTuner(device))
    console.print(summary_table(results))


def failure_of_spec(path: Path, exc: Exception) -> Failure:
    """The failure of tuning the spec in ``path``: its class's, the message naming the file."""
    failure = as_failure(exc) or Failure(str(exc))
    return Failure(f"{path}: {failure.problem}", failure.fix, failure.code)


def write_result(out: Path, stem: str, spec: GraphSpec, tuned: Any) -> Path:
    """Write ``<stem>.blob`` and ``<stem>.json`` (the plan record, spec and every candidate tried included) into
    ``out``: a local file, not bounded like the table a server stores."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.blob").write_bytes(tuned.blob)
    record = tuned.to_meta(spec.graph_key, worker_id="plancache-tune").model_dump(mode="json")
    record["candidates"] = [c.model_dump(mode="json") for c in tuned.candidates]
    record["spec"] = spec.to_json()
    record["build_seconds"] = tuned.build_seconds
    record["timing_seconds"] = tuned.timing_seconds
    path = out / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
