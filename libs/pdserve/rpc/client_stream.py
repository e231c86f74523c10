"""A long-lived client-streaming call that batches are pushed into (decode -> detokenizer -> gateway)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS

logger = logging.getLogger(__name__)

DEFAULT_DEAD_AFTER_S = 3.0
# A reconnecting channel probes its target at least once a second (gRPC's default backoff grows to
# minutes), so a target that comes back within ``dead_after`` is found before it is declared dead.
_CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.max_reconnect_backoff_ms", 1_000)]

OnDead = Callable[[str, list[Any]], None]
"""``on_dead(target, dropped_messages)``: the target is gone; the messages never left this process."""


class ClientStreamSender:
    """Pushes messages into one client-streaming RPC to ``target``, re-opening the call if it ends.

    Args:
        target: "host:port" of the receiving service.
        open_call: given a channel, returns the client-streaming stub method, e.g.
            ``lambda ch: DetokenizerStub(ch).StreamTokenIDs``; each call is opened without a request
            iterator and written to from the queue.
        dead_after: seconds the channel may stay unable to (re)connect before the target counts as
            gone; the wait is gRPC's own (``channel_ready``, connectivity state), not a retry loop.
        on_dead: called once, on the event loop, when the target is gone (see below).

    ``send`` never blocks: messages queue up while the call is (re)connecting. Each call is opened
    only once the channel is READY, so a target that is down (or never came up) is noticed within
    ``dead_after``. Then the sender drops its queue, calls ``on_dead(target, dropped)`` with the
    messages it never handed to a call, and closes; ``send`` on it raises from then on.

    What can still be lost: a message already handed to a call that then fails (written to gRPC,
    perhaps never read by the target) appears neither at the target nor in ``dropped``; its request
    ends by deadline, abort or the owner's ``on_dead``. A target that restarts within
    ``dead_after`` gets the queued messages, but not the lost ones, and a restarted process does not
    know the requests its predecessor held.
    """

    def __init__(
        self,
        target: str,
        open_call: Callable[[grpc.aio.Channel], Any],
        *,
        dead_after: float = DEFAULT_DEAD_AFTER_S,
        on_dead: OnDead | None = None,
    ) -> None:
        self.target = target
        self.dead_after = dead_after
        self._open_call = open_call
        self._on_dead = on_dead
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel = tls.internal_channel(target, _CHANNEL_OPTIONS)
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def send(self, message: Any) -> None:
        """Queue ``message`` for the call. Raises RuntimeError once the sender is closed or dead."""
        if self._closed:
            raise RuntimeError(f"stream to {self.target} is closed")
        self._queue.put_nowait(message)

    async def _run(self) -> None:
        method = self._open_call(self._channel)
        try:
            while not self._closed:
                try:
                    await asyncio.wait_for(self._channel.channel_ready(), self.dead_after)
                except TimeoutError:
                    if not self._closed:
                        self._die()
                    return
                try:
                    await self._stream_once(method)
                except grpc.aio.AioRpcError as e:
                    if not self._closed:
                        # UNAVAILABLE: the target stopped or restarts (every clean shutdown stops the
                        # detokenizer's targets first); ``_die`` warns if it stays away
                        level = logging.INFO if e.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING
                        what = (self.target, e.code(), e.details())
                        logger.log(level, "stream to %s ended: %s %s; re-opening", *what)
        finally:
            await self._channel.close()

    async def _stream_once(self, method: Any) -> None:
        """One call, fed from the queue until it ends; raises its AioRpcError if it fails.

        Not ``wait_for_ready``: a channel that drops again fails the call at once, and the next
        ``channel_ready`` in ``_run`` bounds the wait.
        """
        call = method()
        writer = asyncio.get_running_loop().create_task(self._write_queue(call))
        try:
            await call
        finally:
            writer.cancel()  # a writer waiting on the queue takes nothing from it

    async def _write_queue(self, call: grpc.aio.StreamUnaryCall) -> None:
        while True:
            msg = await self._queue.get()
            try:
                if msg is None:
                    await call.done_writing()
                    return
                await call.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the call ended: ``await call`` reports how; ``msg`` is lost

    def _die(self) -> None:
        self._closed = True
        dropped = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
        logger.warning(
            "%s unreachable for %.1f s: stream closed, %d queued messages dropped",
            self.target,
            self.dead_after,
            len(dropped),
        )
        if self._on_dead is not None:
            self._on_dead(self.target, dropped)

    async def close(self) -> None:
        """Deliver what is queued (up to 2 s while the target is reachable), then close the channel."""
        self._closed = True
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, 2.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        await self._channel.close()


class ClientStreamPool:
    """One ``ClientStreamSender`` per target address, created on first use.

    A sender whose target is gone is forgotten before ``on_dead(target, dropped)`` runs, so the next
    ``send`` to that address opens a fresh sender (a restarted replica is served again).
    """

    def __init__(
        self,
        open_call: Callable[[grpc.aio.Channel], Any],
        *,
        dead_after: float = DEFAULT_DEAD_AFTER_S,
        on_dead: OnDead | None = None,
    ) -> None:
        self._open_call = open_call
        self.dead_after = dead_after
        self._on_dead = on_dead
        self._senders: dict[str, ClientStreamSender] = {}

    def send(self, target: str, message: Any) -> None:
        sender = self._senders.get(target)
        if sender is None:
            sender = self._senders[target] = ClientStreamSender(
                target, self._open_call, dead_after=self.dead_after, on_dead=self._forget
            )
        sender.send(message)

    def _forget(self, target: str, dropped: list[Any]) -> None:
        self._senders.pop(target, None)  # absent when it died while the pool was closing
        if self._on_dead is not None:
            self._on_dead(target, dropped)

    async def close(self) -> None:
        """Close every sender at once (each delivers what it can within its 2 s)."""
        senders = list(self._senders.values())
        self._senders.clear()
        await asyncio.gather(*(sender.close() for sender in senders))
