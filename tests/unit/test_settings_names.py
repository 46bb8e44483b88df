"""A ``PLANCACHE_*`` variable that names no setting (a typo) is not ignored without a word: reading the settings
warns once per process, naming the closest setting."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from plancache import settings
from plancache.settings import ClientSettings, unknown_variables


def test_a_mistyped_name_is_told_with_the_closest_setting():
    environ = {"PLANCACHE_DATABSE_URL": "x", "PLANCACHE_TRUSTED_KEY": "k", "PLANCACHE_ZZZ": "1",
               "PLANCACHE_open_reads": "1", "PLANCACHE_SERVER_URL": "http://h", "PLANCACHE_TEST_POSTGRES_URL": "p",
               "PLANCACHE_WORKER_TOKEN": "docker compose's", "HOME": "/root"}
    assert unknown_variables(environ) == {"PLANCACHE_DATABSE_URL": "PLANCACHE_DATABASE_URL",
                                          "PLANCACHE_TRUSTED_KEY": "PLANCACHE_TRUSTED_KEYS", "PLANCACHE_ZZZ": None}


def test_reading_settings_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setenv("PLANCACHE_REQUEST_DEADLNE", "1")
    with caplog.at_level(logging.WARNING, logger="plancache"):
        assert ClientSettings().request_deadline == 5.0  # the typo is not read
        ClientSettings()
    lines = [r.getMessage() for r in caplog.records if "PLANCACHE_REQUEST_DEADLNE" in r.getMessage()]
    assert lines == ["warning: PLANCACHE_REQUEST_DEADLNE is not a plancache setting and is ignored: did you mean "
                     "PLANCACHE_REQUEST_DEADLINE?"]


@pytest.mark.parametrize("name", ["PLANCACHE_PORT", "PLANCACHE_SIGNING_KEY_FILE", "PLANCACHE_WORKER_TOKEN"])
def test_docker_composes_own_variables_are_known(name):
    text = (Path(__file__).resolve().parents[2] / "docker" / "compose.yaml").read_text()
    assert name in text and unknown_variables({name: "x"}) == {}
