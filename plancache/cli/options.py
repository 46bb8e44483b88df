"""The ``typer`` options several commands share. An option left out takes its value from the settings class of
the command's role (:mod:`plancache.settings`), never from a second reading of the environment."""

from __future__ import annotations

from typing import Any

import typer

from ..settings import env_name

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


def admin_token_option(help: str = "admin token") -> Any:
    return typer.Option(None, "--token", show_default=False,
                        help=f"{help} (default: PLANCACHE_ADMIN_TOKEN, else PLANCACHE_TOKEN)")
