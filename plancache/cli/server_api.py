"""A command's calls to a plancache server: its HTTP client, the job and admin calls with the token an admin
command sends, and the HTTP layer's retry warnings held back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from .. import settings as settings_module
from ..settings import ConnectionSettings, env_name
from .failures import ExitCode, Failure, required

if TYPE_CHECKING:
    from ..http import Agent, HttpClient, Policy, Retry
    from ..worker import JobsApi


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
