"""A supervisor's terminal output: its own log lines, its children's output, and a live status line.

Everything goes to one stream, one line at a time. On a TTY a status line (start-up progress) stays at
the bottom and is redrawn in place under the lines printed above it; on anything else (a file, a pipe)
the status line is not drawn and the output is plain text.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

CLEAR_LINE = "\r\x1b[2K"


class Console:
    """Line-oriented output with an optional live status line.

    Args:
        stream: where to write (default ``sys.stdout``).
        live: draw the status line; default: whether ``stream`` is a TTY.
        json_lines: JSON logs (``--log-format json``): a child's JSON lines pass through as they are
            (they name their service) and its other output becomes ``{"service", "message"}`` lines,
            so that every line is one JSON object; no status line.
    """

    def __init__(
        self, stream: TextIO | None = None, live: bool | None = None, json_lines: bool = False
    ) -> None:
        self.stream = stream or sys.stdout
        self.json_lines = json_lines
        self.live = not json_lines and (self.stream.isatty() if live is None else live)
        self._status = ""
        self.name_width = 0

    def _write(self, text: str) -> None:
        """Write and flush; once the stream fails (its terminal closed), output is dropped."""
        if self.stream.closed:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:
            self.stream.close()

    def print(self, text: str) -> None:
        """Write ``text`` as whole line(s) above the status line."""
        redraw = self.live and self._status
        self._write(f"{CLEAR_LINE if redraw else ''}{text}\n{self._status if redraw else ''}")

    def announce(self, text: str) -> None:
        """A line of the launcher's own for the operator (start-up progress, "pdserve is up"): plain
        text, or with ``json_lines`` an INFO record of the ``pdserve.launch`` logger (whose handler,
        a ``ConsoleHandler``, writes it as JSON), so that every line is one JSON object."""
        if self.json_lines:
            logging.getLogger("pdserve.launch").info(text)
        else:
            self.print(text)

    def child_line(self, name: str, line: str) -> None:
        """A line of a child's output, prefixed with its name: ``"decode-0    | ..."`` (JSON: see
        ``json_lines``; the launcher's name for the child is its ``process`` field)."""
        if not self.json_lines:
            self.print(f"{name:<{self.name_width}} | {line}")
        elif line.startswith("{") and line.endswith("}"):
            self.print(f'{{"process": {json.dumps(name)}, {line[1:]}')
        elif line.strip():
            self.print(json.dumps({"process": name, "service": name.split("-")[0], "message": line}))

    def status(self, text: str) -> None:
        """Replace the live status line (``""`` removes it); a no-op when not live."""
        if not self.live:
            return
        self._status = text
        self._write(CLEAR_LINE + text)


class ConsoleHandler(logging.Handler):
    """A logging handler that prints records through a ``Console`` (so they don't break its status line)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record))
        except Exception:
            self.handleError(record)
