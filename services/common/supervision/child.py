"""One supervised child process: its own process group, killed with its supervisor, output relayed by line.

Each child is started in a new session (so a terminal's Ctrl-C reaches only the supervisor, which then
stops the children in order) with ``PR_SET_PDEATHSIG = SIGKILL`` (prctl(2), Linux), so the kernel
kills it when the supervisor dies, even by SIGKILL. Signals go to the child's whole process group, so
helpers a service forks die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable

from pdserve.parent_death import die_with_parent

TAIL_LINES = 20
MAX_LINE_BYTES = 1 << 20


def describe_exit(returncode: int) -> str:
    """``"exited with code 1"`` or ``"killed by SIGKILL"`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Child:
    """A running child process started by ``spawn``.

    Attributes:
        name: the service name ("decode-0").
        pid: its pid, also its process-group id.
        started: ``time.monotonic()`` at spawn.
        tail: its last ``TAIL_LINES`` output lines (stdout and stderr merged), for crash reports.
    """

    def __init__(self, name: str, proc: asyncio.subprocess.Process, on_line: Callable[[str, str], None]):
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._on_line = on_line
        self._relay = asyncio.get_running_loop().create_task(self._relay_output())

    @classmethod
    async def spawn(
        cls,
        name: str,
        argv: list[str],
        on_line: Callable[[str, str], None],
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start ``argv`` (with ``env`` added to this process's environment); each line it prints
        is passed to ``on_line(name, line)``.

        Raises OSError if the program cannot be started.
        """
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
            env={**os.environ, **env} if env else None,
            limit=MAX_LINE_BYTES,
        )
        return cls(name, proc, on_line)

    async def _relay_output(self) -> None:
        assert self.proc.stdout is not None
        while True:
            try:
                raw = await self.proc.stdout.readline()
            except ValueError:  # a line over MAX_LINE_BYTES: the reader dropped it
                raw = b"[output line too long; dropped]\n"
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            self._on_line(self.name, line)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def uptime(self) -> float:
        """Seconds since it was spawned."""
        return time.monotonic() - self.started

    async def wait(self) -> int:
        """Wait for the process to exit and its output to be relayed; returns its ``returncode``."""
        code = await self.proc.wait()
        await asyncio.shield(self._relay)  # a cancelled waiter must not stop the relay
        return code

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's process group (a no-op once the group is empty)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    async def stop(self, timeout: float) -> bool:
        """SIGTERM the group, SIGKILL it after ``timeout`` seconds; True if it stopped by itself."""
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self.wait()), timeout)
            graceful = True
        except TimeoutError:
            graceful = False
        self.signal(signal.SIGKILL)  # also whatever the child left behind in its group
        await self.wait()
        return graceful
