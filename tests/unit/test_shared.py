"""The helpers every layer shares: atomic file writes, canonical JSON, validation messages."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from plancache.canonical import canonical_json
from plancache.files import atomic_write
from plancache.validation import Int, StrictModel, validation_message


def test_atomic_write_replaces_whole_files_with_the_mode_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    atomic_write(path, b"one")
    assert path.read_bytes() == b"one" and stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write(path, b"two", mode=0o644)
    assert path.read_bytes() == b"two" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["f.bin"]  # no temporary file left behind


def test_an_exclusive_atomic_write_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "key"
    atomic_write(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first" and os.listdir(tmp_path) == ["key"]


def test_a_failed_atomic_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "f", b"x")
    assert os.listdir(tmp_path) == []


def test_canonical_json_is_sorted_compact_utf8_and_refuses_nan() -> None:
    assert canonical_json({"b": [1, 2], "a": "é"}) == '{"a":"é","b":[1,2]}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


class _Model(StrictModel):
    n: Int
    name: str


def test_validation_message_names_each_problem_up_to_the_limit() -> None:
    with pytest.raises(ValidationError) as caught:
        _Model.model_validate({"n": True, "extra": 1})
    problems = caught.value.errors()
    assert len(problems) == 3  # a boolean for an integer, a missing field, an unknown field
    assert validation_message(problems).startswith("n: Value error, Input should be an integer, not a boolean; ")
    assert validation_message(problems, 1).endswith("; and 2 more problem(s)")
    assert validation_message(problems, None).count(": ") == 3
    assert validation_message([]) == ""
