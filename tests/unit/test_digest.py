"""Blob bytes read from a store carry the digest they were hashed to, so verify_blob does not hash them again; the
comparison with the record, the size check and every other step stay."""

from __future__ import annotations

import hashlib
import pickle
import types

import pytest

import plancache.blobs.base
import plancache.digest
from plancache.blobs import FolderBlobs, MemoryBlobs
from plancache.digest import Digested, sha256_of
from plancache.errors import IntegrityError, Reason, VerificationError
from plancache.verify import verify_blob
from tests.factories import CONV_SPEC, H200, make_meta

BLOB = b"a serialized plan" * 100
SHA = hashlib.sha256(BLOB).hexdigest()
KEY = CONV_SPEC.graph_key


def count_hashes(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> list[int]:
    """The sizes of the bytes ``module`` hashes from now on (its ``hashlib.sha256`` calls)."""
    calls: list[int] = []

    def counting(data: bytes = b"") -> hashlib._Hash:
        calls.append(len(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(module, "hashlib", types.SimpleNamespace(sha256=counting))
    return calls


@pytest.fixture
def hashes(monkeypatch):
    """How many times plancache.digest hashes bytes itself."""
    return count_hashes(monkeypatch, plancache.digest)


@pytest.mark.parametrize("store", ["folder", "memory"])
def test_a_blob_read_from_a_store_is_verified_without_hashing_it_again(store, tmp_path, hashes):
    blobs = FolderBlobs(tmp_path / "blobs") if store == "folder" else MemoryBlobs(1 << 20)
    blobs.put(SHA, BLOB)
    data = blobs.get(SHA)
    assert type(data) is Digested and data == BLOB and data.sha256 == SHA
    meta = make_meta(KEY, H200, BLOB)
    verify_blob(meta, data, what="plan", graph_key=KEY, environment=H200)
    assert hashes == []
    verify_blob(meta, bytes(data), what="plan", graph_key=KEY, environment=H200)
    assert hashes == [len(BLOB)]  # plain bytes are hashed


def test_the_carried_digest_is_still_compared_with_the_record_and_the_size_checked():
    other = make_meta(KEY, H200, b"other bytes" * 154 + b"x" * 6)  # another digest, the same size as BLOB
    assert other.blob_size == len(BLOB)
    with pytest.raises(VerificationError) as exc:
        verify_blob(other, Digested(BLOB, SHA), what="plan")
    assert exc.value.reason == Reason.SHA256
    with pytest.raises(VerificationError) as exc:
        verify_blob(make_meta(KEY, H200, BLOB + b"!"), Digested(BLOB, SHA), what="plan")
    assert exc.value.reason == Reason.SIZE


def test_copies_are_plain_bytes_hashed_again():
    d = Digested(BLOB, SHA)
    for copy in (pickle.loads(pickle.dumps(d)), d[:], d + b""):
        assert type(copy) is bytes and copy == BLOB
    assert sha256_of(BLOB) == SHA == sha256_of(d)


@pytest.mark.parametrize("store", ["folder", "memory"])
def test_a_store_takes_digested_bytes_without_hashing_them_again_and_checks_any_other(store, tmp_path, monkeypatch):
    blobs = FolderBlobs(tmp_path / "blobs") if store == "folder" else MemoryBlobs(1 << 20)
    calls = count_hashes(monkeypatch, plancache.blobs.base)
    blobs.put(SHA, Digested(BLOB, SHA))
    assert calls == []  # (a folder hashes what it already holds under that name first: nothing here)
    with pytest.raises(IntegrityError):  # checked as any bytes
        blobs.put(hashlib.sha256(b"other").hexdigest(), Digested(BLOB, SHA))  # a digest that is not the name
    before = len(calls)
    other = b"other bytes"
    blobs.put(hashlib.sha256(other).hexdigest(), other)
    assert len(calls) > before  # plain bytes are hashed while written
    monkeypatch.undo()
    assert blobs.get(SHA) == BLOB
