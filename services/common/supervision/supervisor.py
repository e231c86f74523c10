"""Start services in order, wait for their health checks, restart crashes and hangs, drain and stop
them all on exit (``pdserve launch``'s whole topology, ``pdserve gateway --workers N``'s processes).

A running service is also watched for liveness: its grpc.health.v1 status ("" on ``spec.liveness``)
must answer SERVING. A process that is stopped, whose event loop is stuck, or whose scheduler step
is stuck (it reports NOT_SERVING, ``services.common.liveness``) fails that for ``liveness_timeout``
seconds: it is SIGKILLed, and restarted like a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import ssl
import time
from collections.abc import Awaitable, Callable

import httpx

from pdserve.rpc.health_watch import watch_address
from pdserve.rpc.server import wait_for_health
from pdserve.services.common.supervision.child import Child, describe_exit
from pdserve.services.common.supervision.console import Console
from pdserve.services.common.supervision.spec import ServiceSpec

logger = logging.getLogger("pdserve.launch")

MAX_BACKOFF_S = 30.0
# a child that stayed up this long before crashing restarts after the shortest backoff again
BACKOFF_RESET_S = 60.0
CRASH_TAIL_LINES = 5
ABORT_MARGIN_S = 10.0  # after its drain timeout, the gateway's time to abort what is left, flush and exit
DEFAULT_LIVENESS_TIMEOUT_S = 30.0
SPINNER = "|/-\\"


class Supervisor:
    """Owns every child process of a ``pdserve launch`` (or of a ``pdserve gateway --workers N``).

    Args:
        specs: the services (see the launcher's ``topology.build_topology``).
        console: where progress, the children's output and the restart log go.
        startup_timeout: seconds a service may take to become healthy (at start and after a restart).
        drain_timeout: seconds the gateway and the schedulers get, once told to stop, to let
            in-flight requests finish; they then have ``ABORT_MARGIN_S`` more to abort what is left
            and exit before they are killed.
        grace: seconds the tokenizer and detokenizer get between SIGTERM and SIGKILL.
        http_verify: how the gateway's HTTPS health check verifies its certificate (httpx ``verify``).
        liveness_timeout: seconds a running service may leave its liveness check unanswered
            (not SERVING) before it is SIGKILLed and restarted; 0 = never.
        on_ready: awaited with a service's spec each time it becomes healthy (at start and after
            every restart), before it counts as ready (the launcher pins a scheduler's KV pool).

    Attributes:
        children: name -> the running ``Child``.
        restarts: name -> how many times it was restarted.
    """

    def __init__(
        self,
        specs: list[ServiceSpec],
        console: Console,
        startup_timeout: float = 600.0,
        drain_timeout: float = 30.0,
        grace: float = 10.0,
        http_verify: ssl.SSLContext | bool = True,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT_S,
        on_ready: Callable[[ServiceSpec], Awaitable[None]] | None = None,
    ) -> None:
        self.specs = specs
        self.console = console
        console.name_width = max(len(s.name) for s in specs)
        self.startup_timeout = startup_timeout
        self.drain_timeout = drain_timeout
        self.grace = grace
        self.http_verify = http_verify
        self.liveness_timeout = liveness_timeout
        self.on_ready = on_ready
        self.children: dict[str, Child] = {}
        self.restarts: dict[str, int] = {}
        self.stopping = False
        self._keepers: list[asyncio.Task] = []

    def stages(self) -> list[list[ServiceSpec]]:
        """The specs grouped by start stage, in start order."""
        ordered = sorted(self.specs, key=lambda s: s.stage)
        return [list(g) for _, g in itertools.groupby(ordered, key=lambda s: s.stage)]

    async def _spawn(self, spec: ServiceSpec) -> Child:
        child = await Child.spawn(spec.name, spec.command, self.console.child_line, spec.env)
        self.children[spec.name] = child
        logger.info("started %s (pid %d)", spec.name, child.pid)
        return child

    async def _poll_health(self, spec: ServiceSpec) -> bool:
        if not spec.health.startswith("http"):
            return await wait_for_health(spec.health, self.startup_timeout)
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=2.0, verify=self.http_verify) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(spec.health)).status_code == 200:
                        return True
                await asyncio.sleep(0.3)
        return False

    async def _ready(self, spec: ServiceSpec, child: Child) -> None:
        """Wait until ``spec`` answers its health check.

        Raises RuntimeError if the child exits first or ``startup_timeout`` passes.
        """
        health = asyncio.ensure_future(self._poll_health(spec))
        exited = asyncio.ensure_future(child.wait())
        await asyncio.wait({health, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if not health.done():
            health.cancel()
            raise RuntimeError(f"{spec.name} {describe_exit(child.returncode)} while starting{_tail(child)}")
        if not health.result():
            raise RuntimeError(f"{spec.name} did not become healthy within {self.startup_timeout:.0f} s")

    async def start_all(self) -> None:
        """Start the stages in order, each only once the previous one is healthy; show progress.

        Prints ``[k/n] name ready (t s)`` as each service becomes healthy (plus a live status line on
        a TTY). Raises RuntimeError naming the first service that failed to start.
        """
        t0 = time.monotonic()
        waiting: list[str] = []
        done = 0

        async def ready(spec: ServiceSpec, child: Child) -> None:
            nonlocal done
            await self._ready(spec, child)
            if self.on_ready is not None:
                await self.on_ready(spec)
            done += 1
            waiting.remove(spec.name)
            elapsed = time.monotonic() - t0
            self.console.announce(f"[{done}/{len(self.specs)}] {spec.name} ready ({elapsed:.1f} s)")

        async def show_progress() -> None:
            for tick in itertools.count():
                spin = SPINNER[tick % len(SPINNER)]
                elapsed = time.monotonic() - t0
                self.console.status(
                    f"{spin} [{done}/{len(self.specs)}] waiting for {', '.join(waiting)} ({elapsed:.0f} s)"
                )
                await asyncio.sleep(0.25)

        progress = asyncio.ensure_future(show_progress())
        try:
            for stage in self.stages():
                children = [await self._spawn(spec) for spec in stage]
                waiting.extend(spec.name for spec in stage)
                async with asyncio.TaskGroup() as group:
                    for spec, child in zip(stage, children, strict=True):
                        group.create_task(ready(spec, child))
        except* RuntimeError as failed:
            raise failed.exceptions[0] from None
        finally:
            progress.cancel()
            self.console.status("")

    async def supervise(self, stop: asyncio.Event) -> None:
        """Keep every service running (restarting crashed ones with backoff) until ``stop`` is set."""
        self._keepers = [asyncio.ensure_future(self._keep_alive(spec)) for spec in self.specs]
        await stop.wait()

    async def _wait_exit(self, spec: ServiceSpec, child: Child) -> int:
        """Wait for ``child`` to exit, SIGKILLing it first if it fails its liveness check."""
        watcher = asyncio.ensure_future(self._watch_liveness(spec, child))
        try:
            return await child.wait()
        finally:
            watcher.cancel()

    async def _watch_liveness(self, spec: ServiceSpec, child: Child) -> None:
        """SIGKILL ``child`` once it has not answered SERVING for ``liveness_timeout`` seconds."""
        if not (self.liveness_timeout and spec.liveness):
            return
        async with watch_address(spec.liveness, self.liveness_timeout) as watch:
            silent = await watch.wait_silent()
        logger.error(
            "%s (pid %d) did not answer its liveness check for %.1f s (hung or stopped): killing it",
            spec.name, child.pid, silent,
        )  # fmt: skip
        child.signal(signal.SIGKILL)

    async def _keep_alive(self, spec: ServiceSpec) -> None:
        """Restart ``spec`` whenever its process exits (or hangs, and is killed): after 1, 2, 4 ...
        30 s of backoff (doubling over consecutive quick crashes), logging how it exited and its last
        output lines."""
        failures = 0
        while True:
            child = self.children[spec.name]
            code = await self._wait_exit(spec, child)
            if self.stopping:
                return
            child.signal(signal.SIGKILL)  # whatever it left behind in its process group
            uptime = child.uptime
            failures = 1 if uptime >= BACKOFF_RESET_S else failures + 1
            delay = min(MAX_BACKOFF_S, 2.0 ** (failures - 1))
            self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
            logger.warning(
                "%s (pid %d) %s after %.0f s up; restarting it in %.0f s (restart #%d)%s",
                spec.name, child.pid, describe_exit(code), uptime, delay, self.restarts[spec.name],
                _tail(child),
            )  # fmt: skip
            await asyncio.sleep(delay)
            child = await self._spawn(spec)
            try:
                await self._ready(spec, child)
            except RuntimeError as e:
                logger.error("restart of %s failed: %s", spec.name, e)
                child.signal(signal.SIGKILL)
                continue
            logger.info("%s is back (pid %d, %.1f s after restart)", spec.name, child.pid, child.uptime)
            if self.on_ready is not None:
                await self.on_ready(spec)

    async def stop_all(self) -> None:
        """Drain and stop everything, in reverse start order.

        The gateway goes first: it stops accepting requests, finishes or aborts those in flight and
        exits (killed after ``drain_timeout + ABORT_MARGIN_S`` s). Then the schedulers, which drain
        the same way (a request the gateway gave up on is aborted there), then the tokenizer and
        detokenizer (each killed after ``grace`` s). Every child's process group is SIGKILLed at
        the end, so nothing it started survives.
        """
        self.stopping = True
        for keeper in self._keepers:
            keeper.cancel()
        for stage in reversed(self.stages()):
            children = [self.children[s.name] for s in stage if s.name in self.children]
            drains = any(s.role in ("gateway", "prefill", "decode") for s in stage)
            timeout = self.drain_timeout + ABORT_MARGIN_S if drains else self.grace
            names = ", ".join(c.name for c in children)
            if names:
                logger.info("stopping %s", names)
            graceful = await asyncio.gather(*(c.stop(timeout) for c in children))
            for child, ok in zip(children, graceful, strict=True):
                if not ok:
                    logger.warning("%s did not stop within %.0f s; killed it", child.name, timeout)
                elif child.returncode not in (0, -signal.SIGTERM):  # e.g. an abort at interpreter exit
                    logger.warning(
                        "%s %s while stopping%s", child.name, describe_exit(child.returncode), _tail(child)
                    )

    def kill_all(self) -> None:
        """SIGKILL every child's process group now (a second Ctrl-C)."""
        self.stopping = True
        for child in self.children.values():
            child.signal(signal.SIGKILL)


def _tail(child: Child) -> str:
    lines = list(child.tail)[-CRASH_TAIL_LINES:]
    return "; last output:\n" + "\n".join(f"    {line}" for line in lines) if lines else ""
