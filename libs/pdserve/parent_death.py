"""``die_with_parent``: a child process that the kernel kills when its parent dies (Linux).

``PR_SET_PDEATHSIG = SIGKILL`` (prctl(2)) survives exec and fires even when the parent is killed by
SIGKILL, so helpers (a launcher's services, a TP scheduler's ranks, a grammar probe) never outlive
the process that serves with them. The signal comes when the parent *thread* that created the
child ends: create such children from threads that live as long as the parent process needs them.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A function arming the parent-death signal: a ``preexec_fn`` (runs in the forked child before
    exec) or the first call of a spawned child. If the parent (pid ``parent_pid``) already died
    before the call, the child has been re-parented and kills itself at once.

    Raises (from the returned function):
        OSError: prctl failed (not Linux).
    """

    def arm() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return arm
