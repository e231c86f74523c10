"""The launcher's output: plain lines when not on a TTY, a live status line redrawn under them on a TTY."""

from __future__ import annotations

import io
import json
import logging
import os
import pty

from pdserve.services.common.supervision.console import CLEAR_LINE, Console, ConsoleHandler


def test_plain_output_has_no_status_line_or_escape_codes() -> None:
    out = io.StringIO()
    console = Console(out)
    assert console.live is False  # a StringIO is not a TTY
    console.name_width = 8
    console.status("waiting for decode-0")
    console.child_line("decode-0", "loaded")
    console.print("[1/1] decode-0 ready (1.0 s)")
    assert out.getvalue() == "decode-0 | loaded\n[1/1] decode-0 ready (1.0 s)\n"


def test_live_status_line_stays_below_printed_lines() -> None:
    out = io.StringIO()
    console = Console(out, live=True)
    console.status("waiting (1 s)")
    console.print("tokenizer ready")
    console.status("waiting (2 s)")
    console.status("")
    console.print("done")
    assert out.getvalue() == (
        f"{CLEAR_LINE}waiting (1 s)"
        f"{CLEAR_LINE}tokenizer ready\nwaiting (1 s)"
        f"{CLEAR_LINE}waiting (2 s)"
        f"{CLEAR_LINE}"
        "done\n"
    )


def test_a_terminal_is_detected_as_live() -> None:
    primary, secondary = pty.openpty()
    try:
        with os.fdopen(secondary, "w", closefd=False) as tty:
            assert Console(tty).live is True
    finally:
        os.close(primary)
        os.close(secondary)


def test_log_records_go_through_the_console() -> None:
    out = io.StringIO()
    handler = ConsoleHandler(Console(out, live=True))
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("pdserve.test_console")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("decode-0 killed by SIGKILL")
    finally:
        logger.removeHandler(handler)
    assert out.getvalue() == "WARNING decode-0 killed by SIGKILL\n"


def test_json_lines_keep_every_line_json(caplog) -> None:
    """With --log-format json the launcher's own announcements are log records, children's plain
    output is wrapped, and their JSON lines gain the launcher's name for them."""
    out = io.StringIO()
    console = Console(out, json_lines=True)
    console.child_line("decode-0", '{"message": "loaded", "service": "decode"}')
    console.child_line("decode-0", "NIXL INFO backend ready")
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"process": "decode-0", "message": "loaded", "service": "decode"},
        {"process": "decode-0", "service": "decode", "message": "NIXL INFO backend ready"},
    ]
    with caplog.at_level(logging.INFO, logger="pdserve.launch"):
        console.announce("[1/5] tokenizer ready (1.0 s)")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("pdserve.launch", "[1/5] tokenizer ready (1.0 s)")
    ]
    assert len(out.getvalue().splitlines()) == 2  # written by the log handler, not as plain text
