"""``plancache keygen``: an ed25519 key pair for signing plans."""

from __future__ import annotations

from pathlib import Path

import typer

from .failures import ExitCode, Failure, command


@command
def keygen(
    directory: Path | None = typer.Argument(None, metavar="DIR", show_default=False,
                                               help="directory for NAME.key and NAME.pub (the same as --out) "
                                                    "(default: .)"),
    out: Path | None = typer.Option(None, "--out", show_default=False,
                                       help="directory for NAME.key and NAME.pub (default: .)"),
    name: str = typer.Option("plancache", "--name", help="file name stem"),
) -> None:
    """Create an ed25519 signing key pair: NAME.key for workers, NAME.pub for clients."""
    from ..signing import keygen as make_key

    if directory is not None and out is not None and directory != out:
        raise Failure(f"two directories given: {directory} and --out {out}", "give one of them", ExitCode.USAGE)
    folder = directory or out or Path(".")
    if not name or "/" in name or name.startswith("."):
        raise Failure(f"--name {name!r} is not a plain file name", "give a name such as 'fleet' (no '/', no "
                      "leading '.')", ExitCode.USAGE)
    try:
        priv, pub, kid = make_key(folder, name)
    except FileExistsError as exc:
        raise Failure(str(exc), "choose another --name or directory, or remove the old pair first",
                      ExitCode.FAILED) from None
    except OSError as exc:
        raise Failure(f"cannot write the key pair into {folder}: {exc.strerror or exc}",
                      "give a directory you can write", ExitCode.OS_ERROR) from None
    typer.echo(f"key id {kid}\nprivate key {priv}  (workers: PLANCACHE_SIGNING_KEY)\n"
               f"public key  {pub}  (clients: PLANCACHE_TRUSTED_KEYS)")


def register(app: typer.Typer) -> None:
    app.command("keygen")(keygen)
