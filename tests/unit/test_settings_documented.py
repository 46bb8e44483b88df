"""Every setting is documented: each ``PLANCACHE_*`` variable appears in docs/CONFIGURATION.md's table or in
docs/DEPLOYMENT.md (which the table points to for the request limits)."""

from __future__ import annotations

from pathlib import Path

from plancache.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_documented():
    table = ROOT.joinpath("docs", "CONFIGURATION.md").read_text()
    deployment = ROOT.joinpath("docs", "DEPLOYMENT.md").read_text()
    missing = [f"PLANCACHE_{name.upper()}" for name in Settings.model_fields
               if f"PLANCACHE_{name.upper()}" not in table and f"PLANCACHE_{name.upper()}" not in deployment]
    assert not missing, f"undocumented settings: {missing}"
