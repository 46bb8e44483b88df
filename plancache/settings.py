"""Configuration from ``PLANCACHE_*`` environment variables (pydantic-settings), grouped by the role that reads it.

Each variable is ``PLANCACHE_<FIELD>`` and is declared once, in the section of the role that reads it. A process
reads the classes of its role only, so a bad value of a variable that another role reads does not stop it.

Sections (one concern each):

- :class:`StoreSettings`: where the store is (``DATABASE_URL``, ``BLOB_STORE``, ``JOB_MAX_ATTEMPTS``); the server
  and the commands that open the database (``db``, ``token``, ``plans``, ``bundle``).
- :class:`AdminTokenSettings`: ``ADMIN_TOKEN``; the server accepts it, admin commands send it.
- :class:`ConnectionSettings`: how to reach a server (``SERVER_URL``, ``TOKEN``, ``CONNECT_TIMEOUT``, ``READ_TIMEOUT``).
- :class:`CacheSettings`: ``CACHE_DIR`` (the client's plan cache, the worker's upload spool).
- :class:`BlobLimitSettings`: ``MAX_BLOB_BYTES``, the largest plan blob: the server takes none larger, the client
  reads none larger.
- :class:`SigningSettings`: ``SIGNING_KEY`` (worker, ``tune``, ``bundle export``).
- :class:`TrustSettings`: ``TRUSTED_KEYS`` (client, ``bundle import``, the server's check of withdrawals).

Roles (what one kind of process reads):

- :class:`ServerSettings` (``plancache serve``, ``create_app``): Store + AdminToken + BlobLimit + Trust + the limits
  of the HTTP service.
- :class:`WorkerSettings` (``plancache worker``, ``tune``): Connection + Cache + Signing.
- :class:`ClientSettings` (the client library, ``PlanCache``): Connection + Cache + Trust + BlobLimit + the client's
  own knobs.
- :class:`AdminSettings` (``enqueue``, ``tune --server``): Connection + AdminToken.
- :class:`Settings`: every knob of every role, for code that documents or tests them all.

A new setting goes into the section of the role that reads it (every class that includes that section gets it).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PLANCACHE_"


#: Seconds one candidate build may take in a builder process (``PLANCACHE_BUILD_TIMEOUT``). The slowest graph of the
#: tuning benchmark (bench/results/tuning.json, mlp_h2048_up_gelu) built its 11 candidates in 16.9 s together, so
#: no single build there took longer; 120 s is 7 times that whole graph, 78 times its mean build (1.5 s).
DEFAULT_BUILD_TIMEOUT = 120.0
#: Seconds of wall clock one job may take on a worker before it is failed and released (``PLANCACHE_JOB_TIMEOUT``):
#: 100 times the slowest whole tuning of the benchmark (17.5 s, one process) and 15 build timeouts.
DEFAULT_JOB_TIMEOUT = 1800.0


def env_name(field: str) -> str:
    """The environment variable of a settings field: ``open_reads`` → ``PLANCACHE_OPEN_READS``."""
    return f"{ENV_PREFIX}{field.upper()}"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "plancache"


#: ``PLANCACHE_*`` names that are no setting but have a use: docker/compose.yaml's own variables. (The tests'
#: ``PLANCACHE_TEST_*`` are left alone too.)
OTHER_VARIABLES = frozenset({"PLANCACHE_PORT", "PLANCACHE_SIGNING_KEY_FILE", "PLANCACHE_WORKER_TOKEN"})

log = logging.getLogger("plancache")
_warned: set[str] = set()


def unknown_variables(environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """Each ``PLANCACHE_*`` variable of ``environ`` that names no setting, with the setting whose name is closest
    (None when none is close): a mistyped name is otherwise ignored without a word."""
    fields = [field.upper() for field in Settings.model_fields]
    found: dict[str, str | None] = {}
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings reads names in any case
        if not upper.startswith(ENV_PREFIX) or upper in OTHER_VARIABLES or upper.startswith(f"{ENV_PREFIX}TEST_"):
            continue
        field = upper.removeprefix(ENV_PREFIX)
        if field not in fields:
            found[name] = next((env_name(f) for f in difflib.get_close_matches(field, fields, n=1, cutoff=0.7)), None)
    return found


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """Log a warning, once per process, for each variable :func:`unknown_variables` finds."""
    for name, closest in unknown_variables(environ).items():
        if name not in _warned:
            _warned.add(name)
            hint = f"did you mean {closest}?" if closest else "the settings are listed in docs/CONFIGURATION.md"
            log.warning("warning: %s is not a plancache setting and is ignored: %s", name, hint)


class _Section(BaseSettings):
    # each class's validator is built when it is first instantiated: a process builds those of its role only (a
    # client ClientSettings alone, not the 12 others: 3 ms of its start-up after ``import torch``)
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", defer_build=True)

    def model_post_init(self, context: object, /) -> None:
        warn_unknown_variables()  # every role reads its settings through a section: one place sees every process


# ------------------------------------------------------------------------------------------------ sections


class StoreSettings(_Section):
    """Where the store is: read by the server and by the commands that open the database themselves."""

    database_url: str = "sqlite:///./plancache.db"
    blob_store: str = "database"  # or file:///path, s3://bucket/prefix (plancache.store.blobs)
    job_max_attempts: int = Field(default=3, ge=1, le=100)  # TuneRequest.max_attempts' range


#: The shortest bootstrap admin token accepted: a guessable one would hand out the admin role.
MIN_ADMIN_TOKEN_LENGTH = 16
#: What the example files (deploy/, docker/env.example) put where a secret goes: a token containing it is one
#: applied unedited, the same in every copy of the example, so it is refused like a short one.
PLACEHOLDER = "REPLACE"


class AdminTokenSettings(_Section):
    """The bootstrap admin token: the server accepts it, admin commands send it."""

    admin_token: str | None = Field(default=None, repr=False)

    @field_validator("admin_token")
    @classmethod
    def _long_enough(cls, value: str | None) -> str | None:
        if value is not None and len(value) < MIN_ADMIN_TOKEN_LENGTH:
            raise ValueError(f"is {len(value)} characters; use at least {MIN_ADMIN_TOKEN_LENGTH}, e.g. "
                             "python -c 'import secrets; print(secrets.token_urlsafe(24))'")
        if value is not None and PLACEHOLDER in value.upper():
            raise ValueError(f"is the placeholder of an example file (it contains {PLACEHOLDER}): anyone who read "
                             "the example would hold the admin role; set a random one, e.g. "
                             "python -c 'import secrets; print(secrets.token_urlsafe(24))'")
        # the server compares it with what follows 'Bearer ' in a header, which is printable ASCII with no space at
        # either end: a token with a newline (a secret file's), a surrounding space or a non-ASCII character never matches
        if value is not None and not (value.isascii() and value.isprintable() and value == value.strip()):
            raise ValueError("has characters an HTTP header cannot carry (not printable ASCII) or spaces at either "
                             "end (a secret file's trailing newline?): no request could present it")
        return value


#: The default body limit of a JSON request (``PLANCACHE_MAX_JSON_BYTES``), sized for a spec (a maximal document is
#: about 770 KB indented, docs/SPEC.md "Limits"); also the largest spec or environment file the CLI reads.
DEFAULT_MAX_JSON_BYTES = 1024 * 1024


class BlobLimitSettings(_Section):
    """The largest plan blob: the server refuses larger uploads, the client never reads a larger download."""

    max_blob_bytes: int = Field(default=64 * 1024 * 1024, ge=1)


class TrustSettings(_Section):
    """The public keys a plan, bundle or withdrawal must be signed by (client, ``bundle import``; the server stores
    no withdrawal that none of them signed)."""

    trusted_keys: str | None = None


class LogSettings(_Section):
    """How ``serve`` and ``worker`` log: plain lines, or one JSON object per line (:mod:`plancache.logs`)."""

    log_format: Literal["text", "json"] = "text"


class ServerSettings(StoreSettings, AdminTokenSettings, TrustSettings, BlobLimitSettings, LogSettings):
    """``plancache serve`` and :func:`plancache.server.create_app`."""

    open_reads: bool = False
    max_request_bytes: int = 96 * 1024 * 1024
    max_resolve_keys: int = 1000
    lease_seconds: float = Field(default=120.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    # request limits (plancache.server.bodies, .limits, .serving; docs/DEPLOYMENT.md "Request limits")
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES  # body limit of every JSON body, plan uploads too (a record: the blob goes raw)
    max_inflight_bytes: int = 512 * 1024 * 1024  # memory of request bodies and answers in flight, per process
    # a request over max_inflight_bytes waits this long, then 503
    inflight_wait_seconds: float = Field(default=2.0, ge=0, le=3600, allow_inf_nan=False)
    body_parse_threads: int = 1  # threads that parse and validate request bodies at once (per process)
    # seconds from connect (or the last answer) to a complete request head
    header_timeout: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)
    # seconds to receive a body, plus its size / body_min_rate
    body_timeout: float = Field(default=15.0, gt=0, le=86400, allow_inf_nan=False)
    body_min_rate: int = 1024 * 1024  # bytes per second
    # seconds an idle keep-alive connection stays open: above a worker's default poll interval (5 s), so its idle
    # polls reuse their connection, and within header_timeout, which also ends an idle connection
    keep_alive_timeout: int = 8
    # POST /v1/specs per non-admin token and process, after the burst
    spec_writes_per_minute: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    spec_write_burst: int = 300
    # miss rows recorded per token and process, after the burst
    misses_per_minute: float = Field(default=6000.0, gt=0, allow_inf_nan=False)
    miss_burst: int = 20000
    blob_memory_bytes: int = Field(default=256 * 1024 * 1024, ge=0)  # blob bytes kept in memory per process (LRU)
    token_cache_seconds: float = Field(default=5.0, ge=0, le=300)  # an authenticated token is not looked up again
    # blobs of an object store: resolve answers presigned GET URLs, valid this long (plancache.server.routes.plans)
    presign_blobs: bool = True
    presign_seconds: int = Field(default=300, ge=1, le=7 * 86400)
    # the autotune policy (plancache.store.autotune, plancache.server.autotune; docs/DEPLOYMENT.md "Autotune")
    autotune: bool = True  # enqueue often-missed keys for the environments workers serve, without a person
    autotune_min_misses: int = Field(default=3, ge=1, le=1_000_000)  # misses of a key on an environment before it is
    autotune_jobs_per_hour: int = Field(default=20, ge=0, le=100_000)  # auto jobs per environment and hour, all replicas
    autotune_worker_window: float = Field(default=3600.0, gt=0, le=30 * 86400)  # seconds: a worker claimed there within
    autotune_interval: float = Field(default=30.0, ge=1, le=86400)  # seconds between steps, per server process


class ConnectionSettings(_Section):
    """How a worker, a client or an admin command reaches the server."""

    server_url: str | None = None
    token: str | None = Field(default=None, repr=False)
    connect_timeout: float = Field(default=1.0, gt=0, le=86400, allow_inf_nan=False)
    read_timeout: float = Field(default=5.0, gt=0, le=86400, allow_inf_nan=False)


class CacheSettings(_Section):
    """The local folder of a client (plan cache) or worker (upload spool, ``worker-spool/`` in it)."""

    cache_dir: Path = Field(default_factory=_default_cache_dir)


class SigningSettings(_Section):
    """The ed25519 private key that signs plans (worker, ``tune``) and bundles (``bundle export``)."""

    signing_key: Path | None = None


# ------------------------------------------------------------------------------------------------ roles


class WorkerSettings(ConnectionSettings, CacheSettings, SigningSettings, LogSettings):
    """``plancache worker`` and ``plancache tune``."""

    build_processes: int | None = Field(default=None, ge=0, le=256)  # None: gpu.candidates.default_processes()
    build_timeout: float = Field(default=DEFAULT_BUILD_TIMEOUT, gt=0, le=86400)  # seconds per candidate build
    job_timeout: float = Field(default=DEFAULT_JOB_TIMEOUT, gt=0, le=7 * 86400)  # seconds of wall clock per job
    # touched at every turn of the worker's loop and every lease heartbeat: a liveness probe checks its age
    alive_file: Path | None = None


class ClientSettings(ConnectionSettings, CacheSettings, TrustSettings, BlobLimitSettings):
    """The client library (:class:`plancache.client.PlanCache`)."""

    insecure_allow_unsigned: bool = False  # without trusted keys, admit plans checked by digest alone (normal mode)
    # with an https server, also GET blobs from plain-http presigned URLs (clear text; else the server's route serves them)
    insecure_allow_http_presigned: bool = False
    # seconds: the whole server exchange of one plan()/prefetch()
    request_deadline: float = Field(default=5.0, gt=0, le=86400, allow_inf_nan=False)
    resolve_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)  # the largest resolve answer read (docs/CONFIGURATION.md)
    cache_max_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=0)  # disk cache size cap, LRU eviction; 0: no cap
    # other environments' cache folders unused this long are dropped; 0: never
    cache_max_age_days: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    capture: Path | None = None  # the hook counts every graph built into this capture file (plancache capture)
    warm: Path | None = None  # the hook fetches the plans of every graph of this capture file at install
    # the hook refuses a served plan needing more workspace bytes (FE builds that graph itself); 0: no cap
    hook_max_workspace_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)
    # what runs torch's cuDNN attention per configuration (plancache.client.sdpa.CHOICES)
    attention: Literal["fastest", "plan", "flash", "cudnn_aten"] = "fastest"
    # the attention route's steady path in C++ (plancache.client.sdpa_ext): auto (where built; else built in the
    # background for the next processes), true (built now), false (Python only)
    attention_cpp: Literal["auto"] | bool = "auto"
    # the C++ steady path replays a call's captured launches where its buffers sit at an earlier call's addresses
    attention_replay: bool = True
    # a plan loaded from disk that the server last confirmed longer ago is asked about again in the background
    revalidate_seconds: float = Field(default=3600.0, ge=0)
    # plans of other shapes of the graphs loaded (attention at other batch sizes and sequence lengths) fetched ahead
    # in the background, at most this many per graph; 0: never (plancache.client.siblings)
    prefetch_siblings: int = Field(default=16, ge=0, le=64)
    index_url: str | None = None  # a published static index (plancache index publish) read before the server
    index_sets: str | None = None  # names of the index's sets (publish --set) read first, separated by ","


class AdminSettings(ConnectionSettings, AdminTokenSettings):
    """Admin commands that talk to a server (``plancache enqueue``, ``plancache tune --server``)."""


class Settings(ServerSettings, WorkerSettings, ClientSettings, AdminSettings):
    """Every knob of every role, for code that documents or tests them all. Add a new setting to its role's section
    above, not here."""

