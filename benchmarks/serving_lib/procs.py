"""What the processes of a benchmark run use: CPU seconds over a block, and the native kernels loaded.

Read with psutil. The kernels matter when two sides are compared: pdserve builds its C kernels on
first use, keyed by their source (``pdserve.layers.native``), so two processes started from different
versions of the source, or one whose build failed (PyTorch fallback), run different code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from pdserve.model_source import cache_dir


def pdserve_processes(launcher_pid: int) -> dict[str, psutil.Process]:
    """The services under a ``pdserve launch`` process, by role (``gateway``, ``decode``, ...).

    A role that runs several times gets ``-1``, ``-2`` ... suffixes after the first.
    """
    named: dict[str, psutil.Process] = {}
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "pdserve.cli" not in cmd or cmd.index("pdserve.cli") + 1 >= len(cmd):
            continue
        role = cmd[cmd.index("pdserve.cli") + 1]
        name, n = role, 0
        while name in named:
            n += 1
            name = f"{role}-{n}"
        named[name] = proc
    return named


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


@contextmanager
def cpu_seconds(processes: dict[str, psutil.Process]) -> Iterator[dict[str, float]]:
    """Yield a dict that, once the block ends, maps each name to the CPU seconds (user + system)
    its process used meanwhile. A process that exited meanwhile is left out.
    """
    before = {name: _cpu_s(p) for name, p in processes.items()}
    used: dict[str, float] = {}
    yield used
    for name, proc in processes.items():
        try:
            used[name] = round(_cpu_s(proc) - before[name], 3)
        except psutil.Error:
            pass


def loaded_kernels(proc: psutil.Process) -> list[str]:
    """File names of the pdserve C kernels (``<name>-<source hash>.so``) mapped into ``proc``, sorted."""
    kernels = cache_dir() / "kernels"
    return sorted({Path(m.path).name for m in proc.memory_maps() if Path(m.path).parent == kernels})


def rerun_with_scheduler_env(module: str, argv: list[str]) -> None:
    """Re-run ``python -m module argv`` in this process with the environment ``pdserve launch`` gives
    its schedulers (``topology.scheduler_env``), unless it has it already, so that a scheduler driven
    in this process runs its OpenMP threads as the stack's do (libgomp reads its settings once, when
    it loads). A pdserve without ``scheduler_env`` (an older checkout) changes nothing."""
    try:
        from pdserve.services.launcher.topology import scheduler_env
    except ImportError:
        return
    missing = {k: v for k, v in scheduler_env().items() if os.environ.get(k) != v}
    if missing:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], os.environ | missing)
