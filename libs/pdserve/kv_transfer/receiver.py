"""Receiving side of KV transfers: expected transfers, their landed pages, completion.

A receive completes only when every destination page has landed from every expected sender (one, or
under prefill and decode TP groups of different sizes each prefill rank writing a slice of this
pool's heads), each counted once (a LANDED that repeats pages, names pages out of range, or comes
from an agent that is not an expected sender changes nothing). A LANDED arrives after its WRITE's
bytes, so a completed receive's pages are whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pdserve.kv_transfer import messages
from pdserve.kv_transfer.completion import Completion
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout

logger = logging.getLogger(__name__)


class KVReceive:
    """One expected inbound transfer (made by ``KVTransferAgent.expect``).

    Attributes:
        senders: each sending agent -> how many of this pool's KV heads it writes into every page
            (one agent writing all of them, but under prefill and decode TP groups of different sizes).
        tid: transfer id named in the senders' notifications.
        dst_pages: this side's destination pages; index ``i`` is what a sender calls ``first + ...``.
        nbytes: bytes landed so far.
    """

    def __init__(
        self,
        receiver: KVReceiver,
        senders: Mapping[str, int],
        num_heads: int,
        tid: bytes,
        dst_pages: Sequence[int],
    ):
        self._receiver = receiver
        self.senders = dict(senders)
        self.tid = tid
        self.dst_pages = [int(p) for p in dst_pages]
        self.nbytes = 0
        page_bytes = receiver.page_bytes(np.asarray(self.dst_pages, dtype=np.int64)).astype(np.int64)
        heads = np.array(list(self.senders.values()), dtype=np.int64)[:, None]
        self._bytes = page_bytes[None, :] * heads // num_heads  # [sender, page]
        self._row = {name: i for i, name in enumerate(self.senders)}
        self._landed = np.zeros((len(self.senders), len(self.dst_pages)), dtype=bool)
        self._missing = self._landed.size
        self._completion = Completion()
        if self._missing == 0:
            self._completion.set_result(0)

    @property
    def peer_name(self) -> str:
        """The senders' names, for messages."""
        return ", ".join(self.senders)

    async def wait(self, timeout_s: float) -> int:
        """Return the bytes received once every page has landed. Fetches notifications at once: call
        it when the pages should have landed (the sender said so) for the LANDED to count at once.

        Raises:
            KVTransferError: the sender aborted, or this receive was cancelled.
            KVTransferTimeout: not complete within ``timeout_s`` (the receive is cancelled).
        """
        self._receiver.kick()
        try:
            return await self._completion.wait(timeout_s)
        except TimeoutError:
            self.cancel()
            each = f" (each page from each of {len(self.senders)} senders)" if len(self.senders) > 1 else ""
            raise KVTransferTimeout(
                f"KV transfer {self.tid!r} from {self.peer_name}: {self._missing} of"
                f" {self._landed.size} pages missing after {timeout_s:.3g} s{each}"
            ) from None

    def cancel(self) -> None:
        """Stop expecting: a LANDED of this transfer changes nothing once this returns. Idempotent."""
        self._receiver.cancel(self)

    @property
    def done(self) -> bool:
        return self._completion.done


class KVReceiver:
    """Routes LANDED and ABORT notifications to expected transfers.

    Args:
        page_bytes: the bytes of each of a transfer's destination pages (int64 array, its transfer
            space) -> bytes of one such page (every layer's K and V in its pool).
        kick: fetches notifications now (``NotificationPump.kick``).
    """

    def __init__(self, page_bytes: Callable[[np.ndarray], np.ndarray], kick: Callable[[], None]):
        self.page_bytes = page_bytes
        self.kick = kick
        self._lock = threading.Lock()
        self._expected: dict[bytes, KVReceive] = {}

    def expect(
        self, senders: Mapping[str, int], num_heads: int, tid: bytes, dst_pages: Sequence[int]
    ) -> KVReceive:
        """Register a transfer before asking for it (``KVReceive``'s arguments). Raises KVTransferError
        on a tid already expected."""
        receive = KVReceive(self, senders, num_heads, tid, dst_pages)
        if receive.done:
            return receive
        with self._lock:
            if tid in self._expected:
                raise KVTransferError(f"KV transfer {tid!r} is already expected")
            self._expected[tid] = receive
        return receive

    def cancel(self, receive: KVReceive) -> None:
        with self._lock:
            if self._expected.get(receive.tid) is receive:
                del self._expected[receive.tid]
        receive._completion.set_exception(KVTransferError(f"KV transfer {receive.tid!r} cancelled"))

    def busy(self) -> bool:
        return bool(self._expected)

    def on_landed(self, sender: str, landed: messages.Landed) -> None:
        """Count a group of landed pages (if its transfer is expected from ``sender``)."""
        with self._lock:
            receive = self._expected.get(landed.tid)
            if receive is None or sender not in receive.senders:
                return  # cancelled, failed or timed out: its pages may belong to someone else now
            first, count = landed.first, landed.count
            if count < 0 or first < 0 or first + count > len(receive.dst_pages):
                logger.warning("KV transfer %r: LANDED pages out of range from %r", landed.tid, sender)
                return
            row = receive._row[sender]
            fresh = ~receive._landed[row, first : first + count]
            receive._landed[row, first : first + count] = True
            receive._missing -= int(np.count_nonzero(fresh))
            receive.nbytes += int(receive._bytes[row, first : first + count][fresh].sum())
            if receive._missing == 0:
                del self._expected[landed.tid]
                receive._completion.set_result(receive.nbytes)

    def on_abort(self, sender: str, tid: bytes) -> None:
        with self._lock:
            receive = self._expected.get(tid)
            if receive is None or sender not in receive.senders:
                return
            del self._expected[tid]
        receive._completion.set_exception(
            KVTransferError(f"KV transfer {tid!r}: the sender {sender!r} aborted")
        )

    def close(self) -> None:
        """Fail every expected transfer."""
        with self._lock:
            pending, self._expected = list(self._expected.values()), {}
        for receive in pending:
            receive._completion.set_exception(KVTransferError("KV agent closed"))
