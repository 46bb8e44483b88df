"""The ladder's steps on their own: a step sees a :class:`LoadContext`, not a PlanCache, so it runs here with a fake
backend, a disk cache in a temporary folder and no server; a step serving stored plans reads a records source and
a blob store (:class:`StoreStep`), whichever they are."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from plancache.blobs import MemoryBlobs
from plancache.client.cache import DiskCache
from plancache.client.context import LoadContext, Pending
from plancache.client.received import ReceivedBlobs
from plancache.client.server_step import ServerStep
from plancache.client.steps import DiskStep, StoreStep
from plancache.protocol import PlanRecord
from tests.client_fakes import RecordingBackend
from tests.factories import CONV_SPEC, H200, make_record, new_signer, trusted

KEY = CONV_SPEC.graph_key
BLOB = b"a tuned plan" * 40
SIGNER = new_signer()


def context(tmp_path: Path) -> LoadContext:
    return LoadContext(H200, trusted(SIGNER), False, RecordingBackend(), DiskCache(tmp_path, H200), None,
                       request_deadline=5.0, revalidate_seconds=3600.0)


def pending() -> Pending:
    return Pending(KEY, CONV_SPEC, None)


def test_the_disk_step_runs_on_a_load_context_alone(tmp_path):
    c = context(tmp_path)
    record = make_record(KEY, H200, BLOB, SIGNER)
    assert c.disk.save(record, BLOB)
    p = pending()
    (plan,) = DiskStep(c).resolve([p]).values()
    assert plan.source == "disk" and c.verified[KEY] == (record, BLOB) and c.backend.deserialized == [BLOB]
    assert c.disk.revision(KEY) == record.revision  # a signed plan's revision is remembered


@pytest.mark.parametrize(("damage", "reason"), [(lambda b: b[:-1], "size"), (lambda b: b"X" + b[1:], "sha256")])
def test_a_damaged_disk_blob_is_refused_by_its_reason_dropped_and_its_record_learned(tmp_path, damage, reason):
    c = context(tmp_path)
    record = make_record(KEY, H200, BLOB, SIGNER)
    c.disk.save(record, BLOB)
    path = c.disk.blobs.path(record.blob_sha256)
    path.write_bytes(damage(BLOB))
    p = pending()
    assert DiskStep(c).resolve([p]) == {}
    assert c.stats.rejects == {reason: 1} and p.trail == [f"disk: rejected ({reason})"] and p.record == record
    assert c.disk.record(KEY) is None and not path.exists() and c.backend.deserialized == []


def test_a_disk_record_whose_blob_is_gone_is_a_miss_that_keeps_the_record(tmp_path):
    c = context(tmp_path)
    record = make_record(KEY, H200, BLOB, SIGNER)
    c.disk.save(record, BLOB)
    c.disk.blobs.delete(record.blob_sha256)
    p = pending()
    assert DiskStep(c).resolve([p]) == {} and p.trail == ["disk: no blob"] and c.stats.rejects == {}
    assert c.disk.record(KEY) == record  # evicted under us: the server's copy replaces the entry


class InMemory(StoreStep):
    """A step over any records source and blob store: here a dict and a :class:`MemoryBlobs`."""

    name = "in_memory"

    def __init__(self, context: LoadContext, records: dict[str, PlanRecord], blobs: MemoryBlobs) -> None:
        super().__init__(context)
        self.records, self.blobs, self.kept_keys = records, blobs, list[str]()

    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], MemoryBlobs]:
        return {p: self.records[p.key] for p in batch if p.key in self.records}, self.blobs

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:
        self.kept_keys.append(p.key)


def test_a_store_step_serves_any_records_source_and_blob_store(tmp_path):
    c, blobs = context(tmp_path), MemoryBlobs()
    record = make_record(KEY, H200, BLOB, SIGNER)
    step = InMemory(c, {KEY: record}, blobs)
    p = pending()
    assert step.resolve([p]) == {} and p.trail == ["in_memory: no blob"]
    blobs.put(record.blob_sha256, BLOB)
    (plan,) = step.resolve([pending()]).values()
    assert plan.source == "in_memory" and step.kept_keys == [KEY]
    unsigned = make_record(KEY, H200, BLOB)
    refused = pending()
    assert InMemory(c, {KEY: unsigned}, blobs).resolve([refused]) == {} and refused.refused == "unsigned"


def test_without_a_server_the_server_step_notes_it_and_asks_nothing(tmp_path):
    p = pending()
    assert ServerStep(context(tmp_path)).resolve([p]) == {} and p.trail == ["server: none configured"]


def test_received_blobs_are_checked_when_read_and_a_forgery_never_displaces_the_real_bytes():
    sha = hashlib.sha256(BLOB).hexdigest()
    received = ReceivedBlobs("https://plancache.example")
    received.add(sha, b"forged")
    assert received.size(sha) == len(b"forged") and received.get(sha) is None  # refused when read
    received.add(sha, BLOB)  # the right bytes replace the wrong ones
    received.add(sha, b"forged again")  # and stay
    assert received.get(sha) == BLOB and received.open("0" * 64) is None


def test_a_disk_blob_that_cannot_be_read_is_a_logged_miss(tmp_path, caplog, monkeypatch):
    c = context(tmp_path)
    record = make_record(KEY, H200, BLOB, SIGNER)
    c.disk.save(record, BLOB)

    def unreadable(sha256: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(c.disk.blobs, "open", unreadable)
    p = pending()
    assert DiskStep(c).resolve([p]) == {} and p.trail == ["disk: blob unreadable"] and c.stats.rejects == {}
    assert "cannot read the disk blob" in caplog.text and c.disk.record(KEY) == record
