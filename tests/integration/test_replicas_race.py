"""Two replicas (two Stores) on one Postgres database: races between a withdrawal and a publish."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from plancache import errors
from plancache.protocol import PlanMeta, PlanRecord, Withdrawal
from plancache.store import open_store
from tests.factories import make_meta, new_signer


def _pause_before_commit(store, statement_prefix: str, entered: threading.Event, seconds: float) -> None:
    """Sleep ``seconds`` after the first statement starting with ``statement_prefix`` on ``store``'s engine."""
    fired = []

    @sa.event.listens_for(store.db.engine, "after_cursor_execute")
    def pause(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if statement.lstrip().upper().startswith(statement_prefix) and not fired:
            fired.append(1)
            entered.set()
            time.sleep(seconds)


def _published_with_its_withdrawal(store, make_spec, gpu_env) -> tuple[str, PlanMeta, bytes, Withdrawal]:
    """A plan published on ``store`` and a signed withdrawal of it (not sent): its key, record, blob and withdrawal."""
    signer = new_signer()
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    blob = b"the plan that turned out wrong" * 10
    meta = make_meta(key, gpu_env, blob, signer)
    record = store.publish_plan(meta, blob)
    return key, meta, blob, signer.sign_withdrawal(Withdrawal(
        graph_key=key, environment=gpu_env, blob_sha256=record.blob_sha256, withdrawn_revision=record.revision,
        reason="wrong"))


@pytest.mark.postgres
def test_a_withdrawn_plan_published_again_during_the_withdrawal_stays_withdrawn(postgres_url, make_spec, gpu_env):
    a = open_store(postgres_url, create=True)
    b = open_store(postgres_url)
    try:
        key, meta, blob, w = _published_with_its_withdrawal(a, make_spec, gpu_env)
        entered = threading.Event()
        _pause_before_commit(a, "INSERT INTO WITHDRAWALS", entered, 1.0)
        t = threading.Thread(target=a.withdraw_plan, args=(w,))
        t.start()
        assert entered.wait(10)
        outcome: object
        try:  # replica b: the same signed plan uploaded again (a worker's retry, an old bundle)
            outcome = b.publish_plan(meta, blob)
        except errors.StaleRevision as exc:
            outcome = exc
        t.join()
        assert b.get_withdrawals(gpu_env, [key]), "the withdrawal is stored"
        assert b.get_plan(key, gpu_env) is None, f"the withdrawn plan is served again (publish gave {outcome!r})"
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_a_publish_racing_a_withdrawal_after_its_insert_is_refused_cleanly(postgres_url, make_spec, gpu_env):
    """Replica b's publish of the stored plan finds the record (its INSERT does nothing), then replica a withdraws
    it and commits before b reads the record: b's publish must end in a clean refusal, not NoResultFound."""
    a = open_store(postgres_url, create=True)
    b = open_store(postgres_url)
    try:
        key, meta, blob, w = _published_with_its_withdrawal(a, make_spec, gpu_env)
        entered = threading.Event()
        _pause_before_commit(b, "INSERT INTO PLANS", entered, 1.0)
        result: list[object] = []

        def publish() -> None:
            try:
                result.append(b.publish_plan(meta, blob))
            except Exception as exc:  # noqa: BLE001
                result.append(exc)

        t = threading.Thread(target=publish)
        t.start()
        assert entered.wait(10)
        a.withdraw_plan(w)
        t.join()
        # before: sqlalchemy's NoResultFound (a 500 over HTTP); now the withdrawal waits for the publish to commit
        assert isinstance(result[0], PlanRecord), repr(result[0])
        assert b.get_plan(key, gpu_env) is None
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_resign_that_read_the_record_before_a_withdrawal_does_not_revive_it(db, request, tmp_path, make_spec,
                                                                                gpu_env):
    """``plans resign`` reads a page of records, then signs and publishes each: a withdrawal committed in between
    (an operator, another replica) must not be undone by the re-signed copy (its revision is above the
    withdrawal's: signed later)."""
    from plancache.cli.plans_cmds import _resign
    from tests.factories import trusted

    url = f"sqlite:///{tmp_path / 'p.db'}" if db == "sqlite" else request.getfixturevalue("postgres_url")
    store = open_store(url, create=True)
    try:
        old_key, new_key = new_signer(), new_signer()
        key, spec = make_spec(0)
        store.put_spec(key, spec)
        blob = b"the plan that turned out wrong" * 10
        record = store.publish_plan(make_meta(key, gpu_env, blob, old_key), blob)
        read_by_resign = store.get_plan(key, gpu_env)
        store.withdraw_plan(old_key.sign_withdrawal(Withdrawal(
            graph_key=key, environment=gpu_env, blob_sha256=record.blob_sha256, withdrawn_revision=record.revision,
            reason="wrong")))
        time.sleep(0.005)  # the re-signature's revision (a time) is above the withdrawal's
        outcome = _resign(store, read_by_resign, new_key, trusted(old_key), False)
        assert store.get_plan(key, gpu_env) is None, f"the withdrawn plan is served again (resign: {outcome})"
        assert store.get_withdrawals(gpu_env, [key])
        assert outcome == "newer"
    finally:
        store.close()
