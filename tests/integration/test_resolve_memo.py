"""The resolve path's memories (both databases): a record comes from the per-process memo only while the store still
holds that version of it (a replacement or a withdrawal, even by another process, is answered at once), presigned
URLs are handed out again only while more than half their validity is left, blobs inlined once are inlined (and served
by a GET) from the blob memory, a damaged one never, and a small body or a remembered token costs no hand-off to a
worker thread."""

from __future__ import annotations

import base64
import logging
from urllib.parse import parse_qs, urlsplit

import pytest
import sqlalchemy as sa

from plancache.blobs import ObjectStoreBlobs
from plancache.protocol import ResolveResponse, Withdrawal
from plancache.server import auth, bodies
from tests.factories import make_meta, new_signer
from tests.server_util import api  # noqa: F401


def _resolve(api, env, keys: list[str], include_blobs: bool = False) -> ResolveResponse:
    r = api.client.post("/v1/plans/resolve", json={"environment": env.model_dump(), "graph_keys": keys,
                                                   "include_blobs": include_blobs}, headers=api.reader)
    assert r.status_code == 200, r.text
    return ResolveResponse.model_validate_json(r.content)


@pytest.fixture
def signer():
    return new_signer()


@pytest.fixture
def key(store, make_spec):
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    return key


def test_a_replaced_plan_is_answered_at_once_never_the_memo_s_record(api, store, key, gpu_env, signer, clock):
    first = store.publish_plan(make_meta(key, gpu_env, b"first" * 50, signer), b"first" * 50)
    assert _resolve(api, gpu_env, [key]).plans[key].record == first
    assert _resolve(api, gpu_env, [key]).plans[key].record == first  # from the memo
    assert len(api.app.state.record_memo) == 1
    clock.advance(1)
    # replaced through the store, as another server process would: this one learns it from its next resolve
    resigned = store.publish_plan(make_meta(key, gpu_env, b"first" * 50, signer), b"first" * 50, replace=True)
    assert resigned.revision > first.revision and resigned.blob_sha256 == first.blob_sha256
    assert _resolve(api, gpu_env, [key]).plans[key].record == resigned
    clock.advance(1)
    better = store.publish_plan(make_meta(key, gpu_env, b"better" * 50, signer), b"better" * 50, replace=True)
    answer = _resolve(api, gpu_env, [key])
    assert answer.plans[key].record == better and answer.plans[key].blob_url == f"/v1/blobs/{better.blob_sha256}"
    assert len(api.app.state.record_memo) == 3


def test_a_withdrawn_plan_is_missing_at_once(api, store, key, gpu_env, signer):
    record = store.publish_plan(make_meta(key, gpu_env, b"wrong" * 50, signer), b"wrong" * 50)
    assert _resolve(api, gpu_env, [key]).plans[key].record == record
    store.withdraw_plan(signer.sign_withdrawal(Withdrawal(
        graph_key=key, environment=record.environment, blob_sha256=record.blob_sha256,
        withdrawn_revision=record.revision, reason="wrong results")))
    answer = _resolve(api, gpu_env, [key])
    assert answer.plans == {} and answer.missing == [key]


def test_answers_from_the_memo_are_the_records_as_stored(api, store, make_spec, gpu_env, signer):
    keys = []
    for i in range(3):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        store.publish_plan(make_meta(key, gpu_env, b"plan %d" % i * 40, signer), b"plan %d" % i * 40)
        keys.append(key)
    asked = [keys[2], "f" * 64, keys[0], keys[2]]
    cold = _resolve(api, gpu_env, asked[:3])
    warm = _resolve(api, gpu_env, asked + [keys[1]])
    assert list(warm.plans) == [keys[2], keys[0], keys[1]] and warm.missing == ["f" * 64]
    for key in keys:
        assert warm.plans[key].record == store.get_plan(key, gpu_env)
    assert {k: p for k, p in warm.plans.items() if k in cold.plans} == cold.plans


@pytest.mark.parametrize("blob_store_url", ["s3"], indirect=True)
def test_a_presigned_url_is_reused_only_while_more_than_half_its_validity_is_left(
        api, store, key, gpu_env, signer, monkeypatch):
    store.publish_plan(make_meta(key, gpu_env, b"bytes" * 50, signer), b"bytes" * 50)
    now = [0.0]
    seconds = api.app.state.settings.presign_seconds
    urls = api.app.state.presigned_urls
    assert urls.ttl == seconds / 2
    monkeypatch.setattr(urls, "_clock", lambda: now[0])
    made: list[str] = []
    presign = ObjectStoreBlobs.presign

    def counted(self, sha256, expires_in):
        made.append(sha256)
        return presign(self, sha256, expires_in)

    monkeypatch.setattr(ObjectStoreBlobs, "presign", counted)
    url = _resolve(api, gpu_env, [key]).plans[key].blob_url
    assert url is not None and parse_qs(urlsplit(url).query)["X-Amz-Expires"] == [str(seconds)]
    now[0] = seconds / 2 - 1  # more than half left: the same URL
    assert _resolve(api, gpu_env, [key]).plans[key].blob_url == url and len(made) == 1
    now[0] = seconds / 2  # half gone: a new one
    assert _resolve(api, gpu_env, [key]).plans[key].blob_url is not None and len(made) == 2


def test_a_small_body_is_parsed_on_the_event_loop_and_a_large_one_in_a_thread(api, key, gpu_env, monkeypatch):
    handed: list[int] = []
    run_parser = bodies.run_parser

    async def counted(app, fn, body, *args):
        handed.append(len(body))
        return await run_parser(app, fn, body, *args)

    monkeypatch.setattr(bodies, "run_parser", counted)
    _resolve(api, gpu_env, [key])
    assert handed == []
    many = [f"{i:064x}" for i in range(bodies.INLINE_PARSE_BYTES // 64)]
    assert _resolve(api, gpu_env, many).missing == many
    assert len(handed) == 1 and handed[0] > bodies.INLINE_PARSE_BYTES


def test_a_remembered_token_is_checked_on_the_event_loop(api, key, gpu_env, monkeypatch):
    looked_up: list[str] = []
    run_in_threadpool = auth.run_in_threadpool

    async def counted(fn, *args, **kwargs):
        looked_up.append(fn.__name__)
        return await run_in_threadpool(fn, *args, **kwargs)

    monkeypatch.setattr(auth, "run_in_threadpool", counted)
    _resolve(api, gpu_env, [key])
    assert looked_up == ["authorize"]  # the stored token, looked up in the database once
    _resolve(api, gpu_env, [key])
    assert looked_up == ["authorize"]


def _reads_of_blobs(store, monkeypatch) -> list[set[str]]:
    """The digests each of the store's reads of blob bytes asks for, from now on."""
    asked: list[set[str]] = []
    get_blobs, get_blob_up_to = store.get_blobs, store.get_blob_up_to
    monkeypatch.setattr(store, "get_blobs", lambda digests: asked.append(set(digests)) or get_blobs(digests))
    monkeypatch.setattr(store, "get_blob_up_to", lambda sha256, limit: asked.append({sha256}) or get_blob_up_to(sha256, limit))
    return asked


def test_blobs_inlined_once_are_inlined_and_served_from_the_blob_memory(api, store, make_spec, gpu_env, signer,
                                                                        monkeypatch):
    keys, records = [], {}
    for i in range(2):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        blob = bytes([i]) * 3000
        records[key] = (store.publish_plan(make_meta(key, gpu_env, blob, signer), blob), blob)
        keys.append(key)
    asked = _reads_of_blobs(store, monkeypatch)
    for _ in range(2):
        answer = _resolve(api, gpu_env, keys, include_blobs=True)
        for key, (_, blob) in records.items():
            assert base64.b64decode(answer.plans[key].blob_b64) == blob and answer.plans[key].blob_url is None
    assert asked == [{record.blob_sha256 for record, _ in records.values()}, set()]  # the second: memory only
    for record, blob in records.values():  # and a GET after them
        r = api.client.get(f"/v1/blobs/{record.blob_sha256}", headers=api.reader)
        assert r.status_code == 200 and r.content == blob
    assert len(asked) == 2


def test_a_damaged_blob_of_the_database_is_never_inlined_nor_kept(api, store, key, gpu_env, signer, monkeypatch,
                                                                  caplog):
    blob = b"\x07plan" * 600
    record = store.publish_plan(make_meta(key, gpu_env, blob, signer), blob)
    with store.db.write() as conn:  # the same size, other bytes: only a hash tells them apart
        conn.execute(sa.text("UPDATE blobs SET data = :data WHERE sha256 = :sha256"),
                     {"data": b"\0" * len(blob), "sha256": record.blob_sha256})
    with caplog.at_level(logging.WARNING, logger="plancache.server"):
        answer = _resolve(api, gpu_env, [key], include_blobs=True)
    assert answer.plans[key].blob_b64 is None and answer.plans[key].blob_url == f"/v1/blobs/{record.blob_sha256}"
    assert f"blob {record.blob_sha256} of database is damaged, not inlined" in caplog.text
    assert api.app.state.blob_memory.get(record.blob_sha256) is None
    assert api.client.get(answer.plans[key].blob_url, headers=api.reader).status_code == 404
