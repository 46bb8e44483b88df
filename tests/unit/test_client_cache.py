"""The client's disk cache: layout, atomic writes, damaged entries, the size cap (least recently used first),
other environments' folders, and processes sharing one folder."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from plancache.client.cache import DiskCache
from plancache.errors import VerificationError
from tests.factories import H200, OTHER_GPU, make_record

KEY = "c" * 64
BLOB = b"plan-bytes" * 50


def load(cache: DiskCache, graph_key: str) -> tuple[object, bytes] | None:
    """What the ladder's disk step reads of an entry: the record, its blob checked by the blob store, and the entry
    marked used; None when either is missing."""
    record = cache.record(graph_key)
    blob = cache.blobs.get(record.blob_sha256) if record is not None else None
    if record is None or blob is None:
        return None
    cache.touch(record)
    return record, blob


def plan_files(folder: Path) -> list[str]:
    """The entry files of a folder (not its ``.used`` marker)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_save_then_load_round_trips_under_the_environment_folder(tmp_path):
    cache = DiskCache(tmp_path / "cache", H200)
    assert load(cache, KEY) is None and not (tmp_path / "cache").exists()  # a reader creates nothing
    record = make_record(KEY, H200, BLOB)
    assert cache.save(record, BLOB)
    folder = tmp_path / "cache" / H200.env_id
    assert plan_files(folder) == sorted([f"{KEY}.json", "blobs"])
    sha = record.blob_sha256
    blob_file = folder / "blobs" / sha[:2] / sha[2:4] / sha
    assert blob_file.read_bytes() == BLOB and blob_file.stat().st_mode & 0o777 == 0o600
    loaded, blob = load(cache, KEY)
    assert loaded == record and blob == BLOB and cache.record(KEY) == record
    # Another environment sees nothing.
    assert load(DiskCache(tmp_path, OTHER_GPU), KEY) is None


def test_absent_entries_and_a_record_without_its_blob_are_misses(tmp_path):
    cache = DiskCache(tmp_path, H200)
    assert load(cache, KEY) is None
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    cache.blobs.path(record.blob_sha256).unlink()
    assert load(cache, KEY) is None and cache.record(KEY) == record


def test_a_record_that_does_not_parse_is_malformed(tmp_path):
    cache = DiskCache(tmp_path, H200)
    cache.save(make_record(KEY, H200, BLOB), BLOB)
    path = tmp_path / H200.env_id / f"{KEY}.json"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(VerificationError) as exc:
        load(cache, KEY)
    assert exc.value.reason == "malformed"


def test_a_damaged_blob_is_never_returned_and_the_next_save_replaces_it(tmp_path, caplog):
    """The blob store hashes every read: a truncated or overwritten blob file is a miss (the ladder's disk step
    counts it as a rejected blob, reason ``size`` or ``sha256``: tests/integration/test_client_ladder.py)."""
    cache = DiskCache(tmp_path, H200)
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    cache.blobs.path(record.blob_sha256).write_bytes(BLOB[:10])
    assert load(cache, KEY) is None and "damaged" in caplog.text
    assert cache.save(record, BLOB) and load(cache, KEY) == (record, BLOB)


def test_discard_removes_the_record_and_the_blob(tmp_path):
    cache = DiskCache(tmp_path, H200)
    record = make_record(KEY, H200, BLOB)
    cache.save(record, BLOB)
    cache.discard(KEY, record.blob_sha256)
    assert plan_files(tmp_path / H200.env_id) == ["blobs"] and list(cache.blobs.files()) == []
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
    record, blob = load(cache, KEY)
    assert record == old and blob == BLOB
    assert not [p for p in (tmp_path / H200.env_id).rglob("*.tmp")]


def test_an_unwritable_folder_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert DiskCache(blocker, H200).save(make_record(KEY, H200, BLOB), BLOB) is False


def test_graph_keys_are_checked_before_they_become_paths(tmp_path):
    with pytest.raises(ValueError):
        load(DiskCache(tmp_path, H200), "../../etc/passwd")


# ------------------------------------------------------------------ housekeeping

DAY = 86400.0


def key(i: int) -> str:
    return hashlib.sha256(f"graph {i}".encode()).hexdigest()


def blob(i: int, size: int = 1000) -> bytes:
    return f"plan {i} ".encode().ljust(size, b".")


def entry_bytes(cache: DiskCache, i: int) -> int:
    record = make_record(key(i), H200, blob(i))
    return len(blob(i)) + len(record.model_dump_json().encode())


def set_last_use(cache: DiskCache, i: int, when: float) -> None:
    record, _ = load(cache, key(i))
    for path in (cache.dir / f"{key(i)}.json", cache.blobs.path(record.blob_sha256)):
        os.utime(path, (when, when))


def test_the_size_cap_evicts_the_least_recently_used_entries(tmp_path):
    """Before: no cap; the cache grew without bound."""
    one = entry_bytes(DiskCache(tmp_path, H200), 0)
    cache = DiskCache(tmp_path, H200, max_bytes=10 * one)
    for i in range(10):
        assert cache.save(make_record(key(i), H200, blob(i)), blob(i))
    assert cache.size() == 10 * one
    now = time.time()
    for i in range(10):  # entry i was last used i minutes ago: 9 is the least recently used
        set_last_use(cache, i, now - 60 * i)
    assert load(cache, key(8)) is not None  # a hit makes 8 the most recently used
    cache.save(make_record(key(10), H200, blob(10)), blob(10))  # over the cap: down to 90 % of it
    assert cache.size() <= 0.9 * cache.max_bytes
    kept = [i for i in range(11) if load(cache, key(i)) is not None]
    assert kept == [0, 1, 2, 3, 4, 5, 6, 8, 10], "evicted out of least-recently-used order"
    assert not list(cache.dir.rglob("*.tmp"))
    # Without a cap nothing is evicted.
    free = DiskCache(tmp_path / "free", H200, max_bytes=0)
    for i in range(30):
        free.save(make_record(key(i), H200, blob(i)), blob(i))
    assert free.size() == 30 * one


def test_the_cap_counts_every_environment_and_spares_other_folders(tmp_path):
    one = entry_bytes(DiskCache(tmp_path, H200), 0)
    other = DiskCache(tmp_path, OTHER_GPU)
    for i in range(5):
        other.save(make_record(key(i), OTHER_GPU, blob(i)), blob(i))
        set_last_use(other, i, time.time() - DAY)
    spool = tmp_path / "worker-spool"  # the worker's spool lives under the same root by default
    spool.mkdir()
    (spool / "job-1-1.blob").write_bytes(b"x" * 50 * one)
    cache = DiskCache(tmp_path, H200, max_bytes=6 * one)
    for i in range(5):
        cache.save(make_record(key(i), H200, blob(i)), blob(i))
    assert cache.size() <= 6 * one
    assert all(load(cache, key(i)) is not None for i in range(5))  # the older environment went first
    assert (spool / "job-1-1.blob").stat().st_size == 50 * one


def test_a_reader_sharing_the_folder_with_an_evicting_writer_only_ever_misses(tmp_path):
    """Another process evicting under a reader: every load is a whole, consistent entry or a miss, never an error."""
    one = entry_bytes(DiskCache(tmp_path, H200), 0)
    writer = DiskCache(tmp_path, H200, max_bytes=8 * one)
    reader = DiskCache(tmp_path, H200)
    stop, seen, errors = threading.Event(), {"hit": 0, "miss": 0}, []

    def read() -> None:
        while not stop.is_set():
            for i in range(40):
                try:
                    got = load(reader, key(i))
                except Exception as exc:  # noqa: BLE001 - the test's point
                    errors.append(exc)
                    continue
                if got is None:
                    seen["miss"] += 1
                else:
                    record, data = got
                    if record.graph_key != key(i) or hashlib.sha256(data).hexdigest() != record.blob_sha256:
                        errors.append(AssertionError(f"entry {i} is not whole"))
                    seen["hit"] += 1

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _rounds in range(2):
            for i in range(40):
                assert writer.save(make_record(key(i), H200, blob(i)), blob(i))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert errors == [] and seen["hit"] > 0 and seen["miss"] > 0
    assert writer.size() <= 8 * one


def test_folders_of_environments_unused_for_max_age_days_are_dropped(tmp_path):
    """Before: the folder of every cuDNN, driver or GPU this cache ever saw stayed forever."""
    old_driver = H200.model_copy(update={"driver_version": 1})
    old, recent = DiskCache(tmp_path, OTHER_GPU), DiskCache(tmp_path, old_driver)
    for c, env in ((old, OTHER_GPU), (recent, old_driver)):
        c.save(make_record(KEY, env, BLOB), BLOB)
    stale = time.time() - 31 * DAY
    os.utime(old.dir / ".used", (stale, stale))
    os.utime(recent.dir / ".used", (time.time() - 2 * DAY,) * 2)
    (tmp_path / "worker-spool").mkdir()
    os.utime(tmp_path / "worker-spool", (stale, stale))
    (tmp_path / ("0" * 32)).mkdir()  # an environment folder without its marker: its own time counts
    os.utime(tmp_path / ("0" * 32), (stale, stale))
    here = DiskCache(tmp_path, H200, max_age_days=30)
    assert sorted(p.name for p in here.sweep()) == sorted([old.dir.name, "0" * 32])
    assert not old.dir.exists() and recent.dir.exists() and (tmp_path / "worker-spool").exists()
    # The current environment is never dropped, however old; opening the cache marks it used.
    here.save(make_record(KEY, H200, BLOB), BLOB)
    os.utime(here.dir / ".used", (stale, stale))
    assert DiskCache(tmp_path, H200, max_age_days=30).sweep() == [] and load(here, KEY) is not None
    assert (here.dir / ".used").stat().st_mtime > time.time() - 60
    # 0 (or None) never drops anything.
    os.utime(recent.dir / ".used", (stale, stale))
    assert DiskCache(tmp_path, H200, max_age_days=0).sweep() == [] and recent.dir.exists()


def test_a_crashed_writers_temporary_files_are_removed_by_a_scan(tmp_path):
    cache = DiskCache(tmp_path, H200, max_bytes=1 << 30)
    cache.save(make_record(KEY, H200, BLOB), BLOB)
    shard = cache.blobs.path(hashlib.sha256(BLOB).hexdigest()).parent
    fresh, stale = cache.dir / f".{KEY}.json.fresh.tmp", cache.dir / f".{KEY}.json.stale.tmp"
    fresh_blob, stale_blob = shard / f".{'d' * 64}.fresh.tmp", shard / f".{'d' * 64}.stale.tmp"
    for p in (fresh, stale, fresh_blob, stale_blob):
        p.write_bytes(b"half")
    for p in (stale, stale_blob):
        os.utime(p, (time.time() - 2 * 3600,) * 2)
    cache.size()
    assert fresh.exists() and fresh_blob.exists() and not stale.exists() and not stale_blob.exists()


def test_fetch_lock_files_unused_for_an_hour_are_removed_by_a_scan(tmp_path):
    cache = DiskCache(tmp_path, H200, max_bytes=1 << 30)
    held, old = cache.fetch_lock([KEY], 1), cache.fetch_lock([key(1)], 1)
    assert held is not None and old is not None
    old.release()
    locks = sorted(cache.dir.glob(".fetch-*.lock"))
    assert len(locks) == 2
    stale = next(p for p in locks if os.stat(p).st_ino != os.fstat(held._fd or -1).st_ino)
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    cache.size()
    assert sorted(cache.dir.glob(".fetch-*.lock")) == [p for p in locks if p != stale]
    held.release()


def test_the_revisions_lock_is_never_removed_by_a_scan(tmp_path):
    """Deleted after an hour idle, a process still holding the old file's lock and one creating a new file of its
    name would both enter a revision's read-compare-write, and the floor could be lowered."""
    cache = DiskCache(tmp_path, H200, max_bytes=1 << 30)
    cache.accept_revision(KEY, 3, background=False)
    lock = cache.dir / ".revisions.lock"
    os.utime(lock, (time.time() - 48 * 3600,) * 2)
    cache.size()
    cache.evict()
    assert lock.exists()


def test_plancache_opens_the_cache_with_its_settings(tmp_path):
    from plancache.client import PlanCache
    from plancache.settings import Settings
    from tests.client_fakes import RecordingBackend

    stale_dir = tmp_path / ("f" * 32)
    stale_dir.mkdir()
    os.utime(stale_dir, (time.time() - 40 * DAY,) * 2)
    pc = PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path, cache_max_bytes=12345,
                   settings=Settings(cache_max_age_days=30))
    assert pc.disk.max_bytes == 12345 and pc.disk.max_age_days == 30 and not stale_dir.exists()
    assert PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path, settings=Settings()).disk.max_bytes == 2 << 30


def test_accepted_revisions_only_grow_survive_eviction_and_are_shared(tmp_path):
    """``<graph_key>.revision`` keeps the highest revision accepted, for every process sharing the folder; the size
    cap never evicts it; a damaged file counts as none, and a read-only folder keeps it in this process."""
    cache = DiskCache(tmp_path, H200, max_bytes=1)
    assert cache.revision(KEY) == 0
    cache.accept_revision(KEY, 5)
    cache.accept_revision(KEY, 3)
    assert cache.revision(KEY) == 5  # this process knows at once; the folder once the writer has run
    cache.flush()
    assert DiskCache(tmp_path, H200).revision(KEY) == 5
    assert DiskCache(tmp_path, OTHER_GPU).revision(KEY) == 0  # per environment
    cache.save(make_record(KEY, H200, BLOB), BLOB)  # over the cap: the entry is evicted, the revision stays
    assert plan_files(tmp_path / H200.env_id) == sorted([f"{KEY}.revision", "blobs"])
    assert list(cache.blobs.files()) == []
    (tmp_path / H200.env_id / f"{KEY}.revision").write_text("not a number")
    assert DiskCache(tmp_path, H200).revision(KEY) == 0 and cache.revision(KEY) == 5
    os.chmod(tmp_path / H200.env_id, 0o500)
    try:
        cache.accept_revision(KEY, 9)  # cannot be written: remembered by this process only
        cache.flush()
        assert cache.revision(KEY) == 9
    finally:
        os.chmod(tmp_path / H200.env_id, 0o700)


def test_an_entry_from_the_server_is_marked_confirmed_and_loses_the_mark_with_the_entry(tmp_path):
    cache = DiskCache(tmp_path, H200)
    fetched, imported = make_record("a" * 64, H200, b"from the server"), make_record("b" * 64, H200, b"from a bundle")
    before = time.time()
    assert cache.save(fetched, b"from the server", checked=True) and cache.save(imported, b"from a bundle")
    checked = cache.checked_at(fetched.graph_key)
    assert checked is not None and checked >= before - 1
    assert cache.checked_at(imported.graph_key) is None  # never confirmed by a server: revalidated at first use
    cache.mark_checked(imported.graph_key)
    assert cache.checked_at(imported.graph_key) is not None
    cache.discard(fetched.graph_key, fetched.blob_sha256)
    assert cache.checked_at(fetched.graph_key) is None and load(cache, fetched.graph_key) is None
    assert plan_files(tmp_path / H200.env_id) == sorted([f"{'b' * 64}.json", f"{'b' * 64}.checked", "blobs"])
    assert cache.blobs.get(fetched.blob_sha256) is None and cache.blobs.get(imported.blob_sha256) == b"from a bundle"
    # another record written over a confirmed entry (a bundle imported later) is not confirmed by the old one's mark:
    # it kept the entry from being asked about for up to PLANCACHE_REVALIDATE_SECONDS, a withdrawn plan included
    newer = make_record("b" * 64, H200, b"a newer plan from a bundle")
    assert cache.save(newer, b"a newer plan from a bundle") and cache.checked_at(newer.graph_key) is None


def test_a_revision_accepted_in_the_foreground_is_on_disk_at_once(tmp_path):
    cache = DiskCache(tmp_path, H200)
    cache.accept_revision("a" * 64, 42, background=False)
    assert (tmp_path / H200.env_id / f"{'a' * 64}.revision").read_text() == "42"
    assert DiskCache(tmp_path, H200).revision("a" * 64) == 42


def old_layout(folder: Path, entries: dict[str, bytes]) -> dict[str, Path]:
    """Entries written as the earlier layout did: ``<graph_key>.json`` and ``<sha256>.blob`` side by side."""
    folder.mkdir(parents=True, mode=0o700)
    files = {}
    for graph_key, data in entries.items():
        record = make_record(graph_key, H200, data)
        (folder / f"{graph_key}.json").write_text(record.model_dump_json())
        files[graph_key] = folder / f"{record.blob_sha256}.blob"
        files[graph_key].write_bytes(data)
    return files


def test_a_folder_of_the_earlier_layout_is_moved_into_the_blob_store_when_opened(tmp_path):
    """Before: blobs were ``<env_id>/<sha256>.blob``; they are moved, checked, keeping their time of last use."""
    old = old_layout(tmp_path / H200.env_id, {key(1): blob(1), key(2): blob(2), key(3): blob(3)})
    os.utime(old[key(1)], (1000.0, 1000.0))
    old[key(3)].write_bytes(blob(3)[:-1])  # damaged: dropped, the entry is a miss
    cache = DiskCache(tmp_path, H200)
    assert load(cache, key(1)) is None  # not read before the cache is opened (swept)
    cache.sweep()
    assert not list(cache.dir.glob("*.blob"))
    assert cache.blobs.path(hashlib.sha256(blob(1)).hexdigest()).stat().st_mtime == 1000.0  # its last use kept
    assert sorted(f.sha256 for f in cache.blobs.files()) == sorted(hashlib.sha256(blob(i)).hexdigest() for i in (1, 2))
    assert [load(cache, key(i)) is not None for i in (1, 2, 3)] == [True, True, False]


def test_a_folder_of_the_earlier_layout_that_cannot_be_written_is_left_as_it_is(tmp_path, monkeypatch):
    old = old_layout(tmp_path / H200.env_id, {KEY: BLOB})
    cache = DiskCache(tmp_path, H200)

    def read_only(sha256: str, data: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cache.blobs, "put", read_only)
    assert cache.sweep() == [] and old[KEY].read_bytes() == BLOB and load(cache, KEY) is None


def test_a_fetch_lock_released_is_free_though_a_forked_child_holds_the_open_file(tmp_path):
    """``flock`` belongs to the open file, which ``fork`` shares (a data loader's workers forked while a fetch runs on
    another thread): closing ours alone left the lock held for as long as the child lived, and every other process
    of the host missing those keys waited its whole deadline."""
    lock = DiskCache(tmp_path, H200).fetch_lock(["c" * 64], 1.0)
    assert lock is not None and not lock.waited
    child = os.fork()
    if child == 0:  # a worker that never touches plancache
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        again = DiskCache(tmp_path, H200).fetch_lock(["c" * 64], 0.5)  # another process's open of the lock file
        assert again is not None and not again.waited
        again.release()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def _accept_many(root: str, revision: int, keys: list[str], barrier: Any) -> None:
    disk = DiskCache(root, H200)
    for key in keys:
        barrier.wait()
        disk.accept_revision(key, revision, background=False)


def test_two_processes_accepting_revisions_at_once_never_lower_the_floor(tmp_path):
    """Read, compare and write of a revision file happen under the folder's lock: without it a process writing
    revision 3 could rename its file over the 5 another wrote meanwhile (2-32 keys of 300 in the audit's runs), and
    the older record was admitted again."""
    import multiprocessing

    keys = [hashlib.sha256(f"k{i}".encode()).hexdigest() for i in range(60)]
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    workers = [ctx.Process(target=_accept_many, args=(str(tmp_path), rev, keys, barrier)) for rev in (3, 5)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    disk = DiskCache(tmp_path, H200)
    assert [disk.revision(key) for key in keys] == [5] * len(keys)
    assert (tmp_path / H200.env_id / ".revisions.lock").exists()


def test_a_write_asked_for_while_the_interpreter_exits_is_made_at_once(tmp_path):
    """A thread of the program still loading after the main thread returned: Python refuses new work to every
    thread pool before it joins such threads, so the write was refused with ``RuntimeError`` (the load raised, and
    the plans it fetched were never written); now it is made on the asking thread."""
    import subprocess
    import sys

    code = (
        "import threading, time\n"
        "from plancache.client.cache import DiskCache\n"
        "from tests.factories import H200, make_record\n"
        f"disk = DiskCache({str(tmp_path)!r}, H200)\n"
        "disk.later(time.sleep, 0)  # the writer thread exists\n"
        "def late():\n"
        "    time.sleep(0.5)  # the main thread has returned\n"
        "    disk.later(disk.save, make_record('d' * 64, H200, b'late'), b'late')\n"
        "    disk.accept_revision('d' * 64, 7)\n"
        "    print('late writes asked for', flush=True)\n"
        "threading.Thread(target=late).start()\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "late writes asked for" in done.stdout, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    disk = DiskCache(tmp_path, H200)
    assert disk.record("d" * 64) is not None and disk.revision("d" * 64) == 7


def _within(seconds: float, call: Any) -> Any:
    """``call()`` on a thread; AssertionError when it has not returned within ``seconds``."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    return out[0]


def test_a_fifo_or_symlink_planted_in_the_folder_is_never_waited_on_nor_followed(tmp_path):
    """As the blob store's files: a FIFO under a record's or a revision's name is not read (the load would block for
    good), and a symlink under a lock's name is not followed (its target would be made or opened read-write)."""
    cache = DiskCache(tmp_path, H200)
    cache.dir.mkdir(parents=True)
    fifos = [cache.dir / f"{KEY}.json", cache.dir / f"{KEY}.revision"]
    for fifo in fifos:
        os.mkfifo(fifo)
    try:
        assert _within(5, lambda: cache.record(KEY)) is None
        assert _within(5, lambda: cache.revision(KEY)) == 0
    finally:  # a reader still blocked (before the fix) gets its end of file
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (cache.dir / ".revisions.lock").symlink_to(elsewhere / "revisions")
    digest = hashlib.sha256(KEY.encode()).hexdigest()[:32]
    (cache.dir / f".fetch-{digest}.lock").symlink_to(elsewhere / "fetch")
    cache.accept_revision(KEY, 3, background=False)  # no lock, so not written: the floor holds in this process
    assert cache.revision(KEY) == 3
    assert cache.fetch_lock([KEY], 0.1) is None
    assert list(elsewhere.iterdir()) == []


def test_an_oversized_record_file_is_malformed_without_being_read_whole(tmp_path):
    import tracemalloc

    from plancache.client.cache import RECORD_FILE_BYTES

    cache = DiskCache(tmp_path, H200)
    cache.dir.mkdir(parents=True)
    with open(cache.dir / f"{KEY}.json", "wb") as fh:
        fh.truncate(256 << 20)  # sparse
    tracemalloc.start()
    try:
        with pytest.raises(VerificationError) as exc:
            cache.record(KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert exc.value.reason == "malformed"
    assert peak < 4 * RECORD_FILE_BYTES, peak  # before: the whole 256 MiB


@pytest.mark.parametrize("which", ["revisions", "capture"])
def test_a_child_forked_while_a_folder_lock_is_held_does_not_keep_it(tmp_path, monkeypatch, which):
    """A process forked while a thread held the revisions lock (the disk writer) or the capture file's lock (a build
    thread) shares the open lock file: closing the parent's descriptor alone left the lock held for as long as the child
    lived (a data loader's workers), and every later revision write or capture of the host waited on it for ever."""
    import fcntl

    import plancache.client.cache as cache_module
    import plancache.client.capture as capture_module
    from plancache.client.capture import Recorder
    from tests.factories import CONV_SPEC

    module = cache_module if which == "revisions" else capture_module
    real, children = module.atomic_write, []

    def forking_write(path: Any, data: bytes, **kwargs: Any) -> None:
        pid = os.fork()  # another thread starts a worker process now
        if pid == 0:  # pragma: no cover - the child only lives on
            time.sleep(30)
            os._exit(0)
        children.append(pid)
        real(path, data, **kwargs)

    monkeypatch.setattr(module, "atomic_write", forking_write)
    if which == "revisions":
        DiskCache(tmp_path, H200).accept_revision(KEY, 5, background=False)
        lock_path = tmp_path / H200.env_id / ".revisions.lock"
    else:
        Recorder(tmp_path / "capture.json").add(CONV_SPEC)
        lock_path = tmp_path / "capture.json.lock"
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the child holds it
    finally:
        os.close(fd)
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_a_write_asked_for_after_close_is_made_by_its_caller_and_starts_no_writer(tmp_path):
    """``PlanCache.close()`` while a load of another thread is still under way: that load's writes (its plans, the
    revisions, the host's turn to fetch) came after the writer was shut down. They started a new writer thread that
    outlived the close (or, racing with close setting the writer to None, raised AttributeError out of the load)."""
    cache = DiskCache(tmp_path, H200)
    cache.accept_revision(KEY, 1)  # a write on the writer thread
    cache.close()
    written = []
    cache.later(written.append, "after close")
    assert written == ["after close"]  # made at once, on the caller's thread
    assert cache._writer is None
    cache.accept_revision(KEY, 2)  # before: a new writer thread (another cache's may run: this suite's other tests)
    assert cache._writer is None
    assert DiskCache(tmp_path, H200).revision(KEY) == 2


def test_a_planted_revision_far_ahead_is_ignored_and_replaced(tmp_path):
    """2**63 - 1 written into a key's ``.revision`` in a shared cache folder made the host refuse every plan of that key
    for good (main 4d1a308); a stored revision more than a day ahead of this clock is ignored, and the next one
    accepted replaces it. An hour ahead (a signer's clock running fast) is kept."""
    path = tmp_path / H200.env_id / f"{KEY}.revision"
    DiskCache(tmp_path, H200).accept_revision(KEY, 5, background=False)
    path.write_text(str(2**63 - 1))
    cache = DiskCache(tmp_path, H200)
    assert cache.revision(KEY) == 0
    cache.accept_revision(KEY, 7, background=False)
    assert path.read_text() == "7"
    ahead = time.time_ns() // 1_000_000 + 3600 * 1000
    path.write_text(str(ahead))
    assert DiskCache(tmp_path, H200).revision(KEY) == ahead


def test_a_read_waits_for_the_pending_writes_of_its_own_key_only(tmp_path):
    """A load read every key's record only after every background write asked for had been fsynced: a new shape's
    backward plan waited on its forward's disk write (about 3 ms a plan on the CI machine's disk). A read now waits
    for its own key's writes, which the single writer makes after every write asked for before them."""
    cache = DiskCache(tmp_path, H200)
    other, gate = "b" * 64, threading.Event()
    cache.later(gate.wait, 30, key=other)  # a write of another key, stuck
    cache.later(cache.save, make_record(other, H200, BLOB), BLOB, key=other)
    t0 = time.monotonic()
    assert cache.record(KEY) is None  # not written, and not waiting for the other key
    assert time.monotonic() - t0 < 5 and not gate.is_set()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(cache.record(other)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and got == []  # its own key's writes are still pending
    gate.set()
    reader.join(30)
    assert got and got[0].graph_key == other  # read once they are done
    cache.later(cache.save, make_record(KEY, H200, BLOB), BLOB, key=KEY)
    assert cache.record(KEY).graph_key == KEY and cache._pending == [] and cache._last_write == {}
    cache.close()
