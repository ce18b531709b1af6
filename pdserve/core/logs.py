"""Logging for every pdserve process: one handler on the root logger, text or JSON lines,
and the id of the request being served on every record logged while serving it.

The id lives in a ``ContextVar`` (``request_id_var``), set by the router's HTTP edge for
the duration of a request. asyncio copies the context into every task a request starts
(the dispatcher's abort tasks included), so a log line about a request carries its id
without any call site passing it along. The filter sits on the handler, not on a
logger, so records of every library logger get the attribute too.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from typing import IO, Any

LOG_FORMATS = ("text", "json")
DEFAULT_LOG_FORMAT = "text"

request_id_var: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (None outside a request) and ``request_tag`` (`` [<id>]`` or
    empty, for the text format) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_var.get()
        record.request_id = request_id
        record.request_tag = f" [{request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what a log pipeline indexes without a parsing rule."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def make_handler(log_format: str = DEFAULT_LOG_FORMAT,
                 stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler (stderr by default) in ``log_format`` with the request-id filter."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; valid: {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    return handler


# Libraries that log every call at INFO (httpx: each of up's `GET /health` polls).
_CHATTY_LOGGERS = ("httpx", "httpcore")


def setup_logging(level: str = "INFO", log_format: str = DEFAULT_LOG_FORMAT) -> None:
    """Replace the root logger's handlers with one ``make_handler(log_format)``; the
    chatty libraries log warnings only (their DEBUG lines still show at DEBUG)."""
    logging.basicConfig(level=level.upper(), handlers=[make_handler(log_format)], force=True)
    root = logging.getLogger().level
    quiet = root if root <= logging.DEBUG else max(logging.WARNING, root)
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
