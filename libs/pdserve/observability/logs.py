"""Logging of every pdserve process: ``--log-format text`` or ``json`` (python-json-logger), with the
request id (rid) on every line logged while a request is being handled.

The rid comes from ``extra={"rid": ...}`` on the call, or else from the context variable that
``bind_rid`` sets: the gateway binds it per HTTP request (so uvicorn's access line carries it too),
the gRPC servers per call whose request message has a ``rid`` field (``rpc_observer``). Context
variables follow asyncio tasks, so a line logged anywhere below a handler carries its rid.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
from collections.abc import Iterator

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LOG_FORMATS = ("text", "json")

_rid: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_rid", default="")
# LogRecord attributes that are not fields of a JSON line (uvicorn adds color_message)
_RESERVED = (*RESERVED_ATTRS, "color_message")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` (every service and the launcher)."""
    parser.add_argument("--log-level", default="info", help="logging level")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (timestamp, level, service, logger, message, rid)",
    )


def current_rid() -> str:
    """The rid bound in this context ("" outside a request)."""
    return _rid.get()


def bind_rid(rid: str) -> contextvars.Token:
    """Bind ``rid`` to the current context (task) until ``unbind_rid`` (or the task ends)."""
    return _rid.set(rid)


def unbind_rid(token: contextvars.Token) -> None:
    _rid.reset(token)


@contextlib.contextmanager
def rid_bound(rid: str) -> Iterator[None]:
    """``with rid_bound(rid):`` lines logged inside carry ``rid``."""
    token = bind_rid(rid)
    try:
        yield
    finally:
        unbind_rid(token)


class RidFilter(logging.Filter):
    """Sets ``record.rid`` from the bound rid unless the call passed one in ``extra``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "rid", ""):
            rid = _rid.get()
            if rid:
                record.rid = rid
        return True


class TextFormatter(logging.Formatter):
    """``<time> <service> <LEVEL> <logger>: <message> [rid=<rid>]``."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "rid", "")
        return f"{line} [rid={rid}]" if rid else line


def json_formatter(service: str) -> JsonFormatter:
    """One JSON object per line: ``timestamp`` (ISO 8601, UTC), ``level``, ``service``, ``logger``,
    ``message``, ``rid`` when bound, ``exc_info`` with a traceback, and any ``extra`` fields."""
    return JsonFormatter(
        ["levelname", "name", "message"],
        rename_fields={"levelname": "level", "name": "logger"},
        static_fields={"service": service},
        timestamp=True,
        reserved_attrs=_RESERVED,
    )


def setup_logging(level: str, service: str, fmt: str = "text") -> None:
    """Configure the root logger of this process: one stream handler (stderr) in ``fmt`` with the rid
    filter. uvicorn's loggers propagate to it (the gateway starts uvicorn with ``log_config=None``).

    Raises:
        ValueError: ``fmt`` is not one of ``LOG_FORMATS`` or ``level`` is not a level name.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(json_formatter(service) if fmt == "json" else TextFormatter(service))
    handler.addFilter(RidFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()  # uvicorn's own config, if one ran, writes elsewhere
        logging.getLogger(name).propagate = True
