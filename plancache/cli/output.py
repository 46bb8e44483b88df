"""Printing what others wrote (names, worker ids, a job's error, file names) as plain text: no control character, no
markup."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN``: a device name, worker id or job error a worker sent
    never reaches a terminal as an escape sequence (a title set, a screen cleared) or a line break."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def plain_console(width: int | None = None) -> Console:
    """A rich console that prints text verbatim: names, worker ids and file names are data, never markup or emoji
    codes (a token named ``ci [/bold] team`` made every listing fail)."""
    from rich.console import Console

    return Console(width=width, markup=False, emoji=False, highlight=False)
