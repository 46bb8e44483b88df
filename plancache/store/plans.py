"""Plan records: publishing (blob + record + job completion in one transaction), lookup, resolve and withdrawal.
Blob bytes go through the store's :class:`~.blobs.CatalogBlobs`, in the order :mod:`.blobs` explains."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .. import errors
from ..environment import Environment
from ..protocol import CandidateTable, PlanCandidates, PlanMeta, PlanRecord, Withdrawal, WithdrawalRecord
from ..spec.axes import stored_sibling_key
from ..validation import INT64_MAX
from ..verify import verify_blob
from .blobs import CatalogBlobs, ContentBlobs
from .content import hold_blob_row, insert_blob_row, spec_exists, write_blob
from .db import Database, check_int, check_page, equal_in_index_order, upsert_insert
from .environments import by_keys, check_validity, env_columns, env_from_row, key_params, same_env
from .jobs import complete_held_job, tally_completion
from .misses import Misses
from .models import plan_candidates, plans, specs, withdrawals

# PlanMeta fields stored in a column of the same name (the environment is spread over its own columns; the envelope
# and native timings are null when absent).
_META_COLUMNS = tuple(f for f in PlanMeta.model_fields if f not in ("environment", "envelope", "native_median_ms"))


def _record_values(meta: PlanMeta, job_id: int | None, now: datetime) -> dict[str, Any]:
    check_int("engine_id", meta.engine_id, INT64_MAX)
    check_int("workspace_bytes", meta.workspace_bytes, INT64_MAX)
    return {
        **{f: getattr(meta, f) for f in _META_COLUMNS},
        **env_columns(meta.environment),
        "envelope": None if meta.envelope is None else meta.envelope.model_dump(),
        "native_median_ms": meta.native_median_ms or None,
        "job_id": job_id,
        "created_at": now,
    }


class PlanVersion(NamedTuple):
    """What tells a stored plan record from every other record of its graph key and environment, read without the
    record: its row, revision, blob and write time (a publish, a replacement or a publish after a deletion changes
    at least one), and the blob's size. ``written`` is ``created_at`` as the database gives it, compared only."""

    graph_key: str
    env_id: str
    row_id: int
    revision: int
    blob_sha256: str
    blob_size: int
    written: Any


#: ``created_at`` as the database gives it (a version compares it, nothing converts it).
_WRITTEN = sa.type_coerce(plans.c.created_at, sa.String).label("written")


#: The versions and records of the plans, and the withdrawals, of some graph keys on one environment
#: (:func:`~.environments.by_keys`), by dialect: built once, so a resolve compiles nothing and converts no value but its
#: parameters.
_VERSIONS = {postgres: by_keys(plans, [plans.c.graph_key, plans.c.env_id, plans.c.id, plans.c.revision,
                                       plans.c.blob_sha256, plans.c.blob_size, _WRITTEN], postgres)
             for postgres in (False, True)}
_RECORDS = {postgres: by_keys(plans, [*plans.c, _WRITTEN], postgres) for postgres in (False, True)}
WITHDRAWALS_OF_KEYS = {postgres: by_keys(withdrawals, list(withdrawals.c), postgres) for postgres in (False, True)}


def _plan_list(conn: Connection, env_id: str | None, graph_key: str | None) -> sa.Select[Any]:
    """The records :meth:`Plans.list_plans` lists, newest first, read on ``conn``: those of one environment through
    the index that holds them in that order, not every record of the store newest first."""
    newest = (plans.c.created_at.desc(), plans.c.id.desc())
    if graph_key is not None:  # a key's records: one per environment (the unique index)
        q = sa.select(plans).where(plans.c.graph_key == graph_key).order_by(*newest)
        return q if env_id is None else q.where(plans.c.env_id == env_id)
    if env_id is None:
        return sa.select(plans).order_by(*newest)
    # one environment's: ix_plans_env_id_created_at walked backwards from the newest, never every record of the
    # store newest first (past the other environments') nor every record of the environment sorted
    return sa.select(plans).where(*equal_in_index_order(conn, plans.c.env_id, env_id)
                                  ).order_by(plans.c.env_id.desc(), *newest)


def row_to_record(row: Row[Any]) -> PlanRecord:
    m = row._mapping
    return PlanRecord(
        **{f: m[f] for f in _META_COLUMNS},
        environment=env_from_row(m),
        envelope=m["envelope"],
        native_median_ms=m["native_median_ms"] or {},
        env_id=m["env_id"],
        job_id=m["job_id"],
        created_at=m["created_at"],
    )


def _candidate_values(table: CandidateTable) -> dict[str, Any]:
    """The ``plan_candidates`` columns of ``table``, as on the wire (a non-finite figure is null)."""
    dumped = table.model_dump(mode="json", include={"candidates", "candidates_omitted"})
    return {"candidates": dumped["candidates"], "omitted": dumped["candidates_omitted"]}


def row_to_withdrawal(row: Row[Any]) -> WithdrawalRecord:
    m = row._mapping
    return WithdrawalRecord(graph_key=m["graph_key"], environment=env_from_row(m), blob_sha256=m["blob_sha256"],
                            withdrawn_revision=m["withdrawn_revision"], revision=m["revision"], reason=m["reason"],
                            envelope=m["envelope"], env_id=m["env_id"], created_at=m["created_at"])


#: Postgres advisory lock namespace (the first of the two-int keys) of one graph key on one environment.
_PG_PLAN_LOCK = 0x706C6E73


def lock_plan_key(conn: Connection, graph_key: str, env_id: str) -> None:
    """Postgres: serialize the transactions that write the plan or withdrawal of ``graph_key`` on ``env_id``
    (publish, withdraw) until commit, on every replica. Each statement after it, under READ COMMITTED, then sees what
    the one before committed: a publish checks the withdrawal the withdraw it waited for stored, and a withdraw never
    deletes a record between a publish's insert and its read. SQLite needs nothing: one writer at a time."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:ns, hashtext(:k))"),
                     {"ns": _PG_PLAN_LOCK, "k": f"{graph_key}/{env_id}"})


def _check_spec(conn: Connection, graph_key: str) -> None:
    if not spec_exists(conn, graph_key):
        raise errors.NotFound(f"no spec stored for graph key {graph_key}; upload it with the plan")


class Plans(Misses):
    """Plan records; resolving records misses, hence the base class."""

    db: Database
    blob_store: CatalogBlobs

    def publish_plan(self, meta: PlanMeta, blob: bytes | None, *, job_id: int | None = None, worker_id: str | None = None,
                     lease_token: str | None = None, holder: str | None = None, replace: bool = False,
                     candidates: CandidateTable | None = None, expect_revision: int | None = None) -> PlanRecord:
        """Store a plan in one transaction: the blob if absent, the record, its tuning run's ``candidates`` table
        (bounded by :class:`CandidateTable`, apart from the record; ``meta``'s own when it is an upload that carries
        one), and (with ``job_id``) the job's success.

        Raises :class:`errors.IntegrityError` (size/sha256, by :func:`~plancache.verify.verify_blob`),
        :class:`errors.NotFound` (no spec),
        :class:`errors.Conflict` (another blob is stored for this key and environment, and not ``replace``; a job
        queued after that record was written re-tunes it, as ``replace`` does),
        :class:`errors.StaleRevision` (``replace``, and the stored record's revision is not below ``meta``'s; or the
        plan of this key and environment was withdrawn with a revision not below ``meta``'s),
        :class:`errors.LeaseLost` / :class:`errors.NotLeaseHolder` (``worker_id``, ``lease_token`` and the API token
        ``holder`` do not hold job ``job_id``: :func:`~.jobs.held_job`).
        Publishing the same blob again returns the stored record unchanged, unless ``replace`` and a higher revision
        (a record signed again) replace the record. ``expect_revision`` (with ``replace``: a record signed again from
        a copy read before) publishes only over the stored record of that revision: :class:`errors.StaleRevision`
        when it was replaced, withdrawn or deleted meanwhile.

        ``blob`` None publishes a blob stored before (:func:`~.content.write_blob`, ``PUT /v1/blobs``): :class:`errors.NotFound`
        unless it is there with ``meta.blob_size`` bytes. Bytes for a folder or object store are written before the
        transaction opens, so no file or network I/O happens under the database's write lock; the upload made their
        catalog row new, so gc with a grace period longer than the publish takes leaves them to it.
        """
        if candidates is None and isinstance(meta, CandidateTable):
            candidates = meta
        if blob is not None:
            try:
                verify_blob(meta, blob, what=f"plan {meta.graph_key} on {meta.environment.describe()}")
            except errors.VerificationError as exc:
                raise errors.IntegrityError(exc.message) from None
            if isinstance(self.blob_store, ContentBlobs):  # its bytes first, outside the transaction
                self._check_spec(meta.graph_key)  # (checked again below) no bytes written for an unknown key
                write_blob(self.db, self.blob_store, meta.blob_sha256, meta.blob_size, blob)
                blob = None
        if blob is None and self._stored_size(meta.blob_sha256) != meta.blob_size:  # no file or network I/O below
            raise errors.NotFound(f"blob {meta.blob_sha256} of {meta.blob_size} bytes is not stored: upload it "
                                  "first (PUT /v1/blobs/{sha256}), then publish its record")
        env = meta.environment
        siblings = self._sibling_keys([meta.graph_key]).get(meta.graph_key)  # specs never change: read before the write
        with self.db.write() as conn:
            lock_plan_key(conn, meta.graph_key, env.env_id)
            now = self.db.now(conn)  # the database's time, as for the job's lease
            values = {**_record_values(meta, job_id, now), "sibling_key": siblings}
            job = None if job_id is None else complete_held_job(conn, job_id, worker_id, lease_token, meta.graph_key,
                                                                env, now, holder=holder)
            _check_spec(conn, meta.graph_key)
            withdrawn = conn.execute(sa.select(withdrawals.c.id, withdrawals.c.revision).where(
                withdrawals.c.graph_key == meta.graph_key, *same_env(withdrawals, env)).with_for_update()).first()
            if withdrawn is not None:
                if meta.revision <= withdrawn.revision:
                    raise errors.StaleRevision(
                        f"the plan for graph key {meta.graph_key} on {env.describe()} was withdrawn at revision "
                        f"{withdrawn.revision}; this plan has revision {meta.revision}: only a plan signed after the "
                        "withdrawal (a higher revision) takes its place")
                if expect_revision is not None:
                    raise errors.StaleRevision(f"the plan for graph key {meta.graph_key} on {env.describe()} was "
                                               f"withdrawn at revision {withdrawn.revision} after it was read")
                conn.execute(sa.delete(withdrawals).where(withdrawals.c.id == withdrawn.id))  # superseded
            if expect_revision is not None:
                stored = conn.execute(sa.select(plans.c.revision).where(
                    plans.c.graph_key == meta.graph_key, *same_env(plans, env))).scalar()
                if stored != expect_revision:
                    raise errors.StaleRevision(
                        f"the plan for graph key {meta.graph_key} on {env.describe()} is "
                        f"{'gone' if stored is None else f'revision {stored}'}, not revision {expect_revision} "
                        "as read: it changed meanwhile")
            if blob is not None:
                insert_blob_row(conn, meta.blob_sha256, len(blob), now)
            elif not hold_blob_row(conn, meta.blob_sha256, meta.blob_size, self.blob_store.url == "database", now):
                raise errors.NotFound(f"blob {meta.blob_sha256} was collected before its record was published: "
                                      "upload it again (PUT /v1/blobs/{sha256})")
            row = conn.execute(
                upsert_insert(conn, plans).values(**values)
                .on_conflict_do_nothing(index_elements=["graph_key", "env_id"])
                .returning(*plans.c)
            ).first()
            written = row is not None
            if row is None:
                row = conn.execute(
                    sa.select(plans).where(plans.c.graph_key == meta.graph_key, *same_env(plans, env)).with_for_update()
                ).one()
                same = row.blob_sha256 == meta.blob_sha256 and (not replace or row.revision == meta.revision)
                if not same:
                    # a job queued after the stored record was written is a re-tune of it: its plan takes the place
                    if not replace and not (job is not None and row.created_at < job.created_at):
                        raise errors.Conflict(
                            f"a different plan (blob {row.blob_sha256}) is stored for graph key {meta.graph_key} "
                            f"on {env.describe()}; pass replace to overwrite it"
                        )
                    if meta.revision <= row.revision:
                        raise errors.StaleRevision(
                            f"the plan stored for graph key {meta.graph_key} on {env.describe()} has revision "
                            f"{row.revision}; a replacement needs a higher revision than that, this one has "
                            f"{meta.revision} (an older record cannot replace a newer one: sign it again)"
                        )
                    row = conn.execute(
                        sa.update(plans).where(plans.c.id == row.id).values(**values).returning(*plans.c)
                    ).one()
                    written = True
            if written:
                conn.execute(sa.delete(plan_candidates).where(plan_candidates.c.plan_id == row.id))
                if candidates is not None:
                    conn.execute(sa.insert(plan_candidates).values(plan_id=row.id, **_candidate_values(candidates)))
            if blob is not None:  # the database's bytes, in their row
                self.blob_store.put(conn, meta.blob_sha256, blob)
            if job is not None:
                tally_completion(conn, job)
        return row_to_record(row)

    def _check_spec(self, graph_key: str) -> None:
        with self.db.read() as conn:
            _check_spec(conn, graph_key)

    def _sibling_keys(self, graph_keys: Collection[str]) -> dict[str, str]:
        """The :func:`~plancache.spec.axes.sibling_key` of each of ``graph_keys`` whose stored spec has one."""
        with self.db.query() as conn:
            rows = conn.execute(sa.select(specs.c.graph_key, specs.c.canonical_json)
                                .where(specs.c.graph_key.in_(list(graph_keys)))).all()
        return {key: shared for key, text in rows if (shared := stored_sibling_key(text)) is not None}

    def plan_siblings(self, env: Environment, graph_keys: Collection[str], limit: int) -> dict[str, str]:
        """The canonical specs of the plans stored on exactly this environment's validity fields for the other shapes
        of ``graph_keys`` (their :func:`~plancache.spec.axes.sibling_key`), by graph key: up to ``limit`` per sibling key,
        the newest first, ``graph_keys`` left out. Each sibling key is one walk of ``ix_plans_env_id_sibling_key`` that
        stops at ``limit``, whatever else the store holds."""
        check_validity(env.validity())
        check_page(limit, 0)
        found: dict[str, str] = {}
        shared = dict.fromkeys(self._sibling_keys(graph_keys).values())
        if not shared or not limit:
            return found
        with self.db.read() as conn:  # a transaction: equal_in_index_order sets its planner option in it
            for siblings in shared:
                q = (sa.select(plans.c.graph_key, specs.c.canonical_json)
                     .join(specs, specs.c.graph_key == plans.c.graph_key)
                     .where(*same_env(plans, env)[1:], *equal_in_index_order(conn, plans.c.env_id, env.env_id),
                            *equal_in_index_order(conn, plans.c.sibling_key, siblings))
                     .order_by(plans.c.env_id.desc(), plans.c.sibling_key.desc(), plans.c.created_at.desc(),
                               plans.c.id.desc())
                     .limit(limit + len(graph_keys)))
                taken = 0
                for key, text in conn.execute(q):
                    if key in graph_keys or key in found:
                        continue
                    found[key] = text
                    taken += 1
                    if taken == limit:
                        break
        return found

    def _stored_size(self, sha256: str) -> int | None:
        with self.db.read() as conn:
            return self.blob_store.size(conn, sha256)

    def withdraw_plan(self, withdrawal: Withdrawal) -> WithdrawalRecord:
        """Withdraw the plan ``withdrawal`` names, in one transaction: its record is deleted (resolve no longer
        serves it; its blob is left to ``plans gc``) and the withdrawal is kept, so that explain gives it to clients
        (which drop their copies) until a plan of a higher revision takes its place. Sending a stored withdrawal
        again returns it unchanged; one of a higher revision (signed again) replaces it.

        Raises :class:`errors.SignatureError` (``unsigned``: no envelope; the server holds no key to check it,
        clients do), :class:`errors.NotFound` (neither a plan nor a withdrawal is stored for the key and
        environment), :class:`errors.StaleRevision` (the stored plan is not the withdrawn one — its revision or
        blob differ: replaced meanwhile —, or the withdrawal's revision is not above the stored plan's or
        withdrawal's)."""
        w, env = withdrawal, withdrawal.environment
        if w.envelope is None:
            raise errors.SignatureError(errors.Reason.UNSIGNED, f"the withdrawal of plan {w.graph_key} is unsigned: sign it with "
                                                    "the key clients trust (`plancache plans withdraw` does)")
        where = (withdrawals.c.graph_key == w.graph_key, *same_env(withdrawals, env))
        with self.db.write() as conn:
            lock_plan_key(conn, w.graph_key, env.env_id)
            now = self.db.now(conn)
            plan = conn.execute(sa.select(plans.c.id, plans.c.revision, plans.c.blob_sha256).where(
                plans.c.graph_key == w.graph_key, *same_env(plans, env)).with_for_update()).first()
            prior = conn.execute(sa.select(withdrawals).where(*where).with_for_update()).first()
            what = f"the plan for graph key {w.graph_key} on {env.describe()}"
            if plan is None and prior is None:
                raise errors.NotFound(f"no plan is stored for graph key {w.graph_key} on {env.describe()}")
            stored = plan or prior
            assert stored is not None
            stored_revision = stored.revision if plan is not None else stored.withdrawn_revision
            if (stored_revision, stored.blob_sha256) != (w.withdrawn_revision, w.blob_sha256):
                raise errors.StaleRevision(
                    f"{what} {'is' if plan is not None else 'was withdrawn as'} revision {stored_revision} (blob "
                    f"{stored.blob_sha256}), not the withdrawn revision {w.withdrawn_revision} (blob {w.blob_sha256}): "
                    "withdraw the plan that is stored")
            if prior is not None and prior.revision == w.revision and prior.envelope == w.envelope.model_dump():
                return row_to_withdrawal(prior)
            newest = max(stored_revision, prior.revision if prior is not None else 0)
            if w.revision <= newest:
                raise errors.StaleRevision(f"{what} has revision {newest}; a withdrawal needs a higher revision than "
                                           f"that, this one has {w.revision} (sign it again)")
            values = {"graph_key": w.graph_key, **env_columns(env), "blob_sha256": w.blob_sha256,
                      "withdrawn_revision": w.withdrawn_revision, "revision": w.revision, "reason": w.reason,
                      "envelope": w.envelope.model_dump(), "created_at": now}
            if plan is not None:
                conn.execute(sa.delete(plans).where(plans.c.id == plan.id))
            if prior is None:
                row = conn.execute(sa.insert(withdrawals).values(**values).returning(*withdrawals.c)).one()
            else:
                row = conn.execute(sa.update(withdrawals).where(withdrawals.c.id == prior.id).values(**values)
                                   .returning(*withdrawals.c)).one()
        return row_to_withdrawal(row)

    def revision_floor(self, graph_key: str, env: Environment) -> int:
        """The revision a plan published for ``graph_key`` on ``env`` must be above: the withdrawal's stored there,
        0 when there is none."""
        q = sa.select(withdrawals.c.revision).where(withdrawals.c.graph_key == graph_key, *same_env(withdrawals, env))
        with self.db.read() as conn:
            return int(conn.execute(q).scalar() or 0)

    def get_withdrawals(self, env: Environment, graph_keys: list[str]) -> dict[str, WithdrawalRecord]:
        """The withdrawals stored for ``graph_keys`` on exactly this environment's validity fields, by graph key."""
        if not graph_keys:
            return {}
        with self.db.read() as conn:
            rows = conn.execute(WITHDRAWALS_OF_KEYS[conn.dialect.name == "postgresql"], key_params(set(graph_keys), env))
            return {row.graph_key: row_to_withdrawal(row) for row in rows}

    def get_plan(self, graph_key: str, env: Environment) -> PlanRecord | None:
        """The record for ``graph_key`` on exactly this environment's validity fields."""
        with self.db.read() as conn:
            row = conn.execute(sa.select(plans).where(plans.c.graph_key == graph_key, *same_env(plans, env))).first()
        return None if row is None else row_to_record(row)

    def get_candidates(self, graph_key: str, env: Environment) -> PlanCandidates | None:
        """The candidates table of the stored plan of ``graph_key`` on exactly this environment's validity fields
        (empty when its upload sent none); None when no plan is stored there."""
        q = (sa.select(plans.c.graph_key, plans.c.env_id, plans.c.blob_sha256, plans.c.revision,
                       plan_candidates.c.candidates, plan_candidates.c.omitted)
             .outerjoin(plan_candidates, plan_candidates.c.plan_id == plans.c.id)
             .where(plans.c.graph_key == graph_key, *same_env(plans, env)))
        with self.db.read() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        return PlanCandidates(graph_key=row.graph_key, env_id=row.env_id, blob_sha256=row.blob_sha256,
                              revision=row.revision, candidates=row.candidates or [],
                              candidates_omitted=row.omitted or {})

    def plan_versions(self, env: Environment, graph_keys: Collection[str]) -> dict[str, PlanVersion]:
        """The versions of the records stored for ``graph_keys`` on exactly this environment's validity fields, by
        graph key, in one query that reads no record (:meth:`plan_records` reads those). Nothing is recorded."""
        check_validity(env.validity())
        if not graph_keys:
            return {}
        with self.db.query() as conn:
            rows = conn.execute(_VERSIONS[conn.dialect.name == "postgresql"], key_params(graph_keys, env))
            return {row[0]: PlanVersion(*row) for row in rows}

    def plan_records(self, env: Environment, graph_keys: Collection[str]) -> dict[str, tuple[PlanVersion, PlanRecord]]:
        """The records stored for ``graph_keys`` on exactly this environment's validity fields, with their
        versions, by graph key. Nothing is recorded."""
        if not graph_keys:
            return {}
        with self.db.query() as conn:
            rows = conn.execute(_RECORDS[conn.dialect.name == "postgresql"], key_params(graph_keys, env)).all()
        return {row.graph_key: (PlanVersion(row.graph_key, row.env_id, row.id, row.revision, row.blob_sha256,
                                            row.blob_size, row.written), row_to_record(row)) for row in rows}

    def get_blobs(self, digests: Collection[str]) -> dict[str, bytes]:
        """The stored bytes of ``digests`` (absent ones left out)."""
        if not digests:
            return {}
        with self.db.query() as conn:
            return self.blob_store.get_many(conn, digests)

    def plan_graph_keys(self, env_id: str) -> list[str]:
        """The graph keys of every record stored for ``env_id``, in one read, sorted."""
        q = sa.select(plans.c.graph_key).where(plans.c.env_id == env_id).order_by(plans.c.graph_key)
        with self.db.read() as conn:
            return list(conn.execute(q).scalars())

    def count_plans(self, *, env_id: str | None = None, graph_key: str | None = None) -> int:
        """How many records :meth:`list_plans` pages through with the same filters."""
        q = sa.select(sa.func.count()).select_from(plans)
        if env_id is not None:
            q = q.where(plans.c.env_id == env_id)
        if graph_key is not None:
            q = q.where(plans.c.graph_key == graph_key)
        with self.db.read() as conn:
            return int(conn.execute(q).scalar_one())

    def list_plans(self, *, env_id: str | None = None, graph_key: str | None = None,
                   limit: int = 100, offset: int = 0) -> list[PlanRecord]:
        """Records, newest first."""
        check_page(limit, offset)
        with self.db.read() as conn:
            return [row_to_record(r) for r in conn.execute(_plan_list(conn, env_id, graph_key).limit(limit)
                                                           .offset(offset))]
