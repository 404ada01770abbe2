"""The server's log lines: one line each, ``k3 serve: LEVEL: message``, never a traceback.

uvicorn logs an exception escaping the application with its traceback. Every failure the
app expects is answered with an error body and logs nothing, so such a line would mean a
bug; it is still printed, but as the exception's type and message on the same line, so the
server's stderr never carries a traceback.
"""

from __future__ import annotations

import logging
from typing import Any


class OneLine(logging.Formatter):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__("k3 serve: %(levelname)s: %(message)s")

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        exc = ei[1]
        return f"({type(exc).__name__}: {exc})" if exc is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return " ".join(text.splitlines())


def log_config(level: str = "WARNING") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn and ``k3.serve``: one line per record."""
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "one"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"one": {"()": OneLine}},
        "handlers": {"stderr": handler},
        "loggers": {name: {"handlers": ["stderr"], "level": level, "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "k3.serve")},
    }
