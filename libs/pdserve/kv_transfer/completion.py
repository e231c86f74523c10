"""A one-shot result, set from any thread (the transfer threads, the notification pump) and awaited on
any event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


class Completion:
    """Holds the first ``set_result`` / ``set_exception``; later ones are ignored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> bool:
        return self._finish(result, None)

    def set_exception(self, error: BaseException) -> bool:
        return self._finish(None, error)

    def result(self) -> Any:
        """The result, or raise the exception (only once done)."""
        if self._error is not None:
            raise self._error
        return self._result

    async def wait(self, timeout_s: float | None = None) -> Any:
        """The result (or raise the exception) once done.

        Raises:
            TimeoutError: not done within ``timeout_s`` seconds.
        """
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            done = self._done
            if not done:
                self._waiters.append(future)
        if not done:
            try:
                await asyncio.wait_for(future, timeout_s)
            finally:
                with self._lock:
                    if future in self._waiters:
                        self._waiters.remove(future)
        return self.result()

    def _finish(self, result: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self._result, self._error, self._done = result, error, True
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
                future.get_loop().call_soon_threadsafe(_wake, future)
        return True


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
