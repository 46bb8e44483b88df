"""Keep tokens out of the logs: a filter that masks bearer credentials, ``pct_…`` tokens and the admin token.

The app never logs headers; this guards what others log (uvicorn's access log prints the
request line, query string included, where a careless client might put a token).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from ..store.tokens import TOKEN_PREFIX

MASK = "[redacted]"
#: Loggers whose records the app's filter sees while it runs.
LOGGERS = ("uvicorn.access", "uvicorn.error", "plancache.server")
_PATTERNS = (re.compile(r"(?i)(bearer\s+)\S+"), re.compile(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_\-]+"))


class RedactTokens(logging.Filter):
    """Masks secrets in a record's message and its string arguments (keeping the argument tuple's shape,
    which uvicorn's access formatter unpacks)."""

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._secrets = tuple(s for s in secrets if s)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        for pattern in _PATTERNS:
            text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + MASK, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.scrub(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self.scrub(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


@contextmanager
def redacting(secrets: tuple[str, ...] = ()) -> Iterator[RedactTokens]:
    """Attach a :class:`RedactTokens` filter to :data:`LOGGERS` for the duration (the app's lifespan)."""
    filt = RedactTokens(secrets)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(filt)
    try:
        yield filt
    finally:
        for logger in loggers:
            logger.removeFilter(filt)
