"""The CLI's one error convention: every command is decorated with :func:`command`, which runs it inside
:func:`failures`: an expected failure ends the command with one or two lines on stderr, ``error: <the problem>`` and
``hint: <the fix>``, and the exit code of its class (:class:`ExitCode`, documented in docs/CLI.md).

A command raises :class:`Failure` for a problem it detects itself; the errors of the layers below are mapped by
:func:`as_failure` (the :mod:`plancache.errors` classes, a bad ``PLANCACHE_*`` value, a missing optional extra, OS
and database errors). Anything else is a bug: its traceback is printed and the code is :attr:`ExitCode.INTERNAL`.
Click's own usage errors (an unknown option, a missing argument) keep click's format and exit code 2.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import typer

from .. import __version__
from .. import settings as settings_module
from ..errors import (
    BlobStoreMismatch,
    BlobStoreUnavailable,
    Forbidden,
    GpuUnavailable,
    InsufficientGpuMemory,
    PlanCacheError,
    RequestRefused,
    SchemaNotReady,
    SchemaTooNew,
    ServerSpeaksHttp,
    ServerUnavailable,
    SignatureError,
    Unauthorized,
)
from ..settings import env_name

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class ExitCode(enum.IntEnum):
    """The exit code of each class of failure (docs/CLI.md, "Exit codes")."""

    OK = 0
    FAILED = 1  #: the operation was refused or failed on its data
    USAGE = 2  #: a command-line argument or option is wrong
    CONFIG = 3  #: a PLANCACHE_* variable has a bad value, or a needed setting is missing
    MISSING_EXTRA = 4  #: an optional dependency group is not installed
    OS_ERROR = 5  #: a file, folder or network port cannot be used
    DATABASE = 6  #: the database cannot be opened, created or used
    SERVER_UNAVAILABLE = 7  #: the server cannot be reached, or fails
    AUTH = 8  #: no token, or the token is refused
    GPU = 9  #: no usable GPU
    INTERNAL = 70  #: a bug in plancache
    INTERRUPTED = 130  #: Ctrl+C
    BROKEN_PIPE = 141  #: the reader of the output went away (``| head``), as for a program SIGPIPE ends


#: One line per exit code, as docs/CLI.md lists them (tests/integration/test_cli.py keeps the two the same).
EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "the operation was refused or failed on its data: a conflict, something not found, an invalid "
                     "spec, bundle, key or plan (verification), a tuning that found no working plan",
    ExitCode.USAGE: "a command-line argument or option is wrong (click's usage errors included)",
    ExitCode.CONFIG: "a `PLANCACHE_*` variable has a bad value (the message names the variable), or a setting the "
                     "command needs (server URL, signing key) was given neither as an option nor as a variable, or an "
                     "`https://` server URL names a server that speaks plain HTTP (not retried)",
    ExitCode.MISSING_EXTRA: "an optional dependency group is not installed: `pip install 'plancache[server]'` "
                            "or `'plancache[gpu]'`",
    ExitCode.OS_ERROR: "a file, folder or network port cannot be used (missing, not writable, address in use)",
    ExitCode.DATABASE: "the database cannot be opened, created or used, or its schema is not upgraded "
                       "(`plancache db upgrade`), or the blob store does not match it",
    ExitCode.SERVER_UNAVAILABLE: "the server cannot be reached, timed out, or answered 5xx/429: try again later",
    ExitCode.AUTH: "no token was given, or the server refused it (unknown, revoked, or its role may not do this)",
    ExitCode.GPU: "no usable GPU: no CUDA device or driver, no such device, not enough device memory",
    ExitCode.INTERNAL: "a bug in plancache: the traceback is printed; please report it",
    ExitCode.INTERRUPTED: "interrupted (Ctrl+C)",
    ExitCode.BROKEN_PIPE: "the program reading the output stopped reading (as `head` does): nothing is printed, as for a "
                          "program that SIGPIPE ends",
}


class Failure(Exception):
    """An expected failure of a command: ``problem`` (what went wrong, naming the thing), ``fix`` (what to do
    about it) and the exit ``code`` of its class."""

    def __init__(self, problem: str, fix: str | None = None, code: ExitCode = ExitCode.FAILED) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix
        self.code = code


# ------------------------------------------------------------------------------------------------ the mapping

#: The optional extras (pyproject.toml) and the top-level modules that come with them.
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("fastapi", "starlette", "uvicorn", "h11", "sqlalchemy", "alembic", "psycopg", "prometheus_client"),
    "gpu": ("cudnn", "torch"),
}

#: Fixes of the plancache errors that have one beyond their message, and the class of each.
_ERROR_CLASSES: list[tuple[type[PlanCacheError], ExitCode, str | None]] = [
    (SchemaTooNew, ExitCode.DATABASE, "run the plancache release that migrated it (or a newer one); an older one "
     "cannot use its schema"),
    (SchemaNotReady, ExitCode.DATABASE,
     "run `plancache db upgrade` (`plancache serve` runs it too, before it prints 'listening on')"),
    (BlobStoreMismatch, ExitCode.DATABASE,
     f"set {env_name('blob_store')} to where this database's blobs are (docs/DEPLOYMENT.md, 'Blob store')"),
    (BlobStoreUnavailable, ExitCode.OS_ERROR,
     f"check that the bucket of {env_name('blob_store')} exists and is reachable with the AWS_* variables "
     "(docs/DEPLOYMENT.md, 'Blob store'), then try again"),
    (ServerSpeaksHttp, ExitCode.CONFIG, f"give the server's http:// URL (--server / {env_name('server_url')})"),
    (ServerUnavailable, ExitCode.SERVER_UNAVAILABLE,
     (f"check that the server is running and reachable at that URL (--server / {env_name('server_url')}), "
      "then try again")),
    (Unauthorized, ExitCode.AUTH,
     (f"pass a valid token (--token, {env_name('token')} or {env_name('admin_token')}); "
      "create one with `plancache token create`")),
    (Forbidden, ExitCode.AUTH, "use a token whose role may do this (`plancache token create --role admin|worker|reader`)"),
    (GpuUnavailable, ExitCode.GPU,
     ("run it on a host with an NVIDIA GPU and driver and the gpu extra (pip install 'plancache[gpu]'), "
      "or choose another --device")),
    (InsufficientGpuMemory, ExitCode.GPU,
     "free memory on that device (other processes hold it: nvidia-smi), or tune on a GPU with more memory"),
    (SignatureError, ExitCode.FAILED,
     f"check that the signing key's public half is among the trusted keys (--trusted-keys / {env_name('trusted_keys')})"),
]


def one_line(text: object) -> str:
    return " ".join(str(text).split("\n")).strip()


def describe_os_error(exc: OSError) -> str:
    """``PATH: reason`` of an OSError (its reason alone when it names no path)."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def _settings_classes() -> set[str]:
    from pydantic_settings import BaseSettings

    return {name for name, obj in vars(settings_module).items()
            if isinstance(obj, type) and issubclass(obj, BaseSettings)}


def bad_setting(exc: Any) -> Failure:
    """The failure of a settings class that refused the environment (a pydantic ``ValidationError``): it names
    the variable and its value (not a secret's)."""
    problems = exc.errors()
    first = problems[0]
    field = str(first["loc"][0]) if first.get("loc") else ""
    variable = env_name(field) if field else "a PLANCACHE_* variable"
    declared = settings_module.Settings.model_fields.get(field)
    secret = declared is not None and not declared.repr  # a token: never echoed
    value = "" if secret or "input" not in first else f"={first['input']!r}"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return Failure(f"{variable}{value} is not valid: {first.get('msg', 'invalid value')}{more}",
                   f"set {variable} to a valid value, or unset it (docs/CONFIGURATION.md)", ExitCode.CONFIG)


def missing_module(exc: ImportError) -> Failure | None:
    """The failure of an optional dependency that could not be imported (None: a module of plancache itself)."""
    name = (exc.name or "").split(".")[0]
    if name == "plancache":
        return None
    for extra, modules in EXTRAS.items():
        if name in modules:
            return Failure(f"this command needs the '{extra}' extra, which is not installed ({exc})",
                           f"pip install 'plancache[{extra}]'", ExitCode.MISSING_EXTRA)
    return Failure(f"a module plancache needs cannot be imported: {exc}",
                   "reinstall plancache with the extras this command needs (README.md, Set up and run)",
                   ExitCode.MISSING_EXTRA)


def as_failure(exc: BaseException) -> Failure | None:
    """The :class:`Failure` an exception stands for; None for one no command expects (a bug)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, ImportError):
        return missing_module(exc)
    if isinstance(exc, ValidationError) and exc.title in _settings_classes():
        return bad_setting(exc)
    if isinstance(exc, SettingsError):
        return Failure(one_line(exc), "fix or unset that PLANCACHE_* variable (docs/CONFIGURATION.md)", ExitCode.CONFIG)
    if isinstance(exc, PlanCacheError):
        for cls, code, fix in _ERROR_CLASSES:
            if isinstance(exc, cls):
                return Failure(exc.message, fix, code)
        if isinstance(exc, RequestRefused) and exc.http_status in (401, 403):
            return Failure(exc.message, "use a token whose role may do this", ExitCode.AUTH)
        return Failure(exc.message, None, ExitCode.FAILED)
    if type(exc).__module__.startswith("sqlalchemy."):
        return database_failure(None, exc)
    if isinstance(exc, OSError):
        return Failure(describe_os_error(exc), "check the path and its permissions", ExitCode.OS_ERROR)
    return None


def report(failure: Failure) -> None:
    """Print ``failure`` as the CLI prints every expected failure: one ``error:`` line, one ``hint:`` line."""
    typer.echo(f"error: {one_line(failure.problem)}", err=True)
    if failure.fix:
        typer.echo(f"hint: {one_line(failure.fix)}", err=True)


@contextlib.contextmanager
def failures() -> Iterator[None]:
    """Run a command's body: an expected failure is reported (:func:`report`) and ends the command with its
    exit code; click's own exits and usage errors pass through; anything else is an internal error."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):  # exits, and usage errors (BadParameter)
        raise
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except BrokenPipeError:  # stdout's reader is gone: nothing to tell it; stdout pointed at nothing for the exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(int(ExitCode.BROKEN_PIPE)) from None
    except Exception as exc:
        if type(exc).__module__.startswith(("click.", "typer.")):  # click's own (typer vendors click)
            raise
        failure = as_failure(exc)
        if failure is None:
            traceback.print_exc()
            typer.echo(f"error: internal error in plancache {__version__}: {type(exc).__name__}: {one_line(exc)}",
                       err=True)
            typer.echo("hint: this is a bug; please report it with the traceback above", err=True)
            raise typer.Exit(int(ExitCode.INTERNAL)) from None
        report(failure)
        raise typer.Exit(int(failure.code)) from None


def command(func: F) -> F:
    """Decorate every command with this: it runs inside :func:`failures` (tests/integration/test_cli.py checks that each does)."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        with failures():
            return func(*args, **kwargs)

    run.handles_failures = True  # type: ignore[attr-defined]
    return cast(F, run)


def required(value: T | None, problem: str, fix: str, code: ExitCode = ExitCode.CONFIG) -> T:
    """``value``, or a :class:`Failure` when it is None or empty (a setting given neither as option nor variable)."""
    if value is None or value == "":
        raise Failure(problem, fix, code)
    return value


# ------------------------------------------------------------------------------------------------ the database


def database_place(url: str | None) -> tuple[str, str | None]:
    """How to name the database at ``url`` in a message, and its SQLite file (None for another database)."""
    if url is None:
        return "the database", None
    try:
        from sqlalchemy.engine import make_url

        u = make_url(url)
    except Exception:  # noqa: BLE001 - an unparseable URL: say so without echoing it
        return "the database (its URL cannot be parsed)", None
    if u.drivername.startswith("sqlite") and u.database:
        path = os.path.abspath(u.database)
        return f"the SQLite database {path}", path
    return f"the database {u.render_as_string(hide_password=True)}", None


def database_failure(url: str | None, exc: BaseException) -> Failure:
    """The failure of a database error (SQLAlchemy's, with the driver's own words) on ``url``."""
    where, path = database_place(url)
    detail = one_line(getattr(exc, "orig", None) or exc)
    if path is not None:
        fix = (f"check that {path} is a SQLite file you can read and write, in a folder you can write, or point "
               f"--database-url / {env_name('database_url')} elsewhere")
    else:
        fix = (f"check that the database server is up and that --database-url / {env_name('database_url')} "
               "(host, credentials, database name) is right")
    return Failure(f"cannot use {where}: {detail}", fix, ExitCode.DATABASE)
