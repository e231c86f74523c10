"""Start pdserve for the benchmark (``--launch`` / ``--compare``) on free ports, and stop it after.

The launching itself is the test suite's ``tests.stack.launch_stack`` (``pdserve launch`` in a
subprocess, healthy ``/health`` awaited), so the benchmark must run from the repository root.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.stack import Stack

DEFAULT_FLAGS = "--colocated"


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One pdserve configuration: a ``label`` for the report, the ``pdserve launch`` flags, and the
    checkout to run (its ``.venv``; None: this one)."""

    label: str
    flags: str
    checkout: str | None = None

    @property
    def python(self) -> str:
        if self.checkout is None:
            return sys.executable
        return str(Path(self.checkout) / ".venv" / "bin" / "python")


def parse_compare(spec: str) -> LaunchSpec:
    """``"LABEL=FLAGS"`` or ``"LABEL@CHECKOUT=FLAGS"`` (another pdserve checkout with its own ``.venv``,
    e.g. for before / after runs) → :class:`LaunchSpec`. Raises ValueError without a non-empty label
    before ``=``."""
    head, sep, flags = spec.partition("=")
    label, _, checkout = head.partition("@")
    if not sep or not label.strip():
        raise ValueError(f"--compare expects LABEL=FLAGS or LABEL@CHECKOUT=FLAGS, got {spec!r}")
    return LaunchSpec(label.strip(), flags.strip(), checkout.strip() or None)


@contextmanager
def launched(spec: LaunchSpec) -> Iterator[Stack]:
    """Run ``pdserve launch <spec.flags>`` while the block runs; yields the running ``Stack`` (its
    ``base_url`` is the server root, its ``proc`` the launcher process).

    The log goes to ``$PDSERVE_TEST_LOG_DIR/bench-<label>.log`` (default /tmp/pdserve-test-logs).
    Raises RuntimeError (with the log's tail) if the stack does not become healthy.
    """
    from tests.stack import launch_stack

    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in spec.label)
    stack = launch_stack(*shlex.split(spec.flags), log_name=f"bench-{safe}", python=spec.python)
    try:
        yield stack
    finally:
        stack.stop()
