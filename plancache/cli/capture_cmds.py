"""``plancache capture``: run a program with the hook capturing every cuDNN FE graph it builds into a file."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import typer

from .failures import ExitCode, Failure, command


@command
def capture(
    program: list[str] = typer.Argument(..., metavar="-- PROGRAM [ARGS]...",
                                        help="the program to run and its arguments, after --"),
    out: Path = typer.Option(..., "--out", "-o", help="the capture file (counts are added when it exists)"),
) -> None:
    """Run PROGRAM with the hook capturing every cuDNN FE graph it builds (in every Python process it starts) into
    the capture file: keys, spec documents, how often each was built. Nothing is uploaded and no server is asked
    (PLANCACHE_SERVER_URL is unset for the program). Then `plancache enqueue FILE` tunes them. Exits with PROGRAM's
    exit code."""
    from ..client.boot import BOOT_SOURCE
    from ..client.capture import read_capture
    from ..errors import SpecError

    out = out.absolute()
    if not out.parent.is_dir():
        raise Failure(f"cannot write the capture file {out}: {out.parent} is not a folder",
                      "give --out a path in an existing folder", ExitCode.OS_ERROR)
    if out.exists():
        try:
            read_capture(out)
        except SpecError as exc:
            raise Failure(f"{out} exists and is not a capture file this plancache can add to ({exc})",
                          "give --out a new file, or a capture file written by plancache capture",
                          ExitCode.USAGE) from None
    with tempfile.TemporaryDirectory(prefix="plancache-capture-") as boot:
        Path(boot, "sitecustomize.py").write_text(BOOT_SOURCE, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "PLANCACHE_SERVER_URL"}
        env["PLANCACHE_CAPTURE"] = str(out)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (boot, os.environ.get("PYTHONPATH")) if p)
        try:
            rc = subprocess.run(program, env=env, check=False).returncode
        except OSError as exc:
            raise Failure(f"cannot run {program[0]}: {exc.strerror or exc}",
                          "give the program after --, e.g. plancache capture --out graphs.json -- python app.py",
                          ExitCode.OS_ERROR) from None
    if not out.exists():
        typer.echo(f"captured no graph: {program[0]} built no cuDNN FE graph (or did not run Python with cudnn)", err=True)
    else:
        graphs = read_capture(out)
        typer.echo(f"captured {len(graphs)} graphs ({sum(n for _, n in graphs)} builds) into {out}", err=True)
    if rc:
        raise typer.Exit(rc)


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)
