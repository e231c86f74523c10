"""A background thread that keeps a NIXL agent progressing and hands every notification to a handler.

Without NIXL's own progress thread (which spins a full core), UCX makes progress only inside agent
calls, and notifications (LANDED, ABORT: see ``messages``) arrive only when someone fetches them.
The pump fetches every ``hot_interval_s`` while messages flow (one came in the last ``hot_s``: a
chunked prefill's groups landing), every ``busy_interval_s`` while ``busy()`` says a transfer is open
or for ``linger_s`` after the last message, and every ``idle_interval_s`` otherwise: a receive open
for the seconds a long prompt takes to prefill costs ~1,000 wake-ups a second, not 5,000. Those are
not free on a small host: polling every 0.2 ms throughout made a 2-core PD 1+1's TTFT 11-28% longer
(``make bench-kv-e2e``, its prefill's OpenMP threads losing their cores). ``kick()`` fetches at once:
a receiver that knows its pages are written (the Prefill call answered) asks for the LANDED then.
It is a thread rather than an asyncio task so transfers keep moving while the event loop runs a
forward pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.kv_transfer.errors import NIXL_ERRORS

logger = logging.getLogger(__name__)


class NotificationPump:
    """Calls ``handle(sender_agent_name, message)`` for every notification, in arrival order per fetch.

    Args:
        fetch: returns new notifications as ``{agent_name: [msg, ...]}`` (``nixl_agent.get_new_notifs``).
        handle: called on the pump thread; must be thread-safe.
        busy: whether a transfer is in flight (poll fast).
        name: thread name.
    """

    def __init__(
        self,
        fetch: Callable[[], dict[str, list[bytes]]],
        handle: Callable[[str, bytes], None],
        busy: Callable[[], bool],
        name: str,
        hot_interval_s: float = 0.0002,
        busy_interval_s: float = 0.001,
        idle_interval_s: float = 0.005,
        hot_s: float = 0.005,
        linger_s: float = 1.0,
    ):
        self._fetch = fetch
        self._handle = handle
        self._busy = busy
        self._intervals = (hot_interval_s, busy_interval_s, idle_interval_s)
        self._hot_s, self._linger_s = hot_s, linger_s
        self._last_seen = 0.0
        self._kick = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def pump(self) -> None:
        """Fetch new notifications and handle them."""
        for agent_name, msgs in self._fetch().items():
            for msg in msgs:
                self._last_seen = time.monotonic()
                try:
                    self._handle(agent_name, msg)
                except Exception:  # one bad message must not stop the pump
                    logger.exception("handling KV notification %r from %r failed", msg[:64], agent_name)

    def kick(self) -> None:
        """Poll now (a transfer starts, or a receiver expects its last LANDED)."""
        self._kick.set()

    def close(self) -> None:
        """Stop the thread (handlers running now finish first)."""
        self._closed = True
        self._kick.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._closed:
            try:
                self.pump()
            except NIXL_ERRORS:
                logger.exception("polling NIXL notifications failed")
            hot, busy, idle = self._intervals
            quiet = time.monotonic() - self._last_seen
            if quiet < self._hot_s:
                interval = hot
            elif self._busy() or quiet < self._linger_s:
                interval = busy
            else:
                interval = idle
            self._kick.wait(interval)
            self._kick.clear()
