"""``plancache spec key`` and ``plancache tune``: work on spec files locally."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import PlanCacheError
from ..spec import GraphSpec, parse_spec

spec_app = typer.Typer(no_args_is_help=True, help="Inspect GraphSpec files.")


def load_spec_file(path: Path) -> GraphSpec:
    """Read and validate a spec file; exit with a message naming the file on any problem."""
    try:
        return parse_spec(path.read_text())
    except OSError as exc:
        raise typer.BadParameter(f"{path}: {exc.strerror}") from None
    except PlanCacheError as exc:
        raise typer.BadParameter(f"{path}: {exc.message}") from None


@spec_app.command("key")
def spec_key(files: list[Path] = typer.Argument(..., help="GraphSpec JSON files")) -> None:
    """Print the graph key of each spec (no GPU needed)."""
    for path in files:
        spec = load_spec_file(path)
        typer.echo(f"{spec.graph_key}  {path}")


@spec_app.command("canonical")
def spec_canonical(file: Path) -> None:
    """Print the canonical JSON the key is computed over."""
    typer.echo(load_spec_file(file).canonical_json())


def tune(
    files: list[Path] = typer.Argument(..., help="GraphSpec JSON files"),
    out: Optional[Path] = typer.Option(None, "--out", help="write <name>.blob and <name>.json per spec here"),
    server: Optional[str] = typer.Option(None, "--server", envvar="PLANCACHE_SERVER_URL", help="upload each plan to this server"),
    token: Optional[str] = typer.Option(None, "--token", envvar="PLANCACHE_TOKEN", help="worker token for --server"),
    signing_key: Optional[Path] = typer.Option(None, "--signing-key", envvar="PLANCACHE_SIGNING_KEY"),
    repeats: int = typer.Option(20, min=3, help="timed runs per candidate (fewer for slow ones)"),
    warmup: int = typer.Option(3, min=0),
    device: int = typer.Option(0, min=0, help="CUDA device ordinal"),
    show_candidates: bool = typer.Option(False, "--candidates", help="print every candidate's row"),
) -> None:
    """Autotune specs on this GPU; write the winners to --out and/or upload them to --server."""
    from rich.console import Console
    from rich.progress import Progress

    from .. import gpu
    from .report import candidate_table, summary_table

    if out is None and server is None:
        raise typer.BadParameter("give --out DIR, --server URL, or both")
    specs = [(p, load_spec_file(p)) for p in files]
    signer = _signer(signing_key) if server is not None else None
    console = Console()
    results = []
    with Progress(console=console, transient=True) as bar:
        for path, spec in specs:
            task = bar.add_task(f"tuning {path.name}", total=None)

            def progress(done: int, total: int, cand, task=task) -> None:
                bar.update(task, completed=done, total=total)

            try:
                tuned = gpu.autotune(spec, device=device, warmup=warmup, repeats=repeats, progress=progress)
            except PlanCacheError as exc:
                console.print(f"[red]{path}: {exc.message}[/red]")
                raise typer.Exit(1) from None
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


def _signer(path: Optional[Path]):
    from ..signing import Signer

    return Signer.from_file(path) if path else None


def write_result(out: Path, stem: str, spec: GraphSpec, tuned) -> Path:
    """Write ``<stem>.blob`` and ``<stem>.json`` (the plan record, spec included) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.blob").write_bytes(tuned.blob)
    record = tuned.to_meta(spec.graph_key, worker_id="plancache-tune").model_dump(mode="json")
    record["spec"] = spec.to_json()
    record["build_seconds"] = tuned.build_seconds
    record["timing_seconds"] = tuned.timing_seconds
    path = out / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def register(app: typer.Typer) -> None:
    app.add_typer(spec_app, name="spec")
    app.command("tune")(tune)
