"""SQLAlchemy Core tables of the store. The Alembic migrations in ``migrations/`` must match these exactly
(``tests/integration/test_migrations.py`` runs ``alembic check``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, get_args

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from ..environment import INFO_FIELDS, VALIDITY_FIELDS, Environment
from ..protocol import ACTIVE_JOB_STATUSES, FINISHED_JOB_STATUSES, JOB_STATUSES, JobSource

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

JOB_SOURCES: tuple[str, ...] = get_args(JobSource)


def status_in(statuses: tuple[str, ...]) -> str:
    """The SQL condition ``status IN ('a', 'b')`` of a CHECK constraint or a partial index."""
    return f"status IN ({', '.join(repr(s) for s in statuses)})"


#: The partial indexes' WHERE over active jobs (a claim's query repeats it word for word, to use them).
ACTIVE_JOBS = status_in(ACTIVE_JOB_STATUSES)
FINISHED_JOBS = status_in(FINISHED_JOB_STATUSES)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite keeps no offset: values are stored as UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store only takes timezone-aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _env_columns(names: tuple[str, ...], *, nullable: bool = False) -> list[sa.Column[Any]]:
    """Columns of these :class:`Environment` fields, typed from the model: an integer as INTEGER (each one's bounds
    fit 32 bits), a string as VARCHAR of its ``max_length``. A job's target stores NULL for "any"."""
    columns = []
    for name in names:
        field = Environment.model_fields[name]
        if field.annotation is int:
            column_type: sa.types.TypeEngine[Any] = sa.Integer()
        else:
            (length,) = (n for m in field.metadata if (n := getattr(m, "max_length", None)))
            column_type = sa.String(length)
        columns.append(sa.Column(name, column_type, nullable=nullable))
    return columns


specs = sa.Table(
    "specs",
    metadata,
    sa.Column("graph_key", sa.String(64), primary_key=True),
    sa.Column("canonical_json", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

blobs = sa.Table(
    "blobs",
    metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    # The bytes with the database blob store; empty when another blob store holds them (store/blobs.py).
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("graph_key", sa.String(64), sa.ForeignKey("specs.graph_key"), nullable=False),
    *_env_columns(VALIDITY_FIELDS, nullable=True),
    # Canonical JSON of the target (NULLs included): the de-duplication key, since NULL never equals NULL.
    sa.Column("target_key", sa.String(256), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("lease_owner", sa.String(256)),
    sa.Column("lease_expires_at", UTCDateTime),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),  # leases granted so far (never a credential)
    # The current lease's secret token (store/jobs.py) as its sha256 hex digest, and the API token that claimed it.
    sa.Column("lease_token_hash", sa.String(64)),
    sa.Column("lease_holder", sa.String(64)),
    sa.Column("error", sa.Text),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.Column("finished_at", UTCDateTime),
    sa.Column("source", sa.String(16), nullable=False, server_default="admin"),
    sa.CheckConstraint(status_in(JOB_STATUSES), name="status"),
    sa.CheckConstraint("max_attempts >= 1", name="max_attempts"),
    sa.CheckConstraint(f"source IN ({', '.join(repr(s) for s in JOB_SOURCES)})", name="source"),
    sa.Index("ix_jobs_source_target", "source", "target_key", "created_at"),
    # explain: the newest job of a key for an environment
    sa.Index("ix_jobs_graph_key_target_key_id", "graph_key", "target_key", "id"),
    # A claim's two lookups (store/jobs.py): the active jobs of the 32 target keys an environment matches (the active
    # jobs' unique index, led by the target key), and the running jobs (whose leases may have expired). No other index
    # of active jobs, and none led by ``status``: a planner without statistics would take one for the claim's lookup
    # and read every environment's queue.
    sa.Index("ix_jobs_running", "lease_token_hash", sqlite_where=sa.text("status = 'running'"),
             postgresql_where=sa.text("status = 'running'")),
    # The ended jobs of a status, newest first (GET /v1/jobs?status=): an index that no claim can use.
    sa.Index("ix_jobs_finished", "status", "id", sqlite_where=sa.text(FINISHED_JOBS),
             postgresql_where=sa.text(FINISHED_JOBS)),
    sa.Index(
        "uq_jobs_active_target",
        "target_key",
        "graph_key",
        unique=True,
        sqlite_where=sa.text(ACTIVE_JOBS),
        postgresql_where=sa.text(ACTIVE_JOBS),
    ),
)

# How many jobs ended in each final status (FINISHED_JOB_STATUSES, one row each), kept by every transaction that ends
# or deletes jobs (store/jobs.py, tally_finished): /ui and /metrics read them instead of counting history.
job_tallies = sa.Table(
    "job_tallies",
    metadata,
    sa.Column("status", sa.String(16), primary_key=True),
    sa.Column("count", sa.BigInteger, nullable=False),
)

plans = sa.Table(
    "plans",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("graph_key", sa.String(64), sa.ForeignKey("specs.graph_key"), nullable=False, index=True),
    sa.Column("env_id", sa.String(32), nullable=False),
    *_env_columns(VALIDITY_FIELDS),
    *_env_columns(INFO_FIELDS),
    sa.Column("blob_sha256", sa.String(64), sa.ForeignKey("blobs.sha256"), nullable=False, index=True),
    sa.Column("blob_size", sa.BigInteger, nullable=False),
    sa.Column("envelope", sa.JSON(none_as_null=True)),  # the DSSE envelope signing the record (plancache.signing); null: unsigned
    sa.Column("revision", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("engine_id", sa.BigInteger, nullable=False),
    sa.Column("knobs", sa.JSON, nullable=False),
    sa.Column("plan_name", sa.String(512), nullable=False),
    sa.Column("workspace_bytes", sa.BigInteger, nullable=False),
    sa.Column("winner_median_ms", sa.Float, nullable=False),
    sa.Column("heuristic_median_ms", sa.Float),
    sa.Column("worst_median_ms", sa.Float),
    # {kernel: median ms} of torch's native attention kernels (protocol.NATIVE_KERNELS); null: none timed
    sa.Column("native_median_ms", sa.JSON(none_as_null=True)),
    sa.Column("tuning_seconds", sa.Float, nullable=False),
    sa.Column("worker_id", sa.String(256), nullable=False),
    sa.Column("numerics_check", sa.String(32), nullable=False, server_default="reference"),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), index=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    # the spec's plancache.spec.axes.sibling_key (its other shapes share it); null: none, or published by a release
    # before 0013
    sa.Column("sibling_key", sa.String(64)),
    # No index on a validity field (env_id is their digest): a planner without statistics would take one for
    # resolve's lookup by graph keys and read every plan of the SM (store/environments.py, by_keys).
    sa.UniqueConstraint("graph_key", "env_id"),
    sa.Index("ix_plans_created_at", "created_at", "id"),  # the newest records first (/ui, plans list)
    sa.Index("ix_plans_env_id_created_at", "env_id", "created_at", "id"),  # an environment's, newest first
    sa.Index("ix_plans_env_id_sibling_key", "env_id", "sibling_key", "created_at", "id"),  # a graph's siblings
)

# The candidates table of the tuning run of a plan record (protocol.CandidateTable, bounded), apart from the record:
# resolve never reads it. Replaced with its record; gone with it (withdrawal, gc).
plan_candidates = sa.Table(
    "plan_candidates",
    metadata,
    sa.Column("plan_id", sa.Integer, sa.ForeignKey("plans.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("candidates", sa.JSON, nullable=False),
    sa.Column("omitted", sa.JSON, nullable=False),  # {status: count} of the candidates not kept
)

withdrawals = sa.Table(
    "withdrawals",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("graph_key", sa.String(64), sa.ForeignKey("specs.graph_key"), nullable=False, index=True),
    sa.Column("env_id", sa.String(32), nullable=False, index=True),
    *_env_columns(VALIDITY_FIELDS),
    *_env_columns(INFO_FIELDS),
    sa.Column("blob_sha256", sa.String(64), nullable=False),  # the withdrawn plan's (its blob is left to gc)
    sa.Column("withdrawn_revision", sa.BigInteger, nullable=False),
    sa.Column("revision", sa.BigInteger, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("envelope", sa.JSON, nullable=False),  # the DSSE envelope signing the withdrawal (plancache.signing)
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.UniqueConstraint("graph_key", "env_id"),
)

misses = sa.Table(
    "misses",
    metadata,
    sa.Column("graph_key", sa.String(64), primary_key=True),
    sa.Column("env_id", sa.String(32), primary_key=True),
    *_env_columns(VALIDITY_FIELDS),
    *_env_columns(INFO_FIELDS),
    sa.Column("count", sa.BigInteger, nullable=False),
    sa.Column("first_seen", UTCDateTime, nullable=False),
    sa.Column("last_seen", UTCDateTime, nullable=False),
    sa.Index("ix_misses_env_count", "env_id", "count"),
    sa.Index("ix_misses_count", "count", "last_seen"),  # the most missed first (/ui, GET /v1/misses)
)

# Who counted a miss: one row per caller (a token, or an anonymous address), client process and key on an
# environment whose miss raised the key's count (store/misses.py), both hashed; ``shared`` when it took one of the
# caller's hourly share of keys. Rows a week old count no more and are deleted (autotune step, ``plans gc``).
miss_callers = sa.Table(
    "miss_callers",
    metadata,
    sa.Column("env_id", sa.String(32), primary_key=True),
    sa.Column("caller", sa.String(32), primary_key=True),
    sa.Column("graph_key", sa.String(64), primary_key=True),
    sa.Column("process", sa.String(32), primary_key=True),
    sa.Column("counted_at", UTCDateTime, nullable=False),
    sa.Column("shared", sa.Boolean, nullable=False),
    sa.Index("ix_miss_callers_share", "caller", "shared", "counted_at"),  # a caller's share used this hour
    sa.Index("ix_miss_callers_counted_at", "counted_at"),  # retention
)

# The environments workers claim for: one row per environment, the time of its last claim (a job handed out or
# not). The autotune policy enqueues only for environments claimed within its window (store/autotune.py).
worker_environments = sa.Table(
    "worker_environments",
    metadata,
    sa.Column("env_id", sa.String(32), primary_key=True),
    *_env_columns(VALIDITY_FIELDS),
    sa.Column("last_claim_at", UTCDateTime, nullable=False),
)

api_tokens = sa.Table(
    "api_tokens",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("revoked_at", UTCDateTime),
    sa.Column("expires_at", UTCDateTime),  # null: never
    sa.CheckConstraint("role IN ('reader', 'worker', 'admin')", name="role"),
    sa.Index(
        "uq_api_tokens_active_name",
        "name",
        unique=True,
        sqlite_where=sa.text("revoked_at IS NULL"),
        postgresql_where=sa.text("revoked_at IS NULL"),
    ),
)

# Which schema revisions' code may run on this database (store/db.py, docs/DEPLOYMENT.md "Rolling back"): one row,
# written by each migration run, for the revision it migrated to.
schema_compatibility = sa.Table(
    "schema_compatibility",
    metadata,
    sa.Column("revision", sa.String(32), primary_key=True),
    sa.Column("compatible_from", sa.String(32), nullable=False),
)
