"""Sampling profiles of running services with py-spy, summarised per service.

``py-spy record --nonblocking`` samples a process's Python stacks from outside (the process is not
paused; a sample may now and then be torn), so the services run as they do unprofiled. Each
profile is summarised into its hottest frames by own samples and by inclusive samples: where a
service's CPU time goes, per function.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

RATE_HZ = 200


def py_spy() -> str | None:
    """The py-spy executable (the ``dev`` extra installs it beside this Python), or None."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextmanager
def profiled(processes: dict[str, psutil.Process], out_dir: Path, tag: str) -> Iterator[dict[str, Path]]:
    """Sample every process of ``processes`` while the block runs; yields ``{name: raw profile path}``
    (``<out_dir>/<tag>-<name>.txt``, py-spy's raw format: ``frame;frame;... count`` lines), written
    once the block has ended. Raises RuntimeError without py-spy."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy, or the dev extra)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{tag}-{name}.txt" for name in processes}
    procs = [
        subprocess.Popen(
            [exe, "record", "--pid", str(p.pid), "--rate", str(RATE_HZ), "--format", "raw", "--nonblocking"]
            + ["--output", str(paths[name])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, p in processes.items()
    ]
    try:
        yield paths
    finally:
        for proc in procs:
            proc.send_signal(subprocess.signal.SIGINT)  # py-spy writes its output on SIGINT
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def summarize_profile(path: Path, top: int = 12) -> dict:
    """``{"samples", "self": [[frame, share], ...], "inclusive": [...]}``: the ``top`` frames by own and
    by inclusive samples of a raw py-spy profile (shares of all samples; idle samples included)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def shares(counter: Counter[str]) -> list[list]:
        return [[frame, round(n / total, 4)] for frame, n in counter.most_common(top)] if total else []

    return {"samples": total, "self": shares(own), "inclusive": shares(inclusive)}
