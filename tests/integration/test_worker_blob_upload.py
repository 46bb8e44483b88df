"""The worker publishes through raw blob uploads: ``PUT /v1/blobs/{sha256}`` (after a ``HEAD``), then the signed
record alone; a spooled result goes the same way after a restart. No GPU (FakeTuner), a live server."""

from __future__ import annotations

import threading

from plancache.worker import JobsApi
from tests.integration.test_worker_loop import (  # noqa: F401  (fixtures)
    enqueue,
    job,
    keys,
    make_worker,
    plan,
    spool_a_result,
    srv,
)
from tests.worker_fakes import FakeTuner


def _record_completions(monkeypatch) -> list[tuple[int, bool]]:
    """(JSON bytes of each completion sent, whether it carried the blob inline)."""
    sent: list[tuple[int, bool]] = []
    real = JobsApi.complete

    def complete(self, job_id, req):
        text = req.model_dump_json()
        sent.append((len(text), "blob_b64" in text))
        return real(self, job_id, req)

    monkeypatch.setattr(JobsApi, "complete", complete)
    return sent


def test_a_worker_puts_the_blob_then_completes_with_the_record_alone(srv, tmp_path, keys, monkeypatch):
    sent = _record_completions(monkeypatch)
    (j,) = enqueue(srv, ["conv_bias_relu"])
    stats = make_worker(srv, tmp_path, keys[0], FakeTuner(), once=True).run(threading.Event())
    assert stats.succeeded == 1 and job(srv, j.id).status == "succeeded"
    record = plan(srv, j.graph_key)
    blob_path = f"/v1/blobs/{record.blob_sha256}"
    assert srv.requests[blob_path] == 2  # HEAD (absent), PUT
    assert srv.store.get_blob(record.blob_sha256) is not None
    (size, inline), = sent
    assert not inline and size < 8 * 1024, size  # measured: 4.9 KB (record, envelope, spec)


def test_a_spooled_result_is_uploaded_with_the_new_flow_after_a_restart(srv, tmp_path, keys, monkeypatch):
    j, ended, stats = spool_a_result(srv, tmp_path, keys)
    assert ended and stats.succeeded == 0
    sent = _record_completions(monkeypatch)
    srv.start()
    tuner = FakeTuner()
    again = make_worker(srv, tmp_path, keys[0], tuner, once=True)
    assert again.run(threading.Event()).succeeded == 1
    assert tuner.tuned == [] and job(srv, j.id).status == "succeeded"
    record = plan(srv, j.graph_key)
    assert srv.requests[f"/v1/blobs/{record.blob_sha256}"] >= 2 and sent and not any(inline for _, inline in sent)


def test_a_blob_collected_before_the_completion_is_uploaded_again(srv, tmp_path, keys, monkeypatch):
    """The server answers the first completion 404 (the blob went with gc in between): the worker PUTs it again and
    completes once more."""
    real = JobsApi.complete
    calls = []

    def complete(self, job_id, req):
        calls.append(job_id)
        if len(calls) == 1:
            with srv.store.db.write() as conn:  # as gc would: catalog row and bytes gone
                from plancache.store.models import blobs
                sha = req.plan.blob_sha256
                srv.store.blob_store.delete(conn, sha)
                conn.execute(blobs.delete().where(blobs.c.sha256 == sha))
        return real(self, job_id, req)

    monkeypatch.setattr(JobsApi, "complete", complete)
    (j,) = enqueue(srv, ["conv_bias_relu"])
    stats = make_worker(srv, tmp_path, keys[0], FakeTuner(), once=True).run(threading.Event())
    assert stats.succeeded == 1 and len(calls) == 2 and job(srv, j.id).status == "succeeded"
    record = plan(srv, j.graph_key)
    assert srv.store.get_blob(record.blob_sha256) is not None
