"""The server's per-process memories: blob bytes and resolve answers' records (byte-bounded LRUs) and authenticated
tokens (time-bounded)."""

from __future__ import annotations

import hashlib

import pytest
import sqlalchemy as sa

from plancache.server.memo import RecordMemo, TtlMemory, blob_memory
from plancache.store.models import blobs
from plancache.store.plans import PlanVersion
from tests.server_util import api, bearer, open_api, upload  # noqa: F401


def _blobs(count: int, size: int) -> list[tuple[str, bytes]]:
    return [(hashlib.sha256(data).hexdigest(), data) for data in (bytes([i]) * size for i in range(count))]


def test_blob_memory_drops_the_least_recently_used_past_its_size():
    m = blob_memory(16 * 100)  # 16 items of 100 bytes
    items = _blobs(17, 100)
    for sha, data in items[:16]:
        m.put(sha, data)
    assert all(m.has(sha) for sha, _ in items[:16])
    assert m.get(items[0][0]) == items[0][1]  # the first is now the most recent
    m.put(*items[16])
    assert m.get(items[1][0]) is None and m.get(items[0][0]) == items[0][1] and m.has(items[16][0])


def test_blob_memory_never_keeps_a_blob_over_a_sixteenth_of_its_size():
    m = blob_memory(1600)
    [(sha, big)] = _blobs(1, 101)
    assert m.max_item == 100
    with pytest.raises(ValueError, match="more than this memory store holds"):
        m.put(sha, big)
    assert m.get(sha) is None
    off = blob_memory(0)
    assert off.max_item == 0 and off.get(sha) is None
    with pytest.raises(ValueError):
        blob_memory(-1)


def test_damaged_database_bytes_are_not_kept_nor_served(api, make_spec, make_plan, gpu_env, caplog):
    sha = _publish(api, make_spec, make_plan, gpu_env, b"plan-bytes" * 100)
    with api.store.db.write() as conn:
        conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha).values(data=b"damaged" * 100))
    assert api.client.get(f"/v1/blobs/{sha}", headers=api.reader).status_code == 404
    assert api.app.state.blob_memory.get(sha) is None and "is damaged" in caplog.text


def test_record_memo_drops_the_least_recently_used_past_its_size():
    def version(i: int) -> PlanVersion:
        return PlanVersion(f"{i:064x}", "e" * 32, i, 1, "b" * 64, 10, "2026-01-01 00:00:00")

    m = RecordMemo(max_bytes=1000)
    for i in range(10):
        m.put(version(i), b"r" * 300)
    assert len(m) == 3 and m.bytes == 900  # the last three
    assert m.get(version(7)) == b"r" * 300  # now the most recent
    m.put(version(10), b"r" * 300)
    assert m.get(version(8)) is None and m.get(version(7)) is not None and m.bytes == 900
    m.put(version(11), b"r" * 1001)  # alone over the limit: not kept, nothing dropped for it
    assert m.get(version(11)) is None and len(m) == 3
    assert m.get(version(7)._replace(revision=2)) is None  # another version of the record: not this one
    with pytest.raises(ValueError):
        RecordMemo(0)


def test_ttl_memory_forgets_after_its_time():
    now = [0.0]
    m: TtlMemory[str] = TtlMemory(5.0, max_items=2, clock=lambda: now[0])
    m.put("k", "v")
    now[0] = 4.9
    assert m.get("k") == "v"
    now[0] = 5.0
    assert m.get("k") is None
    m.put("a", "1"), m.put("b", "2"), m.put("c", "3")
    assert m.get("a") is None and m.get("c") == "3"  # at most max_items
    zero: TtlMemory[str] = TtlMemory(0)
    zero.put("k", "v")
    assert zero.get("k") is None


def _publish(api, make_spec, make_plan, gpu_env, blob: bytes, index: int = 0) -> str:
    key, spec = make_spec(index)
    meta, _ = make_plan(key, gpu_env, blob)
    assert upload(api.client, meta, blob, spec, headers=api.admin).status_code == 201
    return meta.blob_sha256


def test_a_blob_read_once_is_served_from_memory(api, make_spec, make_plan, gpu_env, monkeypatch):
    sha = _publish(api, make_spec, make_plan, gpu_env, b"plan-bytes" * 100)
    first = api.client.get(f"/v1/blobs/{sha}", headers=api.reader)
    assert first.status_code == 200 and first.content == b"plan-bytes" * 100
    assert api.app.state.blob_memory.get(sha) == first.content
    assert api.client.get(f"/v1/blobs/{'0' * 64}", headers=api.reader).status_code == 404  # unknown: looked up

    def no_database(*a, **k):
        raise AssertionError("the blob store was read again")

    monkeypatch.setattr(api.store, "get_blob", no_database)
    monkeypatch.setattr(api.store, "blob_size", no_database)
    again = api.client.get(f"/v1/blobs/{sha}", headers=api.reader)
    assert again.status_code == 200 and again.content == first.content
    assert again.headers["etag"] == f'"{sha}"' and "immutable" in again.headers["cache-control"]
    assert api.client.get(f"/v1/blobs/{sha}", headers={**api.reader, "If-None-Match": f'"{sha}"'}).status_code == 304


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_the_first_read_of_a_database_blob_is_one_query(store, make_spec, make_plan, gpu_env):
    """Size and bytes in one statement: a blob small enough for the memory is not looked up twice (a larger one
    is sized first, to take its share of the in-flight budget before its bytes are read)."""
    with open_api(store, blob_memory_bytes=16 * 2000) as api:  # blobs over 2000 bytes are not kept
        small, large = b"plan-bytes" * 100, b"L" * 2001
        digests = [_publish(api, make_spec, make_plan, gpu_env, blob, i) for i, blob in enumerate((small, large))]
        statements: list[str] = []
        sa.event.listen(store.db.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        for sha, blob, reads in ((digests[0], small, 1), (digests[1], large, 2), ("0" * 64, None, 1)):
            statements.clear()
            got = api.client.get(f"/v1/blobs/{sha}", headers=api.reader)
            assert (got.status_code, got.content) == ((200, blob) if blob else (404, got.content))
            assert len([s for s in statements if "FROM blobs" in s]) == reads, statements


def test_a_revoked_token_is_refused_once_its_memory_expires(store):
    with open_api(store, token_cache_seconds=0) as api:
        token, _ = store.create_token("short-lived", "reader")
        assert api.client.get("/v1/misses", headers=bearer(token)).status_code == 403  # known: a reader
        store.revoke_token("short-lived")
        assert api.client.get("/v1/misses", headers=bearer(token)).status_code == 401  # no memory: refused at once


def test_a_token_is_looked_up_once_within_its_time(store, monkeypatch):
    with open_api(store, token_cache_seconds=60) as api:
        token, _ = store.create_token("remembered", "reader")
        calls = []
        real = store.authenticate
        monkeypatch.setattr(store, "authenticate", lambda t: calls.append(t) or real(t))
        for _ in range(5):
            assert api.client.get(f"/v1/blobs/{'1' * 64}", headers=bearer(token)).status_code == 404
        assert len(calls) == 1
        assert api.client.get(f"/v1/blobs/{'1' * 64}", headers=bearer("pct_unknown")).status_code == 401
