"""``SchedulerConfig``: the scheduling knobs of one scheduler (CLI flags of ``pdserve prefill|decode``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sampling.bounds import MAX_SPECULATIVE_DRAFT_TOKENS
from pdserve.scheduler.overload import DEFAULT_MAX_QUEUE_TIME_S

SPECULATIVE_POLICIES = ("adaptive", "always")
MAX_KV_TIER_MEMORY = 2**50  # bytes (1 PiB): far above any host, below what overflows a page count

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
    # speculative decoding (when the scheduler has a proposer): the most drafts a request verifies per
    # step, and whether the per-step policy decides (adaptive) or every offered draft is verified (always)
    speculative_num_draft_tokens: int = 4
    speculative_policy: str = "adaptive"
    kv_tier_memory: int = 0  # bytes of the KV tier under the radix cache (``mem_cache.kv_tier``); 0 = none

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 16:
            raise ValueError("chunked_prefill_size must be >= 16 tokens")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 (0 = no bound)")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_SPECULATIVE_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_SPECULATIVE_DRAFT_TOKENS}]")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {SPECULATIVE_POLICIES}")
        if not 0 <= self.kv_tier_memory <= MAX_KV_TIER_MEMORY:
            raise ValueError(f"kv_tier_memory must be in [0, {MAX_KV_TIER_MEMORY}] bytes")
        if self.max_queue_time < 0:
            raise ValueError("max_queue_time must be >= 0 (0 = no limit)")
