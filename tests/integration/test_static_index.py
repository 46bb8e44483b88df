"""The signed static index (plancache.index, plancache.client.index): published from a store into a folder, served by a
plain static HTTP server, read by a fresh client with no API call; tampered, expired, replayed and foreign indexes
refused with the reason and a message saying so."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from bench.workload import workload
from plancache.client import PlanCache
from plancache.client.index import INDEX_VERSION_KEY
from plancache.errors import PlanMiss, Reason, VerificationError
from plancache.index import (
    FolderTarget,
    build_index,
    open_root,
    open_shard,
    prefix_length,
    publish_index,
    root_path,
    shard_path,
)
from plancache.store import open_store
from tests.client_fakes import RecordingBackend
from tests.factories import H200, OTHER_GPU, make_meta, new_signer, patient, trusted

SPECS = workload()[:12]
SIGNER = new_signer()


def blob_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest() * 8


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the index of :data:`SPECS`' plans on H200 (shards of at most 2 records) and their blobs; the
    store that published it is at ``../store.db``."""
    base = tmp_path_factory.mktemp("index")
    with open_store(f"sqlite:///{base / 'store.db'}", create=True) as store:
        for spec in SPECS:
            store.put_spec(spec.graph_key, spec.to_json())
            store.publish_plan(make_meta(spec.graph_key, H200, blob_of(spec.graph_key), SIGNER), blob_of(spec.graph_key))
        done = publish_index(store, H200, FolderTarget(base / "pub"), SIGNER, shard_plans=2)
    assert (done.plans, done.blobs_copied, done.shards) == (12, 12, done.shards_written)
    assert done.shards > 1
    return base / "pub"


@pytest.fixture
def folder(published: Path, tmp_path: Path) -> Path:
    """A copy of the published folder this test may change."""
    return Path(shutil.copytree(published, tmp_path / "pub"))


class Static(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # connections waiting to be accepted (5 by default: a burst of 8 GETs overflowed it)


class Counted(http.server.SimpleHTTPRequestHandler):
    """A plain static file server's handler (keep-alive) that keeps the paths it was asked for."""

    protocol_version = "HTTP/1.1"
    asked: list[str]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.asked.append(self.path)
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.asked.append(self.path)
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(folder)``: the URL of a static HTTP server of ``folder`` and the list of paths asked of it."""
    servers = []

    def start(folder: Path) -> tuple[str, list[str]]:
        asked: list[str] = []
        handler = type("Handler", (Counted,), {"asked": asked})
        httpd = Static(("127.0.0.1", 0), partial(handler, directory=str(folder)))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", asked

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def client(tmp_path: Path, index_url: str, server_url: str = "", **options: Any) -> PlanCache:
    """A replay-only client of the index at ``index_url``, :func:`~tests.factories.patient`."""
    return PlanCache(server_url, index_url=index_url, trusted_keys=trusted(SIGNER), cache_dir=tmp_path / "cache",
                     backend=RecordingBackend(), mode="replay_only", **patient(options))


def test_a_fresh_client_loads_every_plan_from_the_static_index_with_no_api_call(folder, tmp_path, serve):
    index_url, asked = serve(folder)
    api_url, api_asked = serve(tmp_path)  # stands for the API server: any request to it is counted
    with client(tmp_path, index_url, api_url) as cache:
        plans = cache.prefetch(SPECS)
        stats = cache.stats()
    assert len(plans) == len(SPECS) and {p.source for p in plans.values()} == {"index"}
    assert stats.hits == {"index": len(SPECS)} and stats.blob_sources == {"index": len(SPECS)} and not stats.rejects
    assert api_asked == []
    root = json.loads((folder / root_path(H200.env_id)).read_text())
    shards = {root["header"]["prefix_length"] and s.graph_key[:root["header"]["prefix_length"]] for s in SPECS}
    assert asked.count(f"/{root_path(H200.env_id)}") == 1
    assert sum("/shards/" in a for a in asked) == len(shards) and len(asked) == 1 + len(shards) + len(SPECS)
    # the plans were kept on disk: the next process reads neither the index nor the API
    asked.clear()
    with client(tmp_path, index_url, api_url) as cache:
        assert {p.source for p in cache.prefetch(SPECS).values()} == {"disk"}
    assert asked == [] and api_asked == []


def test_a_named_set_is_one_shard_read_first_and_other_keys_are_read_by_prefix(published, tmp_path, serve):
    folder = tmp_path / "pub"
    app = [s.graph_key for s in SPECS[:8]]
    with open_store(f"sqlite:///{published.parent / 'store.db'}") as store:
        done = publish_index(store, H200, FolderTarget(folder), SIGNER, shard_plans=1,
                             sets={"app": [*app, "0" * 64], "other": app[:1]})
    assert done.sets_missing == {"app": 1}
    index_url, asked = serve(folder)
    with client(tmp_path, index_url, index_sets="app, missing-set") as cache:
        assert {p.source for p in cache.prefetch(SPECS[:8]).values()} == {"index"}
        assert [a for a in asked if "/shards/" in a] == [f"/{shard_path(H200.env_id, set_shard(folder, 'app'))}"]
        asked.clear()
        cache.plan(SPECS[8])  # outside the set: its prefix shard
        assert sum("/shards/" in a for a in asked) == 1 and cache.stats().hits == {"index": 9}


def set_shard(folder: Path, name: str) -> str:
    root = json.loads((folder / root_path(H200.env_id)).read_text())
    return next(s["sha256"] for s in root["shards"] if s.get("set") == name)


def test_a_bad_set_name_is_refused_when_the_cache_is_made(tmp_path):
    with pytest.raises(ValueError, match="index sets"):
        client(tmp_path, "http://127.0.0.1:9", index_sets="ok,no/slash")


def test_a_key_the_index_lacks_goes_on_to_the_server_and_is_noted(folder, tmp_path, serve):
    index_url, _ = serve(folder)
    other = workload()[20]
    with client(tmp_path, index_url) as cache, pytest.raises(PlanMiss) as miss:
        cache.prefetch(SPECS[:1])
        cache.plan(other)
    assert "index: not in the index" in miss.value.message and "server: none configured" in miss.value.message
    assert cache.stats().hits == {"index": 1}


def test_a_file_url_serves_the_index_as_http_does(folder, tmp_path):
    with client(tmp_path, folder.as_uri()) as cache:
        assert {p.source for p in cache.prefetch(SPECS).values()} == {"index"}


def refused(tmp_path: Path, index_url: str, reason: str) -> str:
    with client(tmp_path, index_url) as cache, pytest.raises(PlanMiss) as miss:
        cache.plan(SPECS[0])
    assert cache.stats().rejects == {reason: 1} and cache.stats().hits == {}
    return miss.value.message


def test_a_tampered_root_is_refused(folder, tmp_path, serve):
    path = folder / root_path(H200.env_id)
    doc = json.loads(path.read_text())
    doc["header"]["expires"] = "2999-01-01T00:00:00Z"  # a frozen index made to last
    path.write_text(json.dumps(doc))
    message = refused(tmp_path, serve(folder)[0], "bad_signature")
    assert "index refused (bad_signature)" in message and "does not match its signed statement" in message


def test_a_root_signed_by_an_untrusted_key_is_refused(published, tmp_path, serve):
    folder = tmp_path / "pub"
    (folder / "index" / H200.env_id).mkdir(parents=True)
    record = make_meta(SPECS[0].graph_key, H200, blob_of(SPECS[0].graph_key), SIGNER)
    root, _ = build_index(H200, [record_of(record)], new_signer(), version=1)
    (folder / root_path(H200.env_id)).write_bytes(root)
    assert "index refused (unknown_signer)" in refused(tmp_path, serve(folder)[0], "unknown_signer")


def record_of(meta: Any) -> Any:
    from plancache.protocol import PlanRecord

    return PlanRecord(**meta.model_dump(), env_id=meta.environment.env_id, created_at=datetime.now(UTC))


def test_a_tampered_shard_is_refused_by_its_sha256(folder, tmp_path, serve):
    index_url, _ = serve(folder)
    root = json.loads((folder / root_path(H200.env_id)).read_text())
    key = SPECS[0].graph_key
    ref = next(s for s in root["shards"] if key.startswith(s["prefix"]))
    shard_file = folder / "index" / H200.env_id / "shards" / f"{ref['sha256']}.json"
    shard_file.write_bytes(shard_file.read_bytes().replace(b"w-test", b"w-evil"))
    with client(tmp_path, index_url) as cache, pytest.raises(PlanMiss) as miss:
        cache.plan(SPECS[0])
    assert "index: shard refused (sha256)" in miss.value.message and cache.stats().hits == {}


def test_a_tampered_blob_is_refused_and_never_loaded(folder, tmp_path, serve):
    key = SPECS[0].graph_key
    blob = hashlib.sha256(blob_of(key)).hexdigest()
    (folder / blob[:2] / blob[2:4] / blob).write_bytes(b"X" * len(blob_of(key)))
    with client(tmp_path, serve(folder)[0]) as cache, pytest.raises(PlanMiss):
        cache.prefetch(SPECS[:1])
    assert cache.stats().rejects == {"sha256": 1} and cache._backend.deserialized == []  # type: ignore[attr-defined]


def test_an_expired_root_is_refused(published, tmp_path, serve):
    folder = tmp_path / "pub"
    with open_store(f"sqlite:///{published.parent / 'store.db'}") as store:
        publish_index(store, H200, FolderTarget(folder), SIGNER, now=datetime.now(UTC) - timedelta(days=8))
    message = refused(tmp_path, serve(folder)[0], "expired")
    assert "index refused (expired)" in message and "expired at" in message


def test_a_replayed_older_root_is_refused_once_a_newer_one_was_accepted(published, folder, tmp_path, serve):
    path = folder / root_path(H200.env_id)
    old = path.read_bytes()
    with open_store(f"sqlite:///{published.parent / 'store.db'}") as store:
        publish_index(store, H200, FolderTarget(folder), SIGNER)
    index_url, _ = serve(folder)
    with client(tmp_path, index_url) as cache:  # accepts the newer root
        cache.prefetch(SPECS[:1])
        newer = json.loads(path.read_text())["header"]["version"]
        assert cache.disk.revision(INDEX_VERSION_KEY) == newer > json.loads(old)["header"]["version"]
    path.write_bytes(old)  # a mirror or an attacker serves the older root again
    with client(tmp_path, index_url) as cache, pytest.raises(PlanMiss) as miss:
        cache.plan(SPECS[1])  # not on disk: the index is asked
    assert cache.stats().rejects == {"revision": 1}
    assert "index refused (revision)" in miss.value.message and "older than version" in miss.value.message


def test_an_index_record_older_than_the_hosts_revision_is_refused(folder, tmp_path, serve):
    with client(tmp_path, serve(folder)[0]) as cache:
        cache.disk.accept_revision(SPECS[0].graph_key, 2**62, background=False)
        with pytest.raises(PlanMiss):
            cache.prefetch(SPECS[:1])
        assert cache.stats().rejects == {"revision": 1}


def test_another_environments_root_is_refused(published, tmp_path, serve):
    folder = tmp_path / "pub"
    (folder / "index" / H200.env_id).mkdir(parents=True)
    root, _ = build_index(OTHER_GPU, [], SIGNER, version=1)
    (folder / root_path(H200.env_id)).write_bytes(root)
    assert "index refused (environment)" in refused(tmp_path, serve(folder)[0], "environment")


def test_no_index_published_for_the_environment_is_noted(tmp_path, serve):
    (tmp_path / "empty").mkdir()
    with client(tmp_path, serve(tmp_path / "empty")[0]) as cache, pytest.raises(PlanMiss) as miss:
        cache.plan(SPECS[0])
    assert "index: no index published for this environment" in miss.value.message


def test_open_root_checks_in_order_and_names_the_problem():
    root, _ = build_index(H200, [], SIGNER, version=5)
    keys = trusted(SIGNER)
    assert open_root(root, keys, H200, min_version=5).header.version == 5
    for data, trust, kwargs, reason in [
        (b"{", keys, {}, Reason.MALFORMED),
        (b'{"format": "other"}', keys, {}, Reason.MALFORMED),
        (root, trusted(), {}, Reason.NO_TRUSTED_KEYS),
        (root, keys, {"min_version": 6}, Reason.REVISION),
        (root, keys, {"now": datetime.now(UTC) + timedelta(days=8)}, Reason.EXPIRED),
    ]:
        with pytest.raises(VerificationError) as exc:
            open_root(data, trust, H200, **kwargs)
        assert exc.value.reason == reason, exc.value.message
    with pytest.raises(VerificationError) as exc:
        open_root(root, keys, OTHER_GPU)
    assert exc.value.reason == Reason.ENVIRONMENT


def test_a_shard_holds_native_timings_and_leaves_an_empty_set_out():
    """A record's native kernel timings are in its shard, read back with it; a record without any has no
    ``native_median_ms`` there, so a client of a release that lacks the field (it reads shards strictly) reads it."""
    timed, untimed = [record_of(make_meta(spec.graph_key, H200, blob_of(spec.graph_key), SIGNER, **extra))
                       for spec, extra in zip(SPECS, ({"native_median_ms": {"flash": 0.354, "cudnn_aten": 0.261}}, {}))]
    root, shards = build_index(H200, [timed, untimed], SIGNER, version=1)
    (data,) = shards.values()
    plans = {p["graph_key"]: p for p in json.loads(data)["plans"]}
    assert plans[timed.graph_key]["native_median_ms"] == timed.native_median_ms
    assert "native_median_ms" not in plans[untimed.graph_key]
    opened = open_root(root, trusted(SIGNER), H200)
    assert sorted(open_shard(data, opened.shards[0], opened).plans, key=lambda r: r.graph_key) == sorted(
        [timed, untimed], key=lambda r: r.graph_key)


def test_the_prefix_length_keeps_shards_small():
    assert [prefix_length(n, 64) for n in (0, 64, 65, 1024, 1025, 100_000, 10**9)] == [0, 0, 1, 1, 2, 3, 4]


def test_a_bad_index_url_is_refused_when_the_cache_is_made(tmp_path):
    with pytest.raises(ValueError, match="index URL"):
        client(tmp_path, "ftp://example.com/plans")


def test_the_cli_publishes_an_index_a_client_reads_and_says_what_to_do_without_a_key(published, tmp_path,
                                                                                    monkeypatch):
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    from typer.testing import CliRunner

    from plancache.cli import make_app
    from plancache.signing import keygen

    monkeypatch.delenv("PLANCACHE_SIGNING_KEY", raising=False)
    db = f"sqlite:///{published.parent / 'store.db'}"
    args = ["index", "publish", "--environment", H200.model_dump_json(), "--to", (tmp_path / "pub").as_uri(),
            "--database-url", db]
    result = CliRunner().invoke(make_app(), args)
    assert result.exit_code == 3 and "no signing key" in result.output and "--signing-key" in result.output
    private, public, _ = keygen(tmp_path / "keys", "ops")
    keys = tmp_path / "app-keys.txt"
    keys.write_text("\n".join(s.graph_key for s in SPECS[:3]) + "\n" + "0" * 64 + "\n")
    result = CliRunner().invoke(make_app(), [*args, "--signing-key", str(private), "--set", "bad name=x"])
    assert result.exit_code == 2 and "--set" in result.output
    result = CliRunner().invoke(make_app(), [*args, "--signing-key", str(private), "--shard-plans", "4",
                                             "--set", f"app={keys}"])
    assert result.exit_code == 0, result.output
    assert "12 plans" in result.output and "12 blobs copied" in result.output
    assert "set app: 1 graph keys have no plan" in result.output
    workers = tmp_path / "keys" / "workers.pub"  # the records' signer: the index may be signed by another key
    workers.write_bytes(SIGNER.private_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    cache = PlanCache("", index_url=(tmp_path / "pub").as_uri(), trusted_keys=tmp_path / "keys",
                      cache_dir=tmp_path / "c", backend=RecordingBackend(), mode="replay_only")
    with cache:
        assert {p.source for p in cache.prefetch(SPECS).values()} == {"index"}


def test_an_index_published_to_a_bucket_is_read_from_its_http_url(published, tmp_path, s3_blob_url, moto_s3):
    from plancache.index import ObjectTarget

    with open_store(f"sqlite:///{published.parent / 'store.db'}") as store:
        done = publish_index(store, H200, ObjectTarget(s3_blob_url), SIGNER, shard_plans=4)
    assert done.blobs_copied == len(SPECS)
    public_read(moto_s3, s3_blob_url.removeprefix("s3://").split("/")[0])
    bucket_url = f"{moto_s3}/{s3_blob_url.removeprefix('s3://')}"  # the bucket's plain HTTP URL, no credentials
    with client(tmp_path, bucket_url) as cache:
        assert {p.source for p in cache.prefetch(SPECS).values()} == {"index"}


def public_read(endpoint: str, bucket: str) -> None:
    """Let anyone GET the bucket's objects, as a bucket that serves an index to a fleet does."""
    import httpx

    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                                                      "Resource": f"arn:aws:s3:::{bucket}/*"}]}
    httpx.put(f"{endpoint}/{bucket}?policy", content=json.dumps(policy), timeout=10).raise_for_status()


def test_a_record_of_a_signed_index_is_verified_as_a_servers_is(tmp_path, serve):
    """The root's signature covers the shard, not the plan: a record signed by an untrusted key is refused."""
    folder = tmp_path / "pub"
    key, blob = SPECS[0].graph_key, blob_of(SPECS[0].graph_key)
    target = FolderTarget(folder)
    target.blobs.put(hashlib.sha256(blob).hexdigest(), blob)
    root, shards = build_index(H200, [record_of(make_meta(key, H200, blob, new_signer()))], SIGNER, version=1)
    for name, data in {**shards, root_path(H200.env_id): root}.items():
        target.write(name, data)
    message = refused(tmp_path, serve(folder)[0], "unknown_signer")
    assert "index: rejected (unknown_signer)" in message


def test_a_refused_root_is_not_asked_for_again_at_each_load(folder, tmp_path, serve):
    path = folder / root_path(H200.env_id)
    path.write_bytes(path.read_bytes().replace(b'"version":', b'"version":1', 1))  # a replayed version, edited
    index_url, asked = serve(folder)
    with client(tmp_path, index_url) as cache:
        for spec in SPECS[:3]:
            with pytest.raises(PlanMiss, match=r"index refused \(bad_signature\)"):
                cache.plan(spec)
        assert asked == [f"/{root_path(H200.env_id)}"] and cache.stats().rejects == {"bad_signature": 1}
