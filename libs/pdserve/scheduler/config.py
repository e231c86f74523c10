"""``SchedulerConfig``: the scheduling knobs of one scheduler (CLI flags of ``pdserve prefill|decode``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.overload import DEFAULT_MAX_QUEUE_TIME_S

# mixed: prefills and decodes (colocated); prefill: a PD prefill worker; decode: a PD decode worker
ROLES = ("mixed", "prefill", "decode")


@dataclass
class SchedulerConfig:
    """Scheduling knobs.

    Raises ValueError from ``validate`` on a bad value.
    """

    role: str = "mixed"
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # tokens of prompt chunks one step computes at most
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    new_token_reserve: int = 32  # tokens reserved per request at admission, beyond its prompt
    grammar_compile_timeout: float = 20.0  # seconds a constrained request may wait for its grammar
    max_queued_requests: int | None = None  # waiting-queue bound; None = auto, 0 = none (see overload.py)
    max_queue_time: float = DEFAULT_MAX_QUEUE_TIME_S  # seconds a request may wait unadmitted; 0 = no limit

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 16:
            raise ValueError("chunked_prefill_size must be >= 16 tokens")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 (0 = no bound)")
        if self.max_queue_time < 0:
            raise ValueError("max_queue_time must be >= 0 (0 = no limit)")
