"""The server's log lines: one line each, ``k3 serve: LEVEL: message``, never a traceback.

uvicorn logs an exception escaping the application with its traceback. Every failure the
app expects is answered with an error body and logs nothing, so such a line would mean a
bug; it is still printed, but as the exception's type and message on the same line, so the
server's stderr never carries a traceback.

No record floods the log either: one kind of record (its logger and message template) is
printed at most once a second (:class:`RateLimit`); the next one printed says how many like
it were left out. Connection events are counted and summarized the same way
(``k3core.serve.connections``). The one line per request (``k3core.serve.access``, logger
``k3.serve.requests``) is the exception: every request gets its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any


class OneLine(logging.Formatter):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__("k3 serve: %(levelname)s: %(message)s")

    def formatException(self, ei: Any) -> str:  # logging's name
        exc = ei[1]
        return f"({type(exc).__name__}: {exc})" if exc is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return " ".join(text.splitlines())


class RateLimit(logging.Filter):
    """At most one record of a kind (logger and message template) per ``interval`` seconds."""

    def __init__(self, interval: float = 1.0):
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._left_out: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "summary", False):  # a summary line keeps its own pace
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return False
        self._last[key] = now
        n = self._left_out.pop(key, 0)
        if n:
            record.msg = f"{record.msg} ({n} more like it left out of the log)"
        return True


def log_config(level: str = "WARNING") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn, asyncio and ``k3.serve``: one line per
    record, each kind at most once a second."""
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "one",
               "filters": ["rate"]}
    loggers = {name: {"handlers": ["stderr"], "level": level, "propagate": False}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio", "k3.serve")}
    # one line per request (k3core.serve.access): not rate-limited, each request has its own
    requests = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "one"}
    loggers["k3.serve.requests"] = {"handlers": ["requests"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"one": {"()": OneLine}},
        "filters": {"rate": {"()": RateLimit}},
        "handlers": {"stderr": handler, "requests": requests},
        "loggers": loggers,
    }
