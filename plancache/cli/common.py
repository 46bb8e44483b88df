"""What the command modules share: the CLI's one error convention, and the loaders and options several
commands use.

**Errors.** Every command is decorated with :func:`command`, which runs it inside :func:`failures`: an expected
failure ends the command with one or two lines on stderr, ``error: <the problem>`` and ``hint: <the fix>``, and
the exit code of its class (:class:`ExitCode`, documented in docs/CLI.md). A command raises :class:`Failure`
for a problem it detects itself; the errors of the layers below are mapped by :func:`as_failure` (the
:mod:`plancache.errors` classes, a bad ``PLANCACHE_*`` value, a missing optional extra, OS and database errors).
Anything else is a bug: its traceback is printed and the code is :attr:`ExitCode.INTERNAL`. Click's own usage
errors (an unknown option, a missing argument) keep click's format and exit code 2.

**Settings.** A command reads the settings class of its role (:mod:`plancache.settings`); an option left out
takes its value from there, never from a second reading of the environment.

Heavy modules (SQLAlchemy, FastAPI, torch, cudnn) are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

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
from ..files import read_limited, too_large
from ..settings import DEFAULT_MAX_JSON_BYTES, ConnectionSettings, StoreSettings, env_name

if TYPE_CHECKING:
    from rich.console import Console

    from ..environment import Environment
    from ..http import Agent, HttpClient, Policy, Retry
    from ..signing import Signer, TrustedKeys
    from ..spec import GraphSpec
    from ..store import Store
    from ..worker import JobsApi

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


def _one_line(text: object) -> str:
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
        return Failure(_one_line(exc), "fix or unset that PLANCACHE_* variable (docs/CONFIGURATION.md)", ExitCode.CONFIG)
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
    typer.echo(f"error: {_one_line(failure.problem)}", err=True)
    if failure.fix:
        typer.echo(f"hint: {_one_line(failure.fix)}", err=True)


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
            typer.echo(f"error: internal error in plancache {__version__}: {type(exc).__name__}: {_one_line(exc)}",
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


# ------------------------------------------------------------------------------------------------ options

DATABASE_URL_HELP = f"database URL (default: {env_name('database_url')}, else sqlite:///./plancache.db)"


def database_url_option() -> Any:
    return typer.Option(None, "--database-url", help=DATABASE_URL_HELP, show_default=False)


def server_option(help: str) -> Any:
    return typer.Option(None, "--server", help=f"{help} (default: {env_name('server_url')})", show_default=False)


def signing_key_option(help: str) -> Any:
    return typer.Option(None, "--signing-key", help=f"{help} (default: {env_name('signing_key')})", show_default=False)


def build_processes_option() -> Any:
    return typer.Option(None, "--build-processes", min=0, max=256, show_default=False,
                        help="processes that build candidate plans while this one times them; 0: build here "
                             f"(default: {env_name('build_processes')}, else all CPU cores but 4, at least half, at most 16)")


# ------------------------------------------------------------------------------------------------ the store


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
    detail = _one_line(getattr(exc, "orig", None) or exc)
    if path is not None:
        fix = (f"check that {path} is a SQLite file you can read and write, in a folder you can write, or point "
               f"--database-url / {env_name('database_url')} elsewhere")
    else:
        fix = (f"check that the database server is up and that --database-url / {env_name('database_url')} "
               "(host, credentials, database name) is right")
    return Failure(f"cannot use {where}: {detail}", fix, ExitCode.DATABASE)


#: How long a command waits for a schema that is missing or behind (a ``plancache serve`` starting beside it
#: migrates it) before it says to run ``plancache db upgrade``.
SCHEMA_WAIT_SECONDS = 5.0
#: How long a store command waits for a SQLite file that is not there to appear (a serve starting with it).
SQLITE_FILE_WAIT_SECONDS = 1.0


def _open_when_migrated(url: str, create: bool, check_blobs: bool, settings: StoreSettings) -> Store:
    from ..store import open_store

    sqlite_file = database_place(url)[1]
    if not create and sqlite_file is not None and not os.path.exists(sqlite_file):
        # a `plancache serve` started with this command creates the file first thing (serve_cmds.claim_sqlite_file);
        # with no file after a moment, nothing is starting: say so now rather than wait for a schema
        appears = time.monotonic() + SQLITE_FILE_WAIT_SECONDS
        while not os.path.exists(sqlite_file) and time.monotonic() < appears:
            time.sleep(0.05)
    missing = sqlite_file is not None and not os.path.exists(sqlite_file)
    deadline = time.monotonic() + (0.0 if create or missing else SCHEMA_WAIT_SECONDS)
    told = False
    while True:
        try:
            return open_store(url, create=create, check_blobs=check_blobs, blob_store=settings.blob_store,
                              job_max_attempts=settings.job_max_attempts)
        except SchemaNotReady as exc:
            if isinstance(exc, SchemaTooNew) or time.monotonic() >= deadline:
                raise
            if not told:
                print(f"waiting up to {SCHEMA_WAIT_SECONDS:.0f} s for the database schema (a `plancache serve` "
                      "starting now migrates it)", file=sys.stderr)
                told = True
            time.sleep(0.2)


@contextlib.contextmanager
def open_database(url: str | None = None, *, create: bool = False, check_blobs: bool = True,
                  settings: StoreSettings | None = None) -> Iterator[Store]:
    """The store at ``url`` (default: the settings' database URL), on the settings' blob store; ``create``
    migrates the schema to head first. Failures name the database and say what to do."""
    settings = settings or StoreSettings()
    url = url or settings.database_url
    import sqlalchemy as sa  # the server extra: without it, MISSING_EXTRA

    from ..store.blobs import open_blob_store

    try:
        open_blob_store(settings.blob_store)  # the setting is named when wrong, before the database is (nothing sent)
    except ValueError as exc:
        raise Failure(f"{env_name('blob_store')}: {_one_line(exc)}",
                      f"set {env_name('blob_store')} to 'database', file:///absolute/path or s3://bucket/prefix "
                      "(docs/DEPLOYMENT.md)",
                      ExitCode.CONFIG) from None
    except OSError as exc:  # a folder that cannot be created
        raise Failure(f"{env_name('blob_store')}={settings.blob_store}: {describe_os_error(exc)}",
                      f"create that folder, or point {env_name('blob_store')} at one you can write",
                      ExitCode.OS_ERROR) from None
    try:
        store = _open_when_migrated(url, create, check_blobs, settings)
    except PlanCacheError:
        raise
    except (ValueError, sa.exc.ArgumentError) as exc:  # an unsupported or unparseable URL
        raise Failure(f"database URL: {_one_line(exc)}",
                      f"set --database-url / {env_name('database_url')} to sqlite:///PATH or postgresql+psycopg://…",
                      ExitCode.CONFIG) from None
    except OSError as exc:  # the SQLite file's folder cannot be created
        where, _ = database_place(url)
        raise Failure(f"cannot create the folder of {where}: {describe_os_error(exc)}",
                      f"create that folder, or point --database-url / {env_name('database_url')} at a place you "
                      "can write", ExitCode.DATABASE) from None
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    try:
        yield store
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    finally:
        store.close()


# ------------------------------------------------------------------------------------------------ files


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN``: a device name, worker id or job error a worker sent
    never reaches a terminal as an escape sequence (a title set, a screen cleared) or a line break."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def plain_console(width: int | None = None) -> Console:
    """A rich console that prints text verbatim: names, worker ids and file names are data, never markup or emoji
    codes (a token named ``ci [/bold] team`` made every listing fail)."""
    from rich.console import Console

    return Console(width=width, markup=False, emoji=False, highlight=False)


def writable_folder(path: Path, what: str, fix: str) -> Path:
    """``path``, created if needed and checked writable (by writing a file), else an OS_ERROR failure."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise Failure(f"cannot write {what} {path}: {exc.strerror or exc}", fix, ExitCode.OS_ERROR) from None
    return path


def _unreadable(path: Path, what: str, exc: OSError) -> Failure:
    return Failure(f"cannot read the {what} {path}: {exc.strerror or exc}",
                   "check the path (spec files are GraphSpec JSON, e.g. examples/*.json)", ExitCode.OS_ERROR)


def read_spec_file(path: Path, limit: int = DEFAULT_MAX_JSON_BYTES, what: str = "spec file") -> bytes:
    """The bytes of a spec file (or of a ``what`` that may be one), at most ``limit``; a problem names the file."""
    try:
        return read_limited(path, limit)
    except OSError as exc:
        raise _unreadable(path, what, exc) from None


def load_spec_file(path: Path, data: bytes | None = None) -> GraphSpec:
    """Read (unless its bytes are given) and validate a spec file; a problem names the file."""
    from ..spec import parse_spec

    if data is None:
        data = read_spec_file(path)
    elif len(data) > DEFAULT_MAX_JSON_BYTES:  # read under a larger limit (enqueue's, for a capture file)
        raise _unreadable(path, "spec file", too_large(path, len(data), DEFAULT_MAX_JSON_BYTES))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Failure(f"{path} is not a GraphSpec JSON file (not UTF-8 text)",
                      "give a GraphSpec JSON document (docs/SPEC.md), e.g. examples/conv_bias_relu.json",
                      ExitCode.USAGE) from None
    try:
        return parse_spec(text)
    except PlanCacheError as exc:
        raise Failure(f"{path}: {exc.message}", "fix the spec (docs/SPEC.md)", ExitCode.FAILED) from None


def load_environment(value: str, option: str) -> Environment:
    """An :class:`Environment` from inline JSON (``{...}``) or a JSON file."""
    from pydantic import ValidationError

    from ..environment import Environment
    from ..validation import validation_message

    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = read_limited(value, DEFAULT_MAX_JSON_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Failure(f"{option} {value}: cannot read the environment file: {getattr(exc, 'strerror', None) or exc}",
                          f"give {option} an environment JSON file or inline JSON", ExitCode.USAGE) from None
    try:
        return Environment.model_validate_json(text)
    except ValidationError as exc:
        raise Failure(f"{option} {value[:80]}: not an environment ({validation_message(exc.errors(), 1)})",
                      "give the environment JSON of a plan record (`plancache plans list --json`, its "
                      "\"environment\")", ExitCode.USAGE) from None


def load_signer(path: Path, option: str = "--signing-key") -> Signer:
    """The ed25519 signer in ``path``; a missing or bad key file names the path and the setting."""
    from ..signing import Signer

    variable = env_name("signing_key")
    try:
        return Signer.from_file(path)
    except OSError as exc:
        raise Failure(f"cannot read the signing key {path}: {exc.strerror or exc}",
                      f"check {option} / {variable}, or create a key pair with `plancache keygen`",
                      ExitCode.OS_ERROR) from None
    except SignatureError as exc:
        raise Failure(exc.message, f"give {option} / {variable} the NAME.key file `plancache keygen` wrote",
                      ExitCode.FAILED) from None


def load_trusted_keys(value: str | None, option: str = "--trusted-keys") -> TrustedKeys:
    """The public keys ``value`` names (files or folders of ``*.pub``, ``,`` or ``:`` separated; None: none);
    an unreadable one, one that is no ed25519 public key, or a folder that holds none, is a :class:`Failure` naming
    the option and the setting."""
    from ..signing import TrustedKeys

    variable = env_name("trusted_keys")
    try:
        return TrustedKeys.from_setting(value)
    except OSError as exc:
        raise Failure(f"cannot read the trusted keys {value!r}: {exc.strerror or exc} ({exc.filename})",
                      f"check {option} / {variable}", ExitCode.OS_ERROR) from None
    except SignatureError as exc:
        raise Failure(f"{option}: {exc.message}", f"check {option} / {variable}", ExitCode.FAILED) from None


# ------------------------------------------------------------------------------------------------ the server


def http_client(server_url: str, token: str | None, *, connect_timeout: float, read_timeout: float,
                policies: Sequence[Policy] = (), agent: Agent = "cli") -> HttpClient:
    """An HTTP client of ``server_url`` calling as ``agent``; a URL it refuses is a configuration failure naming
    ``--server``."""
    from ..http import HttpClient

    if token is not None and not (token.isascii() and token.isprintable()):
        raise Failure("the token has characters an HTTP header cannot carry (not printable ASCII)",
                      f"check --token / {env_name('token')} / {env_name('admin_token')} (copy it again from "
                      "`plancache token create`)", ExitCode.CONFIG)
    try:
        return HttpClient(server_url, token, agent=agent, policies=policies, connect_timeout=connect_timeout,
                          read_timeout=read_timeout)
    except ValueError as exc:
        raise Failure(f"--server {server_url}: {exc}",
                      f"give --server / {env_name('server_url')} as http(s)://HOST:PORT", ExitCode.CONFIG) from None


#: What to do when an admin command has no admin token.
GIVE_ADMIN_TOKEN = (f"give --token or set {env_name('admin_token')} to an admin token (the server's bootstrap "
                    "token, or one from `plancache token create --role admin`)")


def open_jobs_api(server_url: str, token: str | None, connection: ConnectionSettings, *, retry: Retry,
                  agent: Agent = "cli") -> JobsApi:
    """The job and admin calls to ``server_url`` as ``agent``, with ``connection``'s connect timeout and ``retry``."""
    from ..worker.jobs_api import READ_TIMEOUT, JobsApi

    return JobsApi(http_client(server_url, token, connect_timeout=connection.connect_timeout,
                               read_timeout=READ_TIMEOUT, policies=[retry], agent=agent))


def pick_token(token: str | None, *, admin: bool) -> str | None:
    """The token a command sends: ``token`` (``--token``), else for an admin command ``PLANCACHE_ADMIN_TOKEN`` then
    ``PLANCACHE_TOKEN``, for a reader's ``PLANCACHE_TOKEN`` then ``PLANCACHE_ADMIN_TOKEN`` (an admin may read too)."""
    if token:
        return token
    settings = settings_module.AdminSettings()
    order = (settings.admin_token, settings.token) if admin else (settings.token, settings.admin_token)
    return next((t for t in order if t), None)


def admin_token_option(help: str = "admin token") -> Any:
    return typer.Option(None, "--token", show_default=False,
                        help=f"{help} (default: PLANCACHE_ADMIN_TOKEN, else PLANCACHE_TOKEN)")


def open_admin_api(server: str | None, token: str | None, command_name: str, *, server_use: str = "to ask",
                   within: float = 5.0) -> JobsApi:
    """The admin calls of ``plancache COMMAND_NAME`` to ``server`` (default: the settings'), with ``token`` (default:
    the admin token, else the token of the settings), retried ``within`` seconds; ``server_use`` says in the error
    what the server was wanted for."""
    from ..http import Backoff, Retry

    settings = settings_module.AdminSettings()
    server = required(server or settings.server_url, f"{command_name} has no server {server_use}",
                      f"give --server URL or set {env_name('server_url')}")
    token = required(pick_token(token, admin=True), f"{command_name} needs an admin token, and "
                     "none was given", GIVE_ADMIN_TOKEN, ExitCode.AUTH)
    return open_jobs_api(server, token, settings, retry=Retry(Backoff(initial=0.2, cap=2.0), within=within))


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """Hold back the HTTP layer's 'retrying in …' warnings (an interactive command reports the outcome once)."""
    logger = logging.getLogger("plancache.http")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
