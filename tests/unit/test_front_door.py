"""The front door speaks about the product: a LICENSE matching pyproject.toml, and no development history
(issue numbers, sessions, borrowed machines, "before/after", "now calls", "tried and dropped") in the README or
docs/: they describe the product as it is."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\bissue #?\d+|\b(this|earlier|previous) session\b|\bthe lent\b"
                     r"|\bbefore\s*(/|\|)\s*after\b|\bnow calls\b|\btried and dropped\b|\bthe (one|run) before\b"
                     r"|\ban earlier run\b|\bwas: ", re.I)


def test_the_license_file_is_the_one_pyproject_names():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_docs_tell_no_history_of_their_own_making():
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
