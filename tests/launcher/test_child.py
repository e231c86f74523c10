"""Child processes of the launcher: own process group, death with the launcher, output relay, exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil

from pdserve.services.common.supervision.child import TAIL_LINES, Child, describe_exit

# A stand-in launcher: spawns `sleep 600` as a Child, prints the child's pid, then waits forever.
PARENT = """
import asyncio
from pdserve.services.common.supervision.child import Child

async def main():
    child = await Child.spawn("sleeper", ["sleep", "600"], lambda name, line: None)
    print(child.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` is dead (or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_child_dies_when_its_launcher_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        child = psutil.Process(pid)
        assert child.ppid() == parent.pid
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session and process group
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(pid, 5.0), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


async def test_output_is_relayed_by_line_and_the_tail_kept() -> None:
    lines: list[tuple[str, str]] = []
    script = "import sys\nfor i in range(30): print(f'line {i}')\nsys.stderr.write('oops\\n')\nsys.exit(3)"
    child = await Child.spawn("worker", [sys.executable, "-c", script], lambda *a: lines.append(a))
    assert await child.wait() == 3
    expected = [f"line {i}" for i in range(30)] + ["oops"]
    assert lines == [("worker", text) for text in expected]
    assert list(child.tail) == expected[-TAIL_LINES:]
    assert describe_exit(child.returncode) == "exited with code 3"


async def test_stop_is_graceful_when_the_child_obeys_sigterm() -> None:
    child = await Child.spawn("sleeper", ["sleep", "600"], lambda *a: None)
    assert await child.stop(timeout=10.0) is True
    assert describe_exit(child.returncode) == "killed by SIGTERM"


async def test_stop_kills_a_stubborn_child_and_its_whole_group() -> None:
    # ignores SIGTERM and leaves a grandchild in its process group
    script = "trap '' TERM; sleep 600 & echo $!; wait"
    pids: list[str] = []
    child = await Child.spawn("stubborn", ["sh", "-c", script], lambda name, line: pids.append(line))
    while not pids:
        await asyncio.sleep(0.05)
    grandchild = int(pids[0])
    assert os.getpgid(grandchild) == child.pid
    t0 = time.monotonic()
    assert await child.stop(timeout=1.0) is False
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert describe_exit(child.returncode) == "killed by SIGKILL"
    assert _gone(grandchild, 5.0), "the grandchild survived"
