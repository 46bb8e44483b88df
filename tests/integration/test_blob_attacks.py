"""The blob store never serves bytes that do not hash to their name, and the next publish of the right bytes repairs
them: a blob file replaced by a symlink, truncated or overwritten with other bytes of the same size, or a wrong file
planted before the first publish; two servers publishing one blob at once leave one whole copy.

Before plancache.blobs: ``GET /v1/blobs/{sha256}`` answered each damaged file with 200, ``ETag`` and an immutable
``Cache-Control`` (the symlink served the file it pointed at), resolve handed the bytes out, and a publish kept a
same-size wrong file (``put`` returned when the size matched)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from plancache.store import open_store
from tests.factories import stored_plans

from ..server_util import open_api

SMALL = b"\x02small plan" * 1000
LARGE = os.urandom(200_000)  # streamed by a server whose blob memory keeps items up to 1 KiB
MEMORY = {"small": {}, "large": {"blob_memory_bytes": 16 * 1024}}


def _path(store: Any, digest: str) -> Path:
    return store.blob_store.folder.root / digest[:2] / digest[2:4] / digest


def _served(api: Any, digest: str) -> bytes | None:
    """What ``GET /v1/blobs/{digest}`` delivered whole with 200; None for 404 or an answer cut off before its end."""
    try:
        r = api.client.get(f"/v1/blobs/{digest}", headers=api.reader)
    except RuntimeError as exc:  # the in-process client sees the answer fail where a socket would close
        assert "is damaged, its answer cut off" in str(exc)
        return None
    assert r.status_code in (200, 404), r.text
    return r.content if r.status_code == 200 else None


def _damage(path: Path, attack: str, tmp_path: Path) -> None:
    size = path.stat().st_size
    path.unlink()
    if attack == "symlink":
        secret = tmp_path / "passwd"
        secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
        path.symlink_to(secret)
    elif attack == "truncated":
        path.write_bytes(b"\0" * (size // 2))
    else:
        path.write_bytes(b"\0" * size)


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("attack", ["symlink", "truncated", "same size"])
def test_a_damaged_blob_file_is_never_served_and_the_next_publish_repairs_it(file_store, make_spec, make_plan, gpu_env,
                                                                             tmp_path, caplog, attack, size):
    blob = SMALL if size == "small" else LARGE
    key, spec = make_spec(0)
    file_store.put_spec(key, spec)
    meta, _ = make_plan(key, gpu_env, blob=blob)
    file_store.publish_plan(meta, blob)
    digest = meta.blob_sha256
    _damage(_path(file_store, digest), attack, tmp_path)

    with open_api(file_store, **MEMORY[size]) as api, caplog.at_level(logging.WARNING, logger="plancache.blobs"):
        assert _served(api, digest) is None
        (record, data), = stored_plans(file_store, gpu_env, [key])[0].values()
        assert data is None, "resolve hands out no damaged blob"
        assert digest in caplog.text and "treated as missing" in caplog.text
        file_store.publish_plan(meta, blob)  # the same plan published again
        assert _served(api, digest) == blob
    assert _path(file_store, digest).read_bytes() == blob and not _path(file_store, digest).is_symlink()


def test_a_wrong_file_planted_before_the_first_publish_is_replaced(file_store, make_spec, make_plan, gpu_env):
    key, spec = make_spec(0)
    file_store.put_spec(key, spec)
    meta, _ = make_plan(key, gpu_env, blob=SMALL)
    path = _path(file_store, meta.blob_sha256)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * len(SMALL))  # the right size
    file_store.publish_plan(meta, SMALL)
    with open_api(file_store) as api:
        assert _served(api, meta.blob_sha256) == SMALL


@pytest.mark.both_blob_stores
def test_two_servers_publishing_one_blob_at_once_leave_one_whole_copy(db_url, blob_store_url, make_spec, make_plan,
                                                                       gpu_env):
    """Two stores (two server processes' worth) on one database and one blob store publish the same blob for
    different keys at the same moment, four times over."""
    stores = [open_store(db_url, create=True, blob_store=blob_store_url) for _ in range(2)]
    try:
        blob, failures, keys = LARGE, [], []
        barrier = threading.Barrier(8)

        def publish(store: Any, i: int) -> None:
            key, spec = make_spec(i)
            try:
                store.put_spec(key, spec)
                barrier.wait()
                store.publish_plan(make_plan(key, gpu_env, blob=blob)[0], blob)
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                failures.append(exc)
            keys.append(key)

        threads = [threading.Thread(target=publish, args=(stores[i % 2], i)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        found, missing = stored_plans(stores[0], gpu_env, keys)
        assert missing == [] and {data for _, data in found.values()} == {blob}
        assert stores[1].get_blob(hashlib.sha256(blob).hexdigest()) == blob
    finally:
        for s in stores:
            s.close()
