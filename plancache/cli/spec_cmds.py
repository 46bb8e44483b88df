"""``plancache spec key|canonical``: work on GraphSpec files locally (no GPU, no server)."""

from __future__ import annotations

from pathlib import Path

import typer

from .failures import command
from .inputs import load_spec_file

spec_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect GraphSpec files.")


@spec_app.command("key")
@command
def spec_key(files: list[Path] = typer.Argument(..., help="GraphSpec JSON files")) -> None:
    """Print the graph key of each spec (no GPU needed)."""
    for path in files:
        spec = load_spec_file(path)
        typer.echo(f"{spec.graph_key}  {path}")


@spec_app.command("canonical")
@command
def spec_canonical(file: Path = typer.Argument(..., help="a GraphSpec JSON file")) -> None:
    """Print the canonical JSON the key is computed over."""
    typer.echo(load_spec_file(file).canonical_json())


def register(app: typer.Typer) -> None:
    app.add_typer(spec_app, name="spec")
