"""A background thread that keeps a NIXL agent progressing and routes its notifications to waiters.

Without NIXL's own progress thread (which spins a full core), UCX makes progress only inside agent
calls. Over CPU transports (CMA, TCP) a WRITE into this process completes only while this side
progresses too, so the pump calls ``get_new_notifs`` every ``fast_interval_s`` while someone waits for
a notification or one arrived in the last ``linger_s``, and every ``idle_interval_s`` otherwise. It is a
thread rather than an asyncio task so that transfers keep moving while the event loop runs a forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from pdserve.kv_transfer.errors import NIXL_ERRORS, KVTransferError, KVTransferTimeout

logger = logging.getLogger(__name__)


class NotificationPump:
    """Routes notification messages (bytes, from any peer) to ``wait`` callers or to ``drain``.

    A message nobody waits for is kept (at most ``max_unclaimed``, oldest dropped first) so a waiter
    that registers after it arrived still finds it. Thread-safe; ``wait`` may run on any event loop.

    Args:
        fetch: returns new notifications as ``{peer_name: [msg, ...]}`` (``nixl_agent.get_new_notifs``).
        name: thread name.
    """

    def __init__(
        self,
        fetch: Callable[[], dict[str, list[bytes]]],
        name: str,
        fast_interval_s: float = 0.001,
        idle_interval_s: float = 0.005,
        linger_s: float = 1.0,
        max_unclaimed: int = 100_000,
    ):
        self._fetch = fetch
        self._fast_interval_s = fast_interval_s
        self._idle_interval_s = idle_interval_s
        self._linger_s = linger_s
        self._max_unclaimed = max_unclaimed
        self._lock = threading.Lock()
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = {}
        self._unclaimed: dict[bytes, int] = {}  # msg -> count, in arrival order
        self._last_seen = 0.0
        self._kick = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def pump(self) -> None:
        """Fetch new notifications now and route them (the thread does this on its own, too)."""
        notifs = self._fetch()
        with self._lock:
            for msgs in notifs.values():
                for msg in msgs:
                    self._route(msg)

    def drain(self) -> list[bytes]:
        """All messages no waiter claimed, oldest first; they are removed."""
        self.pump()
        with self._lock:
            msgs = [msg for msg, count in self._unclaimed.items() for _ in range(count)]
            self._unclaimed.clear()
        return msgs

    async def wait(self, msg: bytes, timeout_s: float) -> None:
        """Return once ``msg`` has arrived (also if it arrived before the call).

        Raises:
            KVTransferTimeout: not within ``timeout_s`` seconds.
            KVTransferError: the pump was closed meanwhile.
        """
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed:
                raise KVTransferError("notification pump is closed")
            if self._take_unclaimed(msg):
                return
            self._waiters.setdefault(msg, []).append(future)
        self._kick.set()
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise KVTransferTimeout(f"notification {msg!r} did not arrive within {timeout_s:.3g} s") from None
        finally:
            with self._lock:
                waiters = self._waiters.get(msg, [])
                if future in waiters:
                    waiters.remove(future)
                    if not waiters:
                        del self._waiters[msg]

    def close(self) -> None:
        """Stop the thread and fail every pending ``wait`` with ``KVTransferError``."""
        with self._lock:
            self._closed = True
            waiters = [f for futures in self._waiters.values() for f in futures]
            self._waiters.clear()
        self._kick.set()
        self._thread.join()
        for future in waiters:
            _resolve(future, KVTransferError("notification pump closed"))

    def _route(self, msg: bytes) -> None:
        self._last_seen = time.monotonic()
        waiters = self._waiters.get(msg)
        if waiters:
            _resolve(waiters.pop(0), None)
            if not waiters:
                del self._waiters[msg]
            return
        self._unclaimed[msg] = self._unclaimed.get(msg, 0) + 1
        if len(self._unclaimed) > self._max_unclaimed:
            dropped = next(iter(self._unclaimed))
            del self._unclaimed[dropped]
            logger.warning(
                "dropped unclaimed KV notification %r (over %d kept)", dropped, self._max_unclaimed
            )

    def _take_unclaimed(self, msg: bytes) -> bool:
        count = self._unclaimed.get(msg, 0)
        if count == 0:
            return False
        if count == 1:
            del self._unclaimed[msg]
        else:
            self._unclaimed[msg] = count - 1
        return True

    def _run(self) -> None:
        while not self._closed:
            try:
                self.pump()
            except NIXL_ERRORS:
                logger.exception("polling NIXL notifications failed")
            busy = self._waiters or time.monotonic() - self._last_seen < self._linger_s
            self._kick.wait(self._fast_interval_s if busy else self._idle_interval_s)
            self._kick.clear()


def _resolve(future: asyncio.Future[None], error: Exception | None) -> None:
    """Complete ``future`` from any thread; a finished future or a closed loop is left alone."""

    def complete() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
        future.get_loop().call_soon_threadsafe(complete)
