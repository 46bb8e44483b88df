"""``tests.gpu_util.tune_misses``, which GPU tests and benchmarks share: every miss tuned in one process, then each one
that process left (a failure, or a crash that took the rest of its list down) again in a process of its own."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from plancache.signing import Signer, keygen
from tests import gpu_util
from tests.factories import H200, make_meta

BLOB = b"serialized-plan"  # make_meta's default blob: its digest and size


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _write_tuned(out: Path, key: str) -> None:
    """What the tuning child leaves for a spec it tuned: its record, then its blob."""
    (out / f"{key}.meta.json").write_text(make_meta(key, H200).model_dump_json())
    (out / f"{key}.blob").write_bytes(BLOB)


class _Store:
    def __init__(self, docs: dict[str, dict[str, Any] | None]) -> None:
        self.docs = docs
        self.published: dict[str, bytes] = {}

    def list_misses(self, limit: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(graph_key=key) for key in self.docs][:limit]

    def get_spec(self, key: str) -> dict[str, Any] | None:
        return self.docs[key]

    def publish_plan(self, meta: Any, blob: bytes) -> None:
        assert meta.envelope is not None, "published unsigned"
        self.published[meta.graph_key] = blob


def test_the_misses_are_tuned_in_one_process_and_those_it_left_in_one_each(tmp_path, monkeypatch):
    a, b, c, d, e = (_key(n) for n in "abcde")
    store = _Store({a: {"n": "a"}, b: {"n": "b"}, c: {"n": "c"}, d: {"n": "d"}, e: None})
    calls: list[list[str]] = []

    def fake_tune(out: Path, specs: list[Path]) -> subprocess.CompletedProcess[str]:
        keys = [p.stem for p in specs]
        calls.append(keys)
        for key in keys:
            if len(keys) > 1 and key == b:  # the batch crashes at b: b, c and d are left
                return subprocess.CompletedProcess([], -11, "", "")
            if key == c:
                return subprocess.CompletedProcess([], 1, "", "tuning failed\nRuntimeError: no engine took it")
            _write_tuned(out, key)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(gpu_util, "_tune", fake_tune)
    private, _, _ = keygen(tmp_path / "keys")
    tuned, failed = gpu_util.tune_misses(SimpleNamespace(store=store), tmp_path, Signer.from_file(private))
    assert calls == [[a, b, c, d], [b], [c], [d]]
    assert tuned == 3 and set(store.published) == {a, b, d} and all(v == BLOB for v in store.published.values())
    assert failed == {c: "RuntimeError: no engine took it", e: "the miss was recorded without its spec"}
    assert (tmp_path / "specs" / f"{a}.json").read_text() == '{"n": "a"}'


def test_a_batch_that_tunes_every_miss_runs_no_other_process(tmp_path, monkeypatch):
    keys = [_key(n) for n in "xy"]
    store = _Store(dict.fromkeys(keys, {"n": 1}))
    calls: list[int] = []

    def fake_tune(out: Path, specs: list[Path]) -> subprocess.CompletedProcess[str]:
        calls.append(len(specs))
        for p in specs:
            _write_tuned(out, p.stem)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(gpu_util, "_tune", fake_tune)
    private, _, _ = keygen(tmp_path / "keys")
    assert gpu_util.tune_misses(SimpleNamespace(store=store), tmp_path, Signer.from_file(private)) == (2, {})
    assert calls == [2]


def test_a_tuning_process_past_its_time_is_a_failure_and_a_stale_record_is_tuned_again(tmp_path, monkeypatch):
    key = _key("slow")
    (tmp_path / f"{key}.meta.json").write_text(make_meta(key, H200).model_dump_json())  # an earlier call's
    monkeypatch.setattr(gpu_util.subprocess, "run", _times_out)
    private, _, _ = keygen(tmp_path / "keys")
    store = _Store({key: {"n": 1}})
    tuned, failed = gpu_util.tune_misses(SimpleNamespace(store=store), tmp_path, Signer.from_file(private))
    assert tuned == 0 and failed == {key: "tuning did not end within 600 s"} and store.published == {}


def _times_out(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
