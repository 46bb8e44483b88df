"""The client's disk cache: layout, atomic writes, damaged entries."""

from __future__ import annotations

import os

import pytest

from plancache.client.cache import DiskCache
from plancache.errors import VerificationError
from tests.client_fakes import H200, OTHER_GPU, make_record

KEY = "c" * 64
BLOB = b"plan-bytes" * 50


def test_save_then_load_round_trips_under_the_environment_folder(tmp_path):
    cache = DiskCache(tmp_path, H200)
    record = make_record(KEY, H200, BLOB)
    assert cache.save(record, BLOB)
    folder = tmp_path / H200.env_id
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{KEY}.json", f"{record.blob_sha256}.blob"])
    loaded, blob = cache.load(KEY)
    assert loaded == record and blob == BLOB
    # Another environment sees nothing.
    assert DiskCache(tmp_path, OTHER_GPU).load(KEY) is None


def test_absent_entries_and_a_record_without_its_blob_are_misses(tmp_path):
    cache = DiskCache(tmp_path, H200)
    assert cache.load(KEY) is None
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    (tmp_path / H200.env_id / f"{record.blob_sha256}.blob").unlink()
    assert cache.load(KEY) is None


def test_a_record_that_does_not_parse_is_malformed(tmp_path):
    cache = DiskCache(tmp_path, H200)
    cache.save(make_record(KEY, H200, BLOB), BLOB)
    path = tmp_path / H200.env_id / f"{KEY}.json"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(VerificationError) as exc:
        cache.load(KEY)
    assert exc.value.reason == "malformed"


def test_a_damaged_blob_is_returned_as_is_for_the_caller_to_verify(tmp_path):
    cache = DiskCache(tmp_path, H200)
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    (tmp_path / H200.env_id / f"{record.blob_sha256}.blob").write_bytes(BLOB[:10])
    _, blob = cache.load(KEY)
    assert blob == BLOB[:10]


def test_discard_removes_the_record_and_the_blob(tmp_path):
    cache = DiskCache(tmp_path, H200)
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    cache.discard(KEY, record.blob_sha256)
    assert list((tmp_path / H200.env_id).iterdir()) == []
    cache.discard(KEY, record.blob_sha256)  # absent: no error


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path, H200)
    old = make_record(KEY, H200, BLOB)
    cache.save(old, BLOB)
    new_blob = b"newer-plan" * 80
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".json"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    assert cache.save(make_record(KEY, H200, new_blob), new_blob) is False
    monkeypatch.undo()
    # The old record is still whole and still points at its own (intact) blob; no temp files remain.
    record, blob = cache.load(KEY)
    assert record == old and blob == BLOB
    assert not [p for p in (tmp_path / H200.env_id).iterdir() if p.name.endswith(".tmp")]


def test_an_unwritable_folder_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert DiskCache(blocker, H200).save(make_record(KEY, H200, BLOB), BLOB) is False


def test_graph_keys_are_checked_before_they_become_paths(tmp_path):
    with pytest.raises(ValueError):
        DiskCache(tmp_path, H200).load("../../etc/passwd")
