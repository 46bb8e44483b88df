"""Bundles: export → file → verify → import round trips; any tampering refuses the whole bundle."""

from __future__ import annotations

import base64
import json
import resource
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plancache.bundle import export_bundle, import_bundle, load_bundle
from plancache.cli import app
from plancache.environment import Environment
from plancache.errors import Conflict, NotFound, VerificationError
from plancache.protocol import PlanMeta
from plancache.signing import Signer, TrustedKeys, keygen
from plancache.store import open_store
from plancache.verify import verify_blob

pytestmark = pytest.mark.both_blob_stores

@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    priv, pub, _ = keygen(tmp_path / "keys", "ops")
    other_priv, other_pub, _ = keygen(tmp_path / "keys", "stranger")
    return {"signer": Signer.from_file(priv), "trusted": TrustedKeys.from_files([pub]), "priv": priv, "pub": pub,
            "stranger": Signer.from_file(other_priv), "stranger_pub": other_pub}


@pytest.fixture
def other_env(gpu_env: Environment) -> Environment:
    return gpu_env.model_copy(update={"cudnn_version": 92000})


def _seed(store: Any, make_spec: Any, make_plan: Any, env: Environment, signer: Signer, n: int = 3,
          first: int = 0) -> list[str]:
    keys = []
    for i in range(first, first + n):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        meta, blob = make_plan(key, env, blob=f"plan-{i}-{env.cudnn_version}".encode() * (i + 1))
        store.publish_plan(signer.sign(meta), blob)
        keys.append(key)
    return keys


@pytest.fixture
def dest(tmp_path: Path, blob_store_url: str) -> Any:
    """A second store, on the same kind of blob store as ``store``."""
    blob_store = "database" if blob_store_url == "database" else (tmp_path / "dest-blobs").as_uri()
    s = open_store(f"sqlite:///{tmp_path / 'dest.db'}", create=True, blob_store=blob_store)
    yield s
    s.close()


def _plan_count(store: Any) -> int:
    return len(store.list_plans(limit=10_000))


def test_round_trip_signed(store, dest, make_spec, make_plan, gpu_env, other_env, keys, tmp_path):
    wanted = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=3)
    _seed(store, make_spec, make_plan, other_env, keys["signer"], n=2)  # another environment: not exported
    out = tmp_path / "b.json"
    assert export_bundle(store, gpu_env, wanted[:2], out, keys["signer"]) == 2

    plans = load_bundle(out, keys["trusted"])
    assert sorted(p.record.graph_key for p in plans) == sorted(wanted[:2])
    for p in plans:
        assert p.record == store.get_plan(p.record.graph_key, gpu_env)
        assert p.blob == store.get_blob(p.record.blob_sha256)
        assert p.spec == store.get_spec(p.record.graph_key)

    report = import_bundle(dest, out, keys["trusted"])
    assert (report.imported, report.unchanged, report.signature_checked) == (2, 0, True)
    for p in plans:
        got = dest.get_plan(p.record.graph_key, gpu_env)
        assert got is not None
        assert got.model_dump(exclude={"created_at", "job_id"}) == p.record.model_dump(exclude={"created_at", "job_id"})
        assert dest.get_blob(got.blob_sha256) == p.blob
        keys["trusted"].verify(got)  # the worker's plan signature survives the trip
    assert _plan_count(dest) == 2

    again = import_bundle(dest, out, keys["trusted"])
    assert (again.imported, again.unchanged) == (0, 2)
    assert _plan_count(dest) == 2


def test_native_timings_travel_in_a_bundle_and_an_empty_set_is_left_out(store, dest, make_spec, make_plan, gpu_env,
                                                                          keys, tmp_path):
    """A record's native kernel timings are in its bundle entry, verified and imported with it; a record without any
    has no ``native_median_ms`` in its entry, so a release that lacks the field reads the bundle (it reads strictly)."""
    untimed = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)[0]
    timed, spec = make_spec(1)
    store.put_spec(timed, spec)
    native = {"flash": 0.354, "cudnn_aten": 0.261}
    meta, blob = make_plan(timed, gpu_env, blob=b"an attention plan", native_median_ms=native)
    store.publish_plan(keys["signer"].sign(meta), blob)
    out = tmp_path / "b.json"
    assert export_bundle(store, gpu_env, None, out, keys["signer"]) == 2
    records = {e["record"]["graph_key"]: e["record"] for e in json.loads(out.read_text())["entries"]}
    assert "native_median_ms" not in records[untimed] and records[timed]["native_median_ms"] == native
    assert {p.record.graph_key: p.record.native_median_ms for p in load_bundle(out, keys["trusted"])} == {
        untimed: {}, timed: native}
    assert import_bundle(dest, out, keys["trusted"]).imported == 2
    got = dest.get_plan(timed, gpu_env)
    assert got is not None and got.native_median_ms == native
    keys["trusted"].verify(got)


def test_export_all_and_import_into_either_backend(store, make_spec, make_plan, gpu_env, keys, tmp_path):
    src = open_store(f"sqlite:///{tmp_path / 'src.db'}", create=True)
    try:
        wanted = _seed(src, make_spec, make_plan, gpu_env, keys["signer"], n=4)
        out = tmp_path / "all.json"
        assert export_bundle(src, gpu_env, None, out, keys["signer"]) == 4
    finally:
        src.close()
    report = import_bundle(store, out, keys["trusted"])
    assert report.imported == 4
    assert {r.graph_key for r in store.list_plans(env_id=gpu_env.env_id)} == set(wanted)


def test_export_refuses_missing_keys_and_empty_environments(store, make_spec, make_plan, gpu_env, other_env,
                                                            keys, tmp_path):
    have = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)
    absent = "f" * 64
    with pytest.raises(NotFound, match=absent):
        export_bundle(store, gpu_env, [*have, absent], tmp_path / "x.json")
    with pytest.raises(NotFound, match="no plans are stored"):
        export_bundle(store, other_env, None, tmp_path / "y.json")
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "y.json").exists()


# ------------------------------------------------------------------------------------------- tampering


@pytest.fixture
def bundle_file(store, make_spec, make_plan, gpu_env, keys, tmp_path) -> Path:
    keys_ = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=3)
    out = tmp_path / "bundle.json"
    export_bundle(store, gpu_env, keys_, out, keys["signer"])
    return out


def _edit(path: Path, change: Any, dest: Path | None = None) -> Path:
    doc = json.loads(path.read_text())
    change(doc)
    target = dest or path.with_name("tampered.json")
    target.write_text(json.dumps(doc))
    return target


def _set_blob(doc: dict[str, Any], i: int, blob: bytes) -> None:
    doc["entries"][i]["blob_b64"] = base64.b64encode(blob).decode()


@pytest.mark.parametrize("change, trusted, reason, needle", [
    # Any edit breaks the bundle signature when trusted keys are configured.
    (lambda d: d["entries"][1]["record"].update(winner_median_ms=0.001), True, "bad_signature",
     "bundle: its header or entries do not match its signed statement"),
    (lambda d: d["header"].update(created_at="2020-01-01T00:00:00Z"), True, "bad_signature", "bundle: its header"),
    (lambda d: d["entries"].pop(), True, "malformed", "counts 3 entries"),
    # Without trusted keys every entry is still checked on its own.
    (lambda d: _set_blob(d, 1, b"evil" * 10), False, "size", "bundle entry 1"),
    (lambda d: _set_blob(d, 2, bytes(reversed(base64.b64decode(d["entries"][2]["blob_b64"])))), False, "sha256",
     "bundle entry 2"),
    (lambda d: d["entries"][0]["spec"]["nodes"][0].__setitem__("type", "FROBNICATE"), False, "malformed", "bundle entry 0"),
    (lambda d: d["entries"][0]["spec"]["tuning"].update(deterministic_only=True), False, "graph_key", "bundle entry 0"),
    (lambda d: d["entries"][0]["record"]["environment"].update(sm=80), False, "environment", "bundle entry 0"),
    (lambda d: d["entries"].append(d["entries"][0]) or d["header"].update(entries=4), False, "malformed",
     "repeats entry 0"),
    (lambda d: d["entries"][1].update(blob_b64="not base64!"), False, "malformed", "bundle entry 1"),
    (lambda d: d["header"].update(env_id="0" * 32), False, "environment", "env_id"),
])
def test_tampered_bundle_is_refused_whole(bundle_file, dest, keys, change, trusted, reason, needle):
    bad = _edit(bundle_file, change)
    trust = keys["trusted"] if trusted else None
    with pytest.raises(VerificationError, match=needle) as err:
        import_bundle(dest, bad, trust)
    assert err.value.reason == reason
    with pytest.raises(VerificationError):
        load_bundle(bad, trust)
    assert _plan_count(dest) == 0, "a refused bundle must not be imported in part"


def test_unsigned_or_foreign_signed_bundle_refused_with_trusted_keys(store, make_spec, make_plan, gpu_env, keys,
                                                                     dest, tmp_path):
    k = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)
    unsigned, foreign = tmp_path / "unsigned.json", tmp_path / "foreign.json"
    export_bundle(store, gpu_env, k, unsigned)
    export_bundle(store, gpu_env, k, foreign, keys["stranger"])
    with pytest.raises(VerificationError, match="unsigned") as err:
        import_bundle(dest, unsigned, keys["trusted"])
    assert err.value.reason == "unsigned"
    with pytest.raises(VerificationError, match="unknown key") as err:
        import_bundle(dest, foreign, keys["trusted"])
    assert err.value.reason == "unknown_signer"
    assert len(load_bundle(unsigned, None)) == 1  # no trusted keys configured: integrity checks only
    assert _plan_count(dest) == 0


def test_record_signature_checked_inside_a_trusted_bundle(store, make_spec, make_plan, gpu_env, keys, dest, tmp_path):
    """The bundle signer vouching for a record does not excuse a record signature that fails."""
    _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)
    key, spec = make_spec(9)
    store.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env, blob=b"stranger-plan")
    store.publish_plan(keys["stranger"].sign(meta), blob)
    out = tmp_path / "mixed.json"
    export_bundle(store, gpu_env, None, out, keys["signer"])
    with pytest.raises(VerificationError, match=f"graph key {key[:16]}.*unknown key"):
        import_bundle(dest, out, keys["trusted"])
    assert _plan_count(dest) == 0
    both = TrustedKeys.from_files([keys["pub"], keys["stranger_pub"]])
    assert import_bundle(dest, out, both).imported == 2


def test_conflicting_stored_plan_refuses_import_before_writing(bundle_file, dest, make_plan, gpu_env, keys):
    plans = load_bundle(bundle_file, keys["trusted"])
    victim = plans[2]
    dest.put_spec(victim.record.graph_key, victim.spec)
    meta, blob = make_plan(victim.record.graph_key, gpu_env, blob=b"a different plan")
    dest.publish_plan(meta, blob)
    with pytest.raises(Conflict, match="bundle entry 2"):
        import_bundle(dest, bundle_file, keys["trusted"])
    assert _plan_count(dest) == 1


def test_a_version_1_bundle_is_refused_with_a_clear_error(bundle_file, dest, keys):
    """Bundles signed with the retired statement-v1 signature are not read: export them again."""
    def version_1(doc: dict[str, Any]) -> None:
        doc["header"].update(version=1, signer_key_id=keys["signer"].key_id)
        doc["signature"] = doc.pop("envelope")["signatures"][0]["sig"]

    old = _edit(bundle_file, version_1)
    for trust in (keys["trusted"], None):
        with pytest.raises(VerificationError, match="a version 1 bundle, signed with the retired statement-v1 "
                                                    "signature.*export it again") as err:
            import_bundle(dest, old, trust)
        assert err.value.reason == "malformed"
    assert _plan_count(dest) == 0


def test_not_a_bundle(tmp_path, dest):
    junk = tmp_path / "junk.json"
    for content in (b"\xff\xfe not json", b"[1, 2]", json.dumps({"format": "plancache-bundle"}).encode()):
        junk.write_bytes(content)
        with pytest.raises(VerificationError) as err:
            import_bundle(dest, junk, None)
        assert err.value.reason == "malformed"
        assert str(junk) in err.value.message


# ----------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli() -> Any:
    runner = CliRunner()
    return lambda *args, **env: runner.invoke(app, list(args), env={"PLANCACHE_TRUSTED_KEYS": None,
                                                                   "PLANCACHE_SIGNING_KEY": None, **env})


def test_cli_export_import_and_tamper(tmp_path, make_spec, make_plan, gpu_env, keys, cli):
    src_url, dst_url = f"sqlite:///{tmp_path / 'src.db'}", f"sqlite:///{tmp_path / 'dst.db'}"
    with open_store(src_url, create=True) as src:
        wanted = _seed(src, make_spec, make_plan, gpu_env, keys["signer"], n=3)
    open_store(dst_url, create=True).close()
    env_file = tmp_path / "env.json"
    env_file.write_text(gpu_env.model_dump_json())
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# the app's graphs\n{wanted[0]}\n\n{wanted[2]}  # sdpa\n")
    out = tmp_path / "b.json"

    r = cli("bundle", "export", "--environment", str(env_file), "--keys", str(keys_file), "--out", str(out),
            "--database-url", src_url, PLANCACHE_SIGNING_KEY=str(keys["priv"]))
    assert r.exit_code == 0, r.output
    assert "2 plans" in r.output and keys["signer"].key_id in r.output

    r = cli("bundle", "import", str(out), "--trusted-keys", str(keys["pub"]), "--database-url", dst_url)
    assert r.exit_code == 0, r.output
    assert "2 new plans" in r.output
    with open_store(dst_url) as dst:
        assert {p.graph_key for p in dst.list_plans()} == {wanted[0], wanted[2]}

    bad = _edit(out, lambda d: _set_blob(d, 0, b"x" * 40))
    r = cli("bundle", "import", str(bad), "--database-url", dst_url, PLANCACHE_TRUSTED_KEYS=str(keys["pub"]))
    assert r.exit_code == 1
    assert "refused" in r.output and "do not match its signed statement" in r.output


def test_cli_unsigned_bundles_only_when_asked_for(tmp_path, make_spec, make_plan, gpu_env, keys, cli):
    src_url, dst_url = f"sqlite:///{tmp_path / 'src.db'}", f"sqlite:///{tmp_path / 'dst.db'}"
    with open_store(src_url, create=True) as src:
        _seed(src, make_spec, make_plan, gpu_env, keys["signer"], n=2)
    open_store(dst_url, create=True).close()
    out, env = tmp_path / "u.bundle", gpu_env.model_dump_json()
    r = cli("bundle", "export", "--environment", env, "--all", "--out", str(out), "--database-url", src_url,
            "--unsigned", PLANCACHE_SIGNING_KEY=str(keys["priv"]))
    assert r.exit_code == 2 and "contradict" in r.output and not out.exists()
    r = cli("bundle", "export", "--environment", env, "--all", "--out", str(out), "--database-url", src_url, "--unsigned")
    assert r.exit_code == 0 and "UNSIGNED" in r.output, r.output
    r = cli("bundle", "import", str(out), "--trusted-keys", str(keys["pub"]), "--database-url", dst_url)
    assert r.exit_code == 1 and "refused" in r.output  # trusted keys: an unsigned bundle is refused
    r = cli("bundle", "import", str(out), "--database-url", dst_url, "--insecure-no-verify")
    assert r.exit_code == 0 and "2 new plans" in r.output and "was not checked" in r.output, r.output


def test_cli_argument_errors(tmp_path, gpu_env, cli):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    open_store(url, create=True).close()
    inline = gpu_env.model_dump_json()
    r = cli("bundle", "export", "--environment", inline, "--out", str(tmp_path / "o.json"), "--database-url", url)
    assert r.exit_code == 2 and "exactly one of --keys" in r.output
    bad_keys = tmp_path / "k.txt"
    bad_keys.write_text("abc\n")
    r = cli("bundle", "export", "--environment", inline, "--keys", str(bad_keys), "--out", str(tmp_path / "o.json"),
            "--database-url", url)
    assert r.exit_code == 2 and "item 1" in r.output
    r = cli("bundle", "export", "--environment", '{"sm": 90}', "--all", "--out", str(tmp_path / "o.json"),
            "--database-url", url)
    assert r.exit_code == 2 and "not an environment" in r.output
    r = cli("bundle", "export", "--environment", inline, "--all", "--out", str(tmp_path / "o.json"), "--database-url", url)
    assert r.exit_code == 3 and "no signing key" in r.output and "--unsigned" in r.output
    r = cli("bundle", "export", "--environment", inline, "--all", "--out", str(tmp_path / "o.json"), "--database-url", url,
            "--unsigned")
    assert r.exit_code == 1 and "no plans are stored" in r.output
    empty = tmp_path / "nokeys"
    empty.mkdir()
    r = cli("bundle", "import", str(tmp_path / "o.json"), "--trusted-keys", str(empty), "--database-url", url)
    assert r.exit_code == 1 and "names no public key" in r.output
    keygen(tmp_path / "fleet", "k")
    r = cli("bundle", "import", str(tmp_path / "o.json"), "--trusted-keys", f"{tmp_path / 'fleet'},{empty}",
            "--database-url", url)  # a folder with no key beside one with a key: refused, naming it (before: dropped)
    assert r.exit_code == 1 and f"{empty} names no public key" in r.output and "--trusted-keys" in r.output, r.output
    r = cli("bundle", "import", str(tmp_path / "o.json"), "--database-url", url)
    assert r.exit_code == 3 and "no trusted keys" in r.output and "--insecure-no-verify" in r.output


def test_bundle_is_deterministic_in_content(store, make_spec, make_plan, gpu_env, keys, tmp_path):
    """Entries are ordered by graph key, so two exports of the same plans differ only in their timestamp."""
    k = _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=3)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    export_bundle(store, gpu_env, list(reversed(k)), a, keys["signer"])
    export_bundle(store, gpu_env, k, b, keys["signer"])
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["entries"] == db["entries"]
    assert [e["record"]["graph_key"] for e in da["entries"]] == sorted(k)


def test_trusted_keys_require_every_record_signed(store, make_spec, make_plan, gpu_env, keys, dest, tmp_path):
    """A client with trusted keys rejects unsigned plans, so a trusted bundle may not carry any."""
    _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)
    key, spec = make_spec(5)
    store.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env, blob=b"unsigned plan")
    store.publish_plan(meta, blob)
    out = tmp_path / "u.json"
    export_bundle(store, gpu_env, None, out, keys["signer"])
    with pytest.raises(VerificationError, match=f"graph key {key[:16]}.*unsigned") as err:
        import_bundle(dest, out, keys["trusted"])
    assert err.value.reason == "unsigned"
    assert len(load_bundle(out, None)) == 2


def test_client_starts_from_a_seeded_cache_with_no_server(tmp_path, make_spec, make_plan, gpu_env, keys, cli,
                                                          monkeypatch):
    from plancache.client import PlanCache
    from plancache.spec import parse_spec
    from tests.client_fakes import RecordingBackend

    with open_store(f"sqlite:///{tmp_path / 'src.db'}", create=True) as src:
        wanted = _seed(src, make_spec, make_plan, gpu_env, keys["signer"], n=2)
        out = tmp_path / "image.bundle"
        export_bundle(src, gpu_env, None, out, keys["signer"])
        specs = {k: src.get_spec(k) for k in wanted}
        blobs = {k: src.get_blob(src.get_plan(k, gpu_env).blob_sha256) for k in wanted}
    cache = tmp_path / "cache"
    r = cli("bundle", "import", str(out), "--cache-dir", str(cache), "--trusted-keys", str(keys["pub"]))
    assert r.exit_code == 0, r.output
    assert f"seeded {cache / gpu_env.env_id}: 2 plans" in r.output

    monkeypatch.delenv("PLANCACHE_SERVER_URL", raising=False)
    backend = RecordingBackend(gpu_env)
    with PlanCache(None, backend=backend, cache_dir=cache, trusted_keys=[keys["pub"]], mode="strict") as pc:
        for k in wanted:
            plan = pc.plan(parse_spec(specs[k]))
            assert plan.source == "disk"
    assert sorted(backend.deserialized) == sorted(blobs.values())

    bad = _edit(out, lambda d: _set_blob(d, 0, b"y" * 30))
    r = cli("bundle", "import", str(bad), "--cache-dir", str(tmp_path / "cache2"), "--trusted-keys", str(keys["pub"]))
    assert r.exit_code == 1 and "refused" in r.output
    assert not (tmp_path / "cache2").exists()


def test_an_older_bundle_never_replaces_newer_plans(tmp_path, make_spec, make_plan, gpu_env, keys, cli):
    """Before: importing an older bundle into a seeded cache overwrote its newer records and exited 0, and the
    offline client then refused them all (revision). After: the older entries are skipped and counted, in the
    cache and in a store alike."""
    old_url, new_url, dst_url = (f"sqlite:///{tmp_path / n}" for n in ("old.db", "new.db", "dst.db"))
    with open_store(old_url, create=True) as old:
        (key,) = _seed(old, make_spec, make_plan, gpu_env, keys["signer"], n=1)
        export_bundle(old, gpu_env, None, tmp_path / "old.bundle", keys["signer"])
    with open_store(new_url, create=True) as new:
        new.put_spec(*make_spec(0))
        meta, blob = make_plan(key, gpu_env, blob=b"the re-tuned plan")  # signed later: a higher revision
        new.publish_plan(keys["signer"].sign(meta), blob)
        export_bundle(new, gpu_env, None, tmp_path / "new.bundle", keys["signer"])
        newest = new.get_plan(key, gpu_env)
    cache = tmp_path / "cache"
    for name in ("new", "old"):
        r = cli("bundle", "import", str(tmp_path / f"{name}.bundle"), "--cache-dir", str(cache),
                "--trusted-keys", str(keys["pub"]))
        assert r.exit_code == 0, r.output
    assert "seeded" in r.output and ": 0 plans" in r.output and "1 older than the plans already there" in r.output
    from plancache.client.cache import DiskCache

    disk = DiskCache(cache, gpu_env)
    record = disk.record(key)
    assert record is not None and record.revision == newest.revision
    assert disk.blobs.get(record.blob_sha256) == b"the re-tuned plan"
    open_store(dst_url, create=True).close()
    for name in ("new", "old"):
        r = cli("bundle", "import", str(tmp_path / f"{name}.bundle"), "--trusted-keys", str(keys["pub"]),
                "--database-url", dst_url)
        assert r.exit_code == 0, r.output
    assert "0 new plans, 0 already stored" in r.output and "1 older" in r.output
    with open_store(dst_url) as dst:
        assert dst.get_plan(key, gpu_env).revision == newest.revision


# ------------------------------------------------------------------ re-signed plans, hostile files, export --all


def test_a_bundle_signed_again_replaces_the_older_revision_of_its_plan(tmp_path: Path, make_spec, make_plan, gpu_env):
    """Key rotation at an air-gapped site: the re-signed bundle (same blob, higher revision, new key) must replace
    the records imported before, or retiring the old key leaves the site with plans its clients refuse."""
    old_priv, old_pub, _ = keygen(tmp_path / "k", "old")
    new_priv, new_pub, _ = keygen(tmp_path / "k", "new")
    old, new = Signer.from_file(old_priv), Signer.from_file(new_priv)
    site_a = open_store(f"sqlite:///{tmp_path / 'a.db'}", create=True)
    site_b = open_store(f"sqlite:///{tmp_path / 'b.db'}", create=True)
    key, spec = make_spec(0)
    site_a.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env)
    site_a.publish_plan(old.sign(meta), blob)
    export_bundle(site_a, gpu_env, [key], tmp_path / "v1.bundle", old)
    import_bundle(site_b, tmp_path / "v1.bundle", TrustedKeys.from_files([old_pub]))
    rec = site_a.get_plan(key, gpu_env)  # `plans resign`: the same record, a higher revision, the new key
    site_a.publish_plan(new.sign(PlanMeta.model_validate(rec.model_dump(include=set(PlanMeta.model_fields)))), blob,
                        replace=True)
    export_bundle(site_a, gpu_env, [key], tmp_path / "v2.bundle", new)
    report = import_bundle(site_b, tmp_path / "v2.bundle", TrustedKeys.from_files([old_pub, new_pub]))
    assert (report.imported, report.unchanged, report.older) == (1, 0, 0)
    stored = site_b.get_plan(key, gpu_env)
    a = site_a.get_plan(key, gpu_env)
    assert (stored.revision, stored.envelope, stored.signer_key_id) == (a.revision, a.envelope, new.key_id)
    verify_blob(stored, blob, what="b", trusted=TrustedKeys.from_files([new_pub]), require_signature=True)
    again = import_bundle(site_b, tmp_path / "v2.bundle", TrustedKeys.from_files([new_pub]))
    assert (again.imported, again.unchanged) == (0, 1)
    older = import_bundle(site_b, tmp_path / "v1.bundle", TrustedKeys.from_files([old_pub]))
    assert (older.imported, older.older) == (0, 1) and site_b.get_plan(key, gpu_env) == stored


def _hostile(path: Path, body: str) -> Path:
    header = {"version": 2, "environment": {"sm": 90, "sm_count": 132, "cudnn_version": 91900,
                                            "driver_version": 13000, "frontend_version": "1.32.0"},
              "env_id": "0" * 32, "created_at": "2026-01-01T00:00:00Z", "entries": 0}
    path.write_text('{"format":"plancache-bundle","header":' + json.dumps(header) + ',"entries":' + body
                    + ',"envelope":null}')
    return path


def test_a_bundle_of_many_invalid_entries_is_refused_at_the_first(tmp_path: Path):
    """Before: 3 MB of ``{}`` entries took 21 s and 3.3 GB (validated whole, three errors per entry, all listed to
    print the first). Now the first invalid entry ends the read."""
    path = _hostile(tmp_path / "h.bundle", "[" + ",".join(["{}"] * 1_000_000) + "]")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(VerificationError, match=r"entries\.0\.record: Field required; and 2 more"):
        load_bundle(path, None)
    assert time.monotonic() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB


def test_a_bundle_nested_too_deep_is_malformed_not_a_crash(tmp_path: Path):
    """Before: 400 KB of ``[`` ended the CLI in 'internal error … RecursionError'."""
    path = _hostile(tmp_path / "deep.bundle", "[" * 200_000 + "]" * 200_000)
    with pytest.raises(VerificationError, match="nested too deep"):
        load_bundle(path, None)


def test_export_all_keeps_a_plan_replaced_during_the_export(tmp_path: Path, make_spec, make_plan, gpu_env,
                                                            monkeypatch):
    """`bundle export --all` paged the listing (newest first) by offset: a plan re-tuned meanwhile moved to the top
    of pages already read and was left out of the bundle."""
    store = open_store(f"sqlite:///{tmp_path / 'a.db'}", create=True)
    keys = []
    for i in range(5):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        meta, blob = make_plan(key, gpu_env, blob=f"plan-{i}".encode())
        store.publish_plan(meta, blob)
        keys.append(key)
    oldest = store.list_plans(limit=10)[-1]
    hooked = []

    def hook(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            if not hooked:  # a worker's re-tune of the oldest plan lands while the export reads
                hooked.append(1)
                m, b = make_plan(oldest.graph_key, gpu_env, blob=b"re-tuned")
                store.publish_plan(m, b, replace=True)
            return result
        return call

    monkeypatch.setattr(store, "list_plans", hook(store.list_plans))
    monkeypatch.setattr(store, "get_plan", hook(store.get_plan))
    assert export_bundle(store, gpu_env, None, tmp_path / "all.bundle") == 5
    exported = {p.record.graph_key: p.record for p in load_bundle(tmp_path / "all.bundle", None)}
    assert set(exported) == set(keys)


# ------------------------------------------------------------------ files over their limit


def _sparse(path: Path, size: int) -> Path:
    """``path``, a file of ``size`` bytes that takes no disk space (its size is refused before a byte is read)."""
    with path.open("wb") as fh:
        fh.truncate(size)
    return path


def test_a_file_over_its_limit_or_endless_is_refused_without_reading_it_all(tmp_path, gpu_env, keys, cli,
                                                                             monkeypatch):
    """Before: a --keys file, a bundle, a signing key and a trusted key were read whole: a huge file named by mistake
    or /dev/zero took all memory (MemoryError, or the OOM killer). Now each is refused past its limit, naming the
    file, its size and the limit, with the exit code of that file's other read errors."""
    from plancache import bundle
    from plancache.cli.bundle_cmds import MAX_KEYS_FILE_BYTES
    from plancache.cli.failures import ExitCode
    from plancache.signing import MAX_KEY_FILE_BYTES
    from tests.integration.test_cli import expected_failure

    url, inline, out = f"sqlite:///{tmp_path / 'db.sqlite'}", gpu_env.model_dump_json(), str(tmp_path / "o.json")
    open_store(url, create=True).close()
    over = {"keys": MAX_KEYS_FILE_BYTES + 1, "key": MAX_KEY_FILE_BYTES + 1, "bundle": bundle.MAX_BUNDLE_BYTES + 1}
    big = {name: _sparse(tmp_path / f"big.{name}", size) for name, size in over.items()}

    export = ["bundle", "export", "--environment", inline, "--out", out, "--database-url", url]
    for keys_file, size in ((big["keys"], f"{over['keys']} bytes"), ("/dev/zero", f"more than {MAX_KEYS_FILE_BYTES} bytes")):
        expected_failure(cli(*export, "--keys", str(keys_file), "--unsigned"), ExitCode.USAGE,
                         f"--keys {keys_file}: cannot read it: {size}, over the limit of {MAX_KEYS_FILE_BYTES} bytes")
    for key_file, size in ((big["key"], f"{over['key']} bytes"), ("/dev/zero", f"more than {MAX_KEY_FILE_BYTES} bytes")):
        expected_failure(cli(*export, "--all", "--signing-key", str(key_file)), ExitCode.OS_ERROR,
                         f"cannot read the signing key {key_file}: {size}, over the limit of {MAX_KEY_FILE_BYTES}")
        expected_failure(cli("bundle", "import", out, "--trusted-keys", str(key_file), "--database-url", url),
                         ExitCode.OS_ERROR, f"{size}, over the limit of {MAX_KEY_FILE_BYTES} bytes ({key_file})")

    refused = f"cannot read the bundle {big['bundle']}: {over['bundle']} bytes, over the limit of {over['bundle'] - 1}"
    for where in (["--database-url", url], ["--cache-dir", str(tmp_path / "cache")]):
        expected_failure(cli("bundle", "import", str(big["bundle"]), "--insecure-no-verify", *where),
                         ExitCode.OS_ERROR, refused, "export fewer plans per file")
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1000)  # /dev/zero: read up to the limit (1 GiB) and refused
    for where in (["--database-url", url], ["--cache-dir", str(tmp_path / "cache")]):
        expected_failure(cli("bundle", "import", "/dev/zero", "--insecure-no-verify", *where), ExitCode.OS_ERROR,
                         "cannot read the bundle /dev/zero: more than 1000 bytes, over the limit of 1000 bytes")
    assert not (tmp_path / "cache").exists() and not Path(out).exists()


def test_the_library_refuses_a_bundle_over_its_limit_as_an_unreadable_one(tmp_path, dest, monkeypatch):
    import errno

    from plancache import bundle

    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1000)
    for path in (_sparse(tmp_path / "big.bundle", 1001), Path("/dev/zero")):
        with pytest.raises(OSError) as err:
            import_bundle(dest, path, None)
        assert err.value.errno == errno.EFBIG and err.value.filename == str(path)
        assert "over the limit of 1000 bytes" in str(err.value)


def test_export_refuses_a_bundle_no_import_would_read(tmp_path, store, make_spec, make_plan, gpu_env, keys, cli,
                                                      monkeypatch):
    """An export with an entry over MAX_BUNDLE_BYTES is refused, nothing written, rather than a file every import
    refuses (a bundle export writes is read an entry at a time: its size as a whole has no bound)."""
    from plancache import bundle
    from plancache.cli.failures import ExitCode
    from plancache.errors import PayloadTooLarge
    from tests.integration.test_cli import expected_failure

    url = f"sqlite:///{tmp_path / 'src.db'}"
    with open_store(url, create=True) as src:
        _seed(src, make_spec, make_plan, gpu_env, keys["signer"], n=2)
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1000)
    out = tmp_path / "b.json"
    r = cli("bundle", "export", "--environment", gpu_env.model_dump_json(), "--all", "--out", str(out),
            "--database-url", url, "--unsigned")
    expected_failure(r, ExitCode.FAILED, "entry 0 (graph key", "is over the limit of 1000 bytes an import reads",
                     "--keys FILE")
    _seed(store, make_spec, make_plan, gpu_env, keys["signer"], n=1)
    with pytest.raises(PayloadTooLarge):
        export_bundle(store, gpu_env, None, out, keys["signer"])
    assert not out.exists()
