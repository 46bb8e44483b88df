"""Configuration from ``PLANCACHE_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "plancache"


class Settings(BaseSettings):
    """All knobs of server, worker and client. Each is ``PLANCACHE_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="PLANCACHE_", extra="ignore")

    # store / server
    database_url: str = "sqlite:///./plancache.db"
    blob_store: str = "database"  # or file:///path (plancache.store.blobs)
    admin_token: str | None = Field(default=None, repr=False)
    open_reads: bool = False
    max_blob_bytes: int = 64 * 1024 * 1024
    max_request_bytes: int = 96 * 1024 * 1024
    max_resolve_keys: int = 1000
    lease_seconds: float = 120.0
    job_max_attempts: int = 3

    # worker / client
    server_url: str | None = None
    token: str | None = Field(default=None, repr=False)
    signing_key: Path | None = None
    trusted_keys: str | None = None
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    connect_timeout: float = 1.0
    read_timeout: float = 5.0

    # client only
    insecure_allow_unsigned: bool = False  # without trusted keys, admit plans checked by digest alone (normal mode)
    request_deadline: float = 5.0  # seconds: the whole server exchange of one plan()/prefetch()
    resolve_max_bytes: int = 256 * 1024 * 1024  # the largest resolve answer read (see README, Configuration)
    cache_max_bytes: int = 2 * 1024 * 1024 * 1024  # disk cache size cap, LRU eviction; 0: no cap
    cache_max_age_days: float = 30.0  # other environments' cache folders unused this long are dropped; 0: never


def get_settings() -> Settings:
    """Read the settings now (never cached at import time)."""
    return Settings()
