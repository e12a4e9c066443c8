"""The request id in every log line of a request's work.

`bind_request_id` sets it for the current asyncio task (a gRPC handler, an HTTP handler, one
generation's task); tasks started from there inherit it, other tasks never see it. The entry point
installs `RequestIdFilter` on its log handlers, and its format names `%(request_id)s` ("-" outside
any request). The engine thread runs outside every request's context: its lines name the request
in the message instead.
"""

from __future__ import annotations

import contextvars
import logging

NO_REQUEST = "-"
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default=NO_REQUEST)


def bind_request_id(request_id: str) -> None:
    """Tag the current task's (and its future child tasks') log lines with `request_id`."""
    _request_id.set(request_id or NO_REQUEST)


def current_request_id() -> str:
    return _request_id.get()


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id`; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


def configure_logging(level: str, process_name: str) -> None:
    """The entry point's one logging setup: every line names the process and the request."""
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s [{process_name}] [%(request_id)s] %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
