"""The gateway's store of responses (``store: true``), for ``previous_response_id`` and
GET / DELETE /v1/responses/{id}.

Bounded per API key: each key (one owner; a gateway without keys has one) keeps at most
``max_per_key`` responses, the least recently used going first, and drops a response unused for
``ttl_s`` seconds (reading it, or continuing from it, is a use). A response is found only under
the key that created it: another key's id is as unknown as a made-up one (404). The store lives
in the gateway process: it is lost on restart and not shared between ``--workers`` processes or
replicas (a follow-up must reach the process that served the response it continues).

What it keeps of a response: the Response object (as JSON) and its conversation, the items
before it (its ``previous_response_id``'s conversation and its own input) and its output, which a
follow-up continues. Each is bounded by the model's context: a request whose prompt did not fit
failed and was not stored.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.services.gateway.openai.responses.items import Item

DEFAULT_MAX_PER_KEY = 1000
DEFAULT_TTL_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as JSON
    conversation: list[Item]  # the items a follow-up continues (inputs, then this response's output)
    used_at: float = 0.0


class ResponseStore:
    """Responses by owner (API key or None) and id; see the module docstring.

    Args:
        max_per_key: responses kept per owner (0: nothing is stored).
        ttl_s: seconds an unused response is kept.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        max_per_key: int = DEFAULT_MAX_PER_KEY,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_key = max_per_key
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_owner: dict[str | None, OrderedDict[str, StoredResponse]] = {}

    def put(self, owner: str | None, response_id: str, entry: StoredResponse) -> None:
        """Keep ``entry`` under ``owner``; the least recently used past ``max_per_key`` go."""
        if self.max_per_key <= 0:
            return
        entries = self._entries(owner)
        entry.used_at = self.clock()
        entries[response_id] = entry
        entries.move_to_end(response_id)
        while len(entries) > self.max_per_key:
            entries.popitem(last=False)

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """``owner``'s response ``response_id`` (now its most recent use), or None."""
        entries = self._entries(owner)
        entry = entries.get(response_id)
        if entry is not None:
            entry.used_at = self.clock()
            entries.move_to_end(response_id)
        return entry

    def delete(self, owner: str | None, response_id: str) -> bool:
        """Drop ``owner``'s response ``response_id``; whether there was one."""
        return self._entries(owner).pop(response_id, None) is not None

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_owner.values())

    def _entries(self, owner: str | None) -> OrderedDict[str, StoredResponse]:
        """``owner``'s responses, those unused for ``ttl_s`` dropped (the oldest use comes first)."""
        entries = self._by_owner.setdefault(owner, OrderedDict())
        expired = self.clock() - self.ttl_s
        while entries and next(iter(entries.values())).used_at < expired:
            entries.popitem(last=False)
        return entries
