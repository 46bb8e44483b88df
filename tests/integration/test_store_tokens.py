"""API tokens, on SQLite and Postgres."""

from __future__ import annotations

import hashlib

import pytest
import sqlalchemy as sa

from plancache import errors
from plancache.store import TokenInfo
from plancache.store.models import api_tokens


def test_create_and_authenticate(store, clock):
    plaintext, info = store.create_token("ci-worker", "worker")
    assert isinstance(info, TokenInfo) and info.name == "ci-worker" and info.role == "worker"
    assert not info.revoked and info.created_at == clock.now
    assert store.authenticate(plaintext) == info
    assert store.authenticate(plaintext + "x") is None and store.authenticate("") is None
    with store.engine.connect() as conn:
        stored = conn.execute(sa.select(api_tokens.c.token_hash)).scalar_one()
    assert stored == hashlib.sha256(plaintext.encode()).hexdigest() and plaintext not in stored


def test_tokens_are_distinct_and_names_unique_among_live_ones(store):
    a, _ = store.create_token("reader-1", "reader")
    b, _ = store.create_token("admin-1", "admin")
    assert a != b and len(a) > 40
    with pytest.raises(errors.Conflict):
        store.create_token("reader-1", "reader")
    store.revoke_token("reader-1")
    c, info = store.create_token("reader-1", "worker")
    assert store.authenticate(c) == info and store.authenticate(a) is None


def test_revoke_by_name_or_id(store):
    t1, i1 = store.create_token("one", "reader")
    t2, i2 = store.create_token("two", "admin")
    assert store.revoke_token("one").revoked
    assert store.revoke_token(i2.id).revoked and store.revoke_token(str(i2.id)).revoked
    assert store.authenticate(t1) is None and store.authenticate(t2) is None
    with pytest.raises(errors.NotFound):
        store.revoke_token("one")  # no live token of that name is left
    with pytest.raises(errors.NotFound):
        store.revoke_token(9999)
    assert [(t.name, t.revoked) for t in store.list_tokens()] == [("one", True), ("two", True)]


def test_bad_role_and_name_are_refused(store):
    with pytest.raises(ValueError, match="role"):
        store.create_token("x", "root")
    for bad in ("", " padded ", "n" * 200):
        with pytest.raises(ValueError, match="name"):
            store.create_token(bad, "reader")


def test_a_token_past_its_expiry_is_refused(store, clock):
    """Before: tokens had no expiry."""
    from datetime import timedelta

    plaintext, info = store.create_token("ci-job", "reader", expires_in=timedelta(hours=1))
    assert info.expires_at == clock.now + timedelta(hours=1)
    assert store.authenticate(plaintext) == info
    clock.advance(3599)
    assert store.authenticate(plaintext) is not None
    clock.advance(1)
    assert store.authenticate(plaintext) is None
    assert [t.expires_at for t in store.list_tokens()] == [info.expires_at]
    for bad in (timedelta(0), timedelta(days=3651)):
        with pytest.raises(errors.InvalidValue, match="expires"):
            store.create_token("other", "reader", expires_in=bad)


def test_the_cli_creates_a_token_that_expires_and_lists_its_expiry(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from plancache.cli import make_app
    from plancache.store import open_store

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    open_store(url, create=True).close()
    monkeypatch.setenv("PLANCACHE_DATABASE_URL", url)
    made = CliRunner().invoke(make_app(), ["token", "create", "--role", "reader", "--name", "ci", "--expires-in-days", "2"])
    assert made.exit_code == 0, made.output
    assert "valid until" in made.output
    listed = CliRunner().invoke(make_app(), ["token", "list"])
    assert listed.exit_code == 0 and "expires" in listed.output and "live" in listed.output
    bad = CliRunner().invoke(make_app(), ["token", "create", "--role", "reader", "--name", "x", "--expires-in-days", "0"])
    assert bad.exit_code == 2  # USAGE: out of range
