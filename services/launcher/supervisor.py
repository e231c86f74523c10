"""Start services in order, wait for their health checks, restart crashes, stop them all on exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx

from pdserve.rpc.server import wait_for_health
from pdserve.services.launcher.topology import ServiceSpec

logger = logging.getLogger("pdserve.launch")

MAX_BACKOFF_S = 30.0


class Supervisor:
    """Owns every child process of a ``pdserve launch``.

    Args:
        specs: the services, in start order.
        startup_timeout: seconds each start-up group may take to become healthy.
        grace: seconds a child gets between SIGTERM and SIGKILL when stopping.
    """

    def __init__(self, specs: list[ServiceSpec], startup_timeout: float = 600.0, grace: float = 10.0) -> None:
        self.specs = specs
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.restarts: dict[str, int] = {}
        self.stopping = False

    async def _spawn(self, spec: ServiceSpec) -> None:
        self.procs[spec.name] = await asyncio.create_subprocess_exec(*spec.command, env=os.environ.copy())
        logger.info("started %s (pid %d)", spec.name, self.procs[spec.name].pid)

    async def _healthy(self, spec: ServiceSpec, timeout: float) -> bool:
        if not spec.health.startswith("http"):
            return await wait_for_health(spec.health, timeout)
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(spec.health)).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.3)
        return False

    async def start_all(self) -> None:
        """Start roles group by group (text services, schedulers, gateway), waiting for each.

        Raises RuntimeError naming the service that did not become healthy.
        """
        groups: list[list[ServiceSpec]] = [[], [], []]
        for spec in self.specs:
            groups[{"tokenizer": 0, "detokenizer": 0, "gateway": 2}.get(spec.role, 1)].append(spec)
        t0 = time.monotonic()
        done = 0
        for group in groups:
            for spec in group:
                await self._spawn(spec)
            results = await asyncio.gather(*(self._healthy(s, self.startup_timeout) for s in group))
            for spec, ok in zip(group, results, strict=True):
                if not ok:
                    raise RuntimeError(
                        f"{spec.name} did not become healthy within {self.startup_timeout:.0f} s"
                    )
                done += 1
                print(
                    f"[{done}/{len(self.specs)}] {spec.name} ready ({time.monotonic() - t0:.1f} s)",
                    flush=True,
                )

    async def watch(self, stop: asyncio.Event) -> None:
        """Restart a crashed service with exponential backoff until ``stop`` is set."""
        while not stop.is_set():
            for spec in self.specs:
                proc = self.procs.get(spec.name)
                if proc is None or proc.returncode is None or self.stopping:
                    continue
                n = self.restarts.get(spec.name, 0)
                backoff = min(MAX_BACKOFF_S, 2.0**n)
                logger.warning(
                    "%s exited with code %s; restarting in %.0f s (restart #%d)",
                    spec.name,
                    proc.returncode,
                    backoff,
                    n + 1,
                )
                self.restarts[spec.name] = n + 1
                del self.procs[spec.name]
                asyncio.create_task(self._restart(spec, backoff))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass

    async def _restart(self, spec: ServiceSpec, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.stopping:
            await self._spawn(spec)

    async def stop_all(self) -> None:
        """SIGTERM every child (gateway first, so it stops taking requests), SIGKILL after ``grace``."""
        self.stopping = True
        for spec in reversed(self.specs):
            proc = self.procs.get(spec.name)
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                await asyncio.wait_for(proc.wait(), self.grace)
            except TimeoutError:
                logger.warning("%s did not stop within %.0f s; killing it", name, self.grace)
                proc.kill()
                await proc.wait()
