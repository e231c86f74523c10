"""``ServiceSpec``: one pdserve service process, as the ``Supervisor`` starts, watches and stops it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

STAGES = {"tokenizer": 0, "detokenizer": 0, "prefill": 1, "decode": 1, "gateway": 2}


@dataclass
class ServiceSpec:
    """One process of the topology.

    ``health`` is "host:port" of its grpc.health.v1 service, or an http:// URL for the gateway
    (ready when every role is); ``liveness`` the "host:port" whose grpc.health.v1 status says the
    process itself is alive (default: ``health``); ``env`` is added to the launcher's environment
    (secrets go there, not in ``argv``, which any user of the machine can read in ``ps``); ``binds``
    are the (host, port) pairs it listens on; ``pin_kv_pool``: a scheduler whose KV pool is sized
    from free memory, to be restarted with the size of its first start (the launcher's ``kv_pool_pin``).
    """

    name: str
    role: str
    argv: list[str]
    health: str
    env: dict[str, str] = field(default_factory=dict)
    binds: list[tuple[str, int]] = field(default_factory=list)
    liveness: str = ""
    pin_kv_pool: bool = False

    def __post_init__(self) -> None:
        if not self.liveness and not self.health.startswith("http"):
            self.liveness = self.health

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "pdserve.cli", self.role, *self.argv]

    @property
    def stage(self) -> int:
        """Start order (0: tokenizer and detokenizer, 1: schedulers, 2: gateway); stop in reverse."""
        return STAGES[self.role]
