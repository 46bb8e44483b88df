"""A file blob store that cannot take a write (full disk, unwritable folder) answers a blob upload with
507 ``insufficient_storage``, logs one line without a traceback, and leaves nothing half-written: no blob
file (not even its temporary file) and no plan record. Before: 500 ``internal_error``, the traceback logged
as an unhandled error (and by uvicorn again)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.factories import H200, make_meta
from tests.server_util import open_api, put_blob, upload_json


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def _refuse(store: Any, make_spec: Any, caplog: pytest.LogCaptureFixture, why: str) -> None:
    key, spec = make_spec(0)
    blob = b"plan bytes" * 1000
    with open_api(store) as api:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            r = put_blob(api.client, blob, api.admin, check=False)
        assert api.client.put("/v1/plans", json=upload_json(make_meta(key, H200, blob), spec),
                              headers=api.admin).status_code == 404  # its blob is not stored
    assert r.status_code == 507, r.text
    error = r.json()["error"]
    assert error["code"] == "insufficient_storage" and why in error["message"] and "nothing was stored" in error["message"]
    assert store.get_plan(key, H200) is None
    assert _files(store.blob_store.folder.root) == []
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert [rec.levelname for rec in caplog.records if "blob store" in rec.getMessage()] == ["ERROR"]


def test_a_full_disk_is_507_with_nothing_half_written(file_store: Any, make_spec: Any, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    real_fsync = os.fsync

    def full(fd: int) -> None:  # the temporary blob file is written, then the disk is found full
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    _refuse(file_store, make_spec, caplog, "ENOSPC")


def test_an_unwritable_blob_folder_is_507(file_store: Any, make_spec: Any, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    root: Path = file_store.blob_store.folder.root
    if os.geteuid() == 0:  # root writes whatever the mode says: refuse the folder's writes instead
        real_mkdir = Path.mkdir

        def denied(self: Path, *args: Any, **kwargs: Any) -> None:
            if self.is_relative_to(root):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", denied)
    else:
        root.chmod(0o500)
    try:
        _refuse(file_store, make_spec, caplog, "EACCES")
    finally:
        root.chmod(0o700)


def test_other_os_errors_stay_internal_errors(file_store: Any, make_spec: Any, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Only the storage errnos are 507: any other OSError is a bug, answered 500 with its traceback logged."""
    def broken(fd: int) -> None:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(os, "fsync", broken)
    key, spec = make_spec(0)
    blob = b"plan bytes"
    with open_api(file_store) as api, caplog.at_level(logging.ERROR):
        r = put_blob(api.client, blob, api.admin, check=False)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["connection"] == "close"
    assert any(rec.exc_info for rec in caplog.records)


def test_a_blob_the_store_cannot_read_is_503_not_insufficient_storage(file_store: Any, make_spec: Any,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A blob file that cannot be read (another replica's user wrote it 0600, an NFS permission problem) was 507
    "cannot store this now; nothing was stored" on GET and resolve; a read is 503 ``blob_store_unavailable``."""
    key, spec = make_spec(0)
    blob = b"plan bytes" * 1000
    file_store.put_spec(key, spec)
    file_store.publish_plan(meta := make_meta(key, H200, blob), blob)
    sha = meta.blob_sha256
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(sha):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with open_api(file_store) as api, caplog.at_level(logging.INFO):
        r = api.client.get(f"/v1/blobs/{sha}", headers=api.reader)
        resolve = api.client.post("/v1/plans/resolve", headers=api.reader, json={
            "environment": H200.model_dump(mode="json"), "graph_keys": [key], "include_blobs": True})
    for answer in (r, resolve):
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "blob_store_unavailable", answer.text
        assert "cannot be read now (EACCES" in answer.json()["error"]["message"] and "Retry-After" in answer.headers
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"



def test_a_blob_file_removed_while_it_is_written_is_503_retry(file_store: Any, make_spec: Any,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Before: a `plans gc` with no grace deleting an upload's temporary file (found by an audit with two replicas)
    made the upload's rename fail with FileNotFoundError: a 500 and a traceback. Now 503, retry."""
    real_replace = os.replace

    def vanished(src: Any, dst: Any) -> None:  # gc deleted the temporary file just before the rename
        os.unlink(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", vanished)
    with open_api(file_store) as api, caplog.at_level(logging.INFO):
        r = put_blob(api.client, b"plan bytes" * 1000, api.admin, check=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "blob_store_unavailable", r.text
    assert "removed while it was written" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
    assert _files(file_store.blob_store.folder.root) == []
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


def test_a_blob_shard_that_cannot_be_a_folder_is_507(file_store: Any, make_spec: Any,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A file where a blob's shard folder goes (``ab/``): main 4d1a308 answered 500 ``internal_error`` with a
    traceback (ENOTDIR, EEXIST); it is 507 naming the path, one log line, and the blob reads as missing."""
    import hashlib

    blob = b"plan bytes" * 1000
    digest = hashlib.sha256(blob).hexdigest()
    root: Path = file_store.blob_store.folder.root
    (root / digest[:2]).write_bytes(b"in the way")
    with open_api(file_store) as api, caplog.at_level(logging.INFO):
        r = put_blob(api.client, blob, api.admin, check=False)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "insufficient_storage" and "in the way" in r.json()["error"]["message"]
        assert api.client.get(f"/v1/blobs/{digest}", headers=api.admin).status_code == 404
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
