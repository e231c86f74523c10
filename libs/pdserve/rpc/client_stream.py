"""A long-lived client-streaming call that batches are pushed into (decode -> detokenizer -> gateway)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pdserve.rpc.server import GRPC_OPTIONS

logger = logging.getLogger(__name__)


class ClientStreamSender:
    """Pushes messages into one client-streaming RPC to ``target``, re-opening the call if it ends.

    Args:
        target: "host:port" of the receiving service.
        open_call: given a channel, returns the stub method to call with a request iterator,
            e.g. ``lambda ch: DetokenizerStub(ch).StreamTokenIDs``.

    ``send`` never blocks: messages queue up while the call is (re)connecting, and the call is
    made with ``wait_for_ready`` so gRPC's channel does the reconnecting. Messages handed to a call
    that then fails are lost; their requests end by their deadline or by abort.
    """

    def __init__(self, target: str, open_call: Callable[[grpc.aio.Channel], Any]) -> None:
        self.target = target
        self._open_call = open_call
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel = grpc.aio.insecure_channel(target, options=GRPC_OPTIONS)
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._closed = False

    def send(self, message: Any) -> None:
        self._queue.put_nowait(message)

    async def _messages(self) -> AsyncIterator[Any]:
        while True:
            msg = await self._queue.get()
            if msg is None:
                return
            yield msg

    async def _run(self) -> None:
        method = self._open_call(self._channel)
        while not self._closed:
            try:
                await method(self._messages(), wait_for_ready=True)
            except grpc.aio.AioRpcError as e:
                if self._closed:
                    return
                logger.warning("stream to %s ended: %s %s; re-opening", self.target, e.code(), e.details())
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        self._closed = True
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._task, 2.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        await self._channel.close()


class ClientStreamPool:
    """One ``ClientStreamSender`` per target address, created on first use."""

    def __init__(self, open_call: Callable[[grpc.aio.Channel], Any]) -> None:
        self._open_call = open_call
        self._senders: dict[str, ClientStreamSender] = {}

    def send(self, target: str, message: Any) -> None:
        sender = self._senders.get(target)
        if sender is None:
            sender = self._senders[target] = ClientStreamSender(target, self._open_call)
        sender.send(message)

    async def close(self) -> None:
        for sender in self._senders.values():
            await sender.close()
        self._senders.clear()
