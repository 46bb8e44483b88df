"""The blob layer (:mod:`plancache.blobs`): one contract suite over every writable backend (a folder, memory, S3
through moto's standalone server), the attacks on a folder and a bucket, presigned URLs and the URL factory."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache import errors
from plancache.blobs import (
    CHUNK_BYTES,
    BlobReader,
    BlobStore,
    FolderBlobs,
    MemoryBlobs,
    ObjectStoreBlobs,
    blob_url_kind,
    open_blobs,
)
from plancache.blobs.base import checked


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


SMALL = b"\x01plan bytes" * 300
LARGE = os.urandom(2 * CHUNK_BYTES + 12345)  # three chunks


@pytest.fixture(params=["folder", "memory", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    """A writable store of each backend, empty."""
    if request.param == "folder":
        return FolderBlobs(tmp_path / "blobs")
    if request.param == "memory":
        return MemoryBlobs(64 * 1024 * 1024)
    store = open_blobs(request.getfixturevalue("s3_blob_url"))
    assert isinstance(store, ObjectStoreBlobs)
    return store


def stored(store: BlobReader, data: bytes) -> bool:
    return store.has(sha(data)) or store.get(sha(data)) is not None


# ------------------------------------------------------------------ the contract, on every backend


def test_put_get_size_open_delete(blobs):
    digest = sha(SMALL)
    assert not blobs.has(digest) and blobs.size(digest) is None and blobs.get(digest) is None
    assert blobs.open(digest) is None
    blobs.put(digest, SMALL)
    blobs.put(digest, SMALL)  # idempotent
    assert blobs.has(digest) and blobs.size(digest) == len(SMALL) and blobs.get(digest) == SMALL
    with blobs.open(digest) as stream:
        assert stream.size == len(SMALL) and b"".join(stream) == SMALL
    blobs.delete(digest)
    blobs.delete(digest)  # nothing to do
    assert not blobs.has(digest) and blobs.get(digest) is None


def test_streams_in_and_out(blobs):
    digest = sha(LARGE)
    blobs.put(digest, io.BytesIO(LARGE))
    with blobs.open(digest) as stream:
        pieces = list(stream)
    assert b"".join(pieces) == LARGE and stream.size == len(LARGE)
    assert blobs.get(digest) == LARGE


@pytest.mark.parametrize("source", ["bytes", "stream"])
def test_a_put_whose_bytes_do_not_hash_to_the_name_stores_nothing(blobs, source):
    digest = sha(LARGE)
    wrong = LARGE[:-1] + b"!"
    with pytest.raises(errors.IntegrityError, match=f"not {digest}"):
        blobs.put(digest, wrong if source == "bytes" else io.BytesIO(wrong))
    assert not stored(blobs, LARGE)
    with pytest.raises(errors.IntegrityError, match="0 bytes"):
        blobs.put(sha(b""), b"")  # no blob is empty
    blobs.put(digest, LARGE)
    with pytest.raises(errors.IntegrityError):  # the caller's bytes are checked even when the blob is there
        blobs.put(digest, wrong)
    assert blobs.get(digest) == LARGE


def test_names_must_be_sha256_digests(blobs):
    for bad in ("../" + sha(SMALL)[3:], sha(SMALL).upper(), "", sha(SMALL)[:63], sha(SMALL) + "\n"):
        with pytest.raises(ValueError, match="sha256"):
            blobs.get(bad)
        with pytest.raises(ValueError, match="sha256"):
            blobs.put(bad, SMALL)


def test_concurrent_puts_of_one_blob_leave_one_whole_copy(blobs, tmp_path):
    digest, failures = sha(LARGE), []

    def put() -> None:
        try:
            blobs.put(digest, LARGE)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            failures.append(exc)

    threads = [threading.Thread(target=put) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and blobs.get(digest) == LARGE
    if isinstance(blobs, FolderBlobs):
        assert [p for p in blobs.root.rglob("*") if p.is_file()] == [blobs.path(digest)], "no temporary file left"


# ------------------------------------------------------------------ the check while streaming


def test_a_checked_stream_withholds_its_last_chunk_until_the_whole_hashes_right():
    parts = [b"a" * 10, b"b" * 10, b"c" * 10]
    assert list(checked(sha(b"".join(parts)), iter(parts))) == parts
    seen = []
    with pytest.raises(errors.IntegrityError):
        for piece in checked(sha(b"other"), iter(parts)):
            seen.append(piece)
    assert seen == parts[:2], "the last chunk never leaves a wrong blob"


# ------------------------------------------------------------------ attacks on a folder


@pytest.fixture
def folder(tmp_path: Path) -> tuple[FolderBlobs, str, Path]:
    store = FolderBlobs(tmp_path / "blobs")
    digest = sha(LARGE)
    store.put(digest, LARGE)
    return store, digest, store.path(digest)


def _damaged(store: BlobStore, digest: str, caplog: Any, what: str) -> None:
    with caplog.at_level(logging.WARNING, logger="plancache.blobs"):
        assert store.get(digest) is None, "damaged bytes are treated as missing"
    assert what in caplog.text and digest in caplog.text
    stream = store.open(digest)
    if stream is not None:
        with stream, pytest.raises(errors.IntegrityError):
            b"".join(stream)
    store.put(digest, LARGE)  # the next put of the right bytes repairs it
    assert store.get(digest) == LARGE


def test_a_symlink_in_place_of_a_blob_is_never_followed(folder, tmp_path, caplog):
    store, digest, path = folder
    secret = tmp_path / "passwd"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    path.unlink()
    path.symlink_to(secret)
    assert store.size(digest) is None and store.open(digest) is None
    _damaged(store, digest, caplog, "symlink")
    assert not path.is_symlink() and secret.read_bytes().startswith(b"root:"), "the target is left alone"


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_a_damaged_blob_file_is_never_returned(folder, caplog, damage):
    store, digest, path = folder
    path.write_bytes(LARGE[:1000] if damage == "truncated" else bytes(len(LARGE)))
    _damaged(store, digest, caplog, "damaged")


def test_a_wrong_file_planted_before_the_first_put_is_replaced(tmp_path, caplog):
    store, digest = FolderBlobs(tmp_path / "blobs"), sha(LARGE)
    path = store.path(digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * len(LARGE))  # the right size: the put before this change kept it
    store.put(digest, LARGE)
    assert path.read_bytes() == LARGE


def test_a_fifo_in_place_of_a_blob_does_not_block_a_read(folder, caplog):
    store, digest, path = folder
    path.unlink()
    os.mkfifo(path)
    assert store.size(digest) is None and store.open(digest) is None
    _damaged(store, digest, caplog, "not a regular file")


def test_folder_files_are_readable_by_every_replica_and_durable(folder):
    store, digest, path = folder
    assert path == store.root / digest[:2] / digest[2:4] / digest and path.stat().st_mode & 0o777 == 0o644


def test_a_failed_rename_leaves_no_file(tmp_path, monkeypatch):
    store = FolderBlobs(tmp_path)

    def crash(*args: object) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="rename failed"):
        store.put(sha(SMALL), SMALL)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_folder_opened_without_create_is_made_by_its_first_put(tmp_path):
    root = tmp_path / "not" / "yet"
    store = FolderBlobs(root, mode=0o600, create=False)
    assert not root.exists() and store.get(sha(SMALL)) is None and list(store.files()) == []
    store.put(sha(SMALL), SMALL)
    assert store.get(sha(SMALL)) == SMALL and store.path(sha(SMALL)).stat().st_mode & 0o777 == 0o600


def test_files_lists_blobs_and_temporaries_with_their_times_and_nothing_else(tmp_path):
    store, digest = FolderBlobs(tmp_path / "blobs"), sha(SMALL)
    store.put(digest, SMALL)
    os.utime(store.path(digest), (1000.0, 1000.0))
    shard = store.path(digest).parent
    temporary = shard / f".{digest}.crashed.tmp"
    temporary.write_bytes(b"half")
    (shard / "notes.txt").write_bytes(b"keep")  # another name
    (store.root / "00" / "00").mkdir(parents=True)
    (store.root / "00" / "00" / digest).write_bytes(SMALL)  # the wrong shard
    (shard / sha(LARGE)).symlink_to(store.path(digest))  # a symlink
    listed = sorted(store.files(), key=lambda f: f.temporary)
    assert [(f.path, f.sha256, f.size, f.temporary) for f in listed] == [
        (store.path(digest), digest, len(SMALL), False), (temporary, digest, 4, True)]
    assert listed[0].mtime == 1000.0


# ------------------------------------------------------------------ memory


def test_memory_keeps_at_most_its_byte_budget_least_recently_used_first():
    store = MemoryBlobs(max_bytes=3 * len(SMALL))
    blobs = [SMALL + bytes([i]) for i in range(4)]
    store.put(sha(blobs[0]), blobs[0])
    store.put(sha(blobs[1]), blobs[1])
    store.get(sha(blobs[0]))  # used: blobs[1] is now the least recently used
    store.put(sha(blobs[2]), blobs[2])
    assert [store.has(sha(b)) for b in blobs[:3]] == [True, False, True]
    with pytest.raises(ValueError, match="more than this memory store holds"):
        store.put(sha(LARGE), LARGE)
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryBlobs(-1)
    small_only = MemoryBlobs(max_bytes=3 * len(SMALL), max_item=len(SMALL))
    with pytest.raises(ValueError, match="more than this memory store holds"):
        small_only.put(sha(blobs[0]), blobs[0])


# ------------------------------------------------------------------ S3 (moto)


@pytest.fixture
def s3(s3_blob_url: str) -> ObjectStoreBlobs:
    store = open_blobs(s3_blob_url)
    assert isinstance(store, ObjectStoreBlobs) and store.url == s3_blob_url
    return store


def _raw_put(s3_blob_url: str, key: str, data: bytes) -> None:
    """Write an object behind the store's back (as another tool with the bucket's credentials could)."""
    import obstore
    from obstore.store import from_url

    obstore.put(from_url(s3_blob_url), key, data)


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_a_damaged_object_is_never_returned_and_the_next_put_repairs_it(s3, s3_blob_url, caplog, damage):
    digest = sha(LARGE)
    s3.put(digest, LARGE)
    _raw_put(s3_blob_url, f"{digest[:2]}/{digest[2:4]}/{digest}",
             LARGE[:1000] if damage == "truncated" else bytes(len(LARGE)))
    _damaged(s3, digest, caplog, "damaged")


def test_objects_use_the_folder_layout_under_the_prefix(s3, moto_s3, s3_blob_url):
    digest = sha(SMALL)
    s3.put(digest, SMALL)
    bucket = s3_blob_url.split("/")[2]
    listing = httpx.get(f"{moto_s3}/{bucket}?list-type=2").text
    assert f"<Key>blobs/{digest[:2]}/{digest[2:4]}/{digest}</Key>" in listing


def test_a_presigned_url_gets_the_blob_without_credentials_until_it_expires(s3, moto_s3):
    digest = sha(SMALL)
    s3.put(digest, SMALL)
    url = s3.presign(digest, timedelta(seconds=60))
    assert url.startswith(moto_s3) and "X-Amz-Expires=60" in url and "testing" not in url.split("Credential=")[0]
    assert httpx.get(url).content == SMALL
    for bad in (timedelta(0), timedelta(days=8)):
        with pytest.raises(ValueError, match="expires"):
            s3.presign(digest, bad)


def test_a_bucket_that_does_not_exist_is_an_error_not_a_miss(s3_blob_url):
    store = open_blobs(s3_blob_url.replace("plancache-", "absent-"))
    with pytest.raises(Exception, match="(?i)bucket"):
        store.put(sha(SMALL), SMALL)


# ------------------------------------------------------------------ URLs


def test_open_blobs_by_url(tmp_path, s3_blob_url):
    folder = open_blobs((tmp_path / "a folder").as_uri())
    assert isinstance(folder, FolderBlobs) and folder.root == tmp_path / "a folder" and folder.root.is_dir()
    memory = open_blobs("memory://?max_bytes=1000")
    assert isinstance(memory, MemoryBlobs) and memory.max_bytes == 1000
    assert isinstance(open_blobs("memory://"), MemoryBlobs)
    assert isinstance(open_blobs(s3_blob_url), ObjectStoreBlobs)
    assert isinstance(open_blobs("s3://bucket"), ObjectStoreBlobs)
    assert isinstance(open_blobs("gs://bucket/prefix"), ObjectStoreBlobs)  # obstore's, untested beyond this


def test_an_object_store_the_environment_cannot_reach_is_named(monkeypatch):
    for name in [n for n in os.environ if n.startswith("AZURE_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="az://container/p: .*Account must be specified"):
        open_blobs("az://container/p")


def test_an_unreachable_endpoint_is_an_os_error_after_few_retries(monkeypatch, s3_blob_url):
    from ..live_server import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    store = open_blobs(s3_blob_url)
    with pytest.raises(OSError, match=f"{s3_blob_url}: .*error sending request"):
        store.get(sha(SMALL))
    assert [blob_url_kind(u) for u in ("file:///x", "memory://", "s3://b/p", "gs://b", "az://c/p")] == \
        ["file", "memory", "object", "object", "object"]


@pytest.mark.parametrize(("url", "message"), [
    ("file://relative/path", "file:///absolute/path"),
    ("file:///x?y=1", "file:///absolute/path"),
    ("memory://?max_bytes=0", r"max_bytes=N \(N >= 1\)"),
    ("memory://?max_bytes=x", "max_bytes=N"),
    ("memory://?other=1", "max_bytes=N"),
    ("s3://", "s3://bucket/optional/prefix"),
    ("s3://bucket/a?versionId=1", "s3://bucket/optional/prefix"),
    ("s3://AKIA:secret@bucket/p", "no credentials"),
    ("s3://bucket:9000/p", "AWS_ENDPOINT_URL"),
    ("ftp://host/x", "file:///absolute/path, memory:// or s3://bucket/prefix"),
    ("database", "s3://bucket/prefix"),
    ("/var/blobs", "file:///absolute/path"),
    ("https://host", "memory:// or s3://bucket/prefix"),  # a server's blobs are read by the client, not here
])
def test_a_bad_url_is_named_with_the_forms_that_work(url, message):
    with pytest.raises(ValueError, match=message) as info:
        blob_url_kind(url)
    assert "secret" not in str(info.value)
