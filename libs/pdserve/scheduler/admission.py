"""Admission: taking requests from the waiting queue into a prompt stage, within the KV budget.

A request is admitted when the pool can give it pages for its whole fill plus a reserve of
``new_token_reserve`` next tokens, while still covering the reserve of every running request
(SGLang's ``PrefillAdder``); it radix-matches its prompt first and locks the match, so a cached
prefix costs no pages. Requests are taken in the policy's order until one does not fit (so a
large request is not overtaken for ever) or ``max_running_requests`` is reached.

In-batch prefix sharing (SGLang's in-batch prefix caching): a request that shares an uncached
prefix of at least ``IN_BATCH_PREFIX_TOKENS`` with a request whose prompt KV is being made right now
waits for that KV to enter the radix cache, then extends (or in PD, transfers) only its own suffix,
instead of both computing, and both shipping, the shared part side by side.

A request that wants prompt logprobs or an embedding (``Req.computes_whole_prompt``) matches nothing
where its prompt is computed (the mixed and prefill roles), because a cached prefix would skip the
very positions whose logits or hidden states it asks for (vLLM skips the prefix cache for such
requests too); its KV
enters the cache afterwards as any other's. A PD decode worker matches as usual: its prefill
worker computes the whole prompt, and only the pages decode lacks are written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import Req
from pdserve.scheduler.waiting import WaitingQueue

IN_BATCH_PREFIX_TOKENS = 32  # a shared uncached prefix at least this long is computed once, not twice


class Admission:
    """Admits waiting requests for a prompt stage (``PrefillManager`` or ``RemotePrefill``).

    Args:
        queue: the waiting queue.
        ledger: the KV ledger that matches, locks and allocates.
        metrics: prefix-cache and queue-time metrics.
        clock: the scheduler's clock (admit times).
        config: ``max_running_requests``, ``new_token_reserve`` (tokens reserved per request beyond its
            fill). Without a radix cache (``ledger.tree.disable``) no request waits for a shared
            prefix: it saves nothing.
        max_req_tokens: no request grows beyond this many tokens.
        active: how many requests are admitted and not ended (nor handed on).
        running: the requests whose next tokens' reserve admission must leave room for.
    """

    def __init__(
        self,
        queue: WaitingQueue,
        ledger: KVLedger,
        metrics: SchedulerMetrics,
        clock: Callable[[], float],
        config: SchedulerConfig,
        max_req_tokens: int,
        active: Callable[[], int],
        running: Callable[[], list[Req]],
    ) -> None:
        self.queue, self.ledger, self.metrics, self.clock = queue, ledger, metrics, clock
        self.max_running_requests = config.max_running_requests
        self.new_token_reserve = config.new_token_reserve
        self.share_prefixes = not ledger.tree.disable
        self.max_req_tokens = max_req_tokens
        self.active, self.running = active, running
        # prompts are computed here (not in the PD decode role), so a request that wants prompt
        # logprobs bypasses the radix cache
        self.scores_prompts = config.role != "decode"
        # a PD decode worker's prompt KV arrives whole: no local pages behind its window (``KVLedger.admit``)
        self.kv_arrives_whole = config.role == "decode"

    def admit(
        self, in_flight: Callable[[], list[Req]], more: Callable[[], bool] = lambda: True
    ) -> Iterator[Req]:
        """Yield the waiting requests admitted now, in the policy's order, each with its pages (and
        out of the queue) by the time it is yielded; the caller puts it in its stage before the next.

        Stops when ``more()`` turns false (a token budget spent), there is no room, or a request does
        not fit. Skips (leaves waiting) a request that shares an uncached prefix with one of
        ``in_flight()``, the requests whose prompt KV is being made now.
        """
        for req in self.queue.in_order():
            if not more() or self.active() >= self.max_running_requests:
                return
            if self._waits_for_shared_prefix(req, in_flight()):
                continue
            if not self._admit(req):
                return
            yield req

    def blocked(self, req: Req) -> bool:
        """Whether waiting ``req`` cannot be admitted now: ``max_running_requests`` are active, or
        the pool cannot give it pages for its fill and reserve (its radix-cache match counted)
        while covering every running request's reserve. Changes nothing."""
        if self.active() >= self.max_running_requests:
            return True
        # without loading the tier: the pages a load-back takes, the request would take otherwise
        self.ledger.match(req, use_cache=not self._computes_whole_prompt(req), load_back=False)
        fits = self._fits(req)
        self.ledger.unmatch(req)
        return not fits

    def _admit(self, req: Req) -> bool:
        """Match the radix cache, lock the match and allocate pages for the whole fill."""
        prefix = self.ledger.match(req, use_cache=not self._computes_whole_prompt(req))
        if not self._fits(req) or not self.ledger.pin_adapter(req):
            self.ledger.unmatch(req)
            return False
        if not self.ledger.admit(req, req.seq_len, arrives_whole=self.kv_arrives_whole):
            self.ledger.unmatch(req)
            self.ledger.unpin_adapter(req)
            return False
        if not req.output_ids:  # a retracted request re-admitted is not a new prompt
            req.cached_tokens = prefix
            self.metrics.prefix_cache_queries.inc(len(req.origin_input_ids))
            self.metrics.prefix_cache_hit_tokens.inc(prefix)
        req.admit_time = self.clock()
        self.metrics.queue_time.observe(req.admit_time - req.arrival_time)
        self.queue.remove(req)
        return True

    def _fits(self, req: Req) -> bool:
        """The KV budget: the request's fill and reserve, and every running request's reserve."""
        need = self._pages_to_grow(req) + sum(self._pages_to_grow(r) for r in self.running())
        return need <= self.ledger.available_pages()

    def _pages_to_grow(self, req: Req) -> int:
        """Pages ``req`` still lacks for its fill plus a reserve of up to ``new_token_reserve`` next
        tokens (counted in tokens, so a partly filled last page takes them first)."""
        remaining = req.sampling_params.max_new_tokens - req.num_generated
        tokens = req.seq_len + max(0, min(remaining, self.new_token_reserve))
        return max(0, self.ledger.pages_for(min(tokens, self.max_req_tokens)) - len(req.pages))

    def _computes_whole_prompt(self, req: Req) -> bool:
        return self.scores_prompts and req.computes_whole_prompt

    def _waits_for_shared_prefix(self, req: Req, in_flight: list[Req]) -> bool:
        if not self.share_prefixes or not in_flight or self._computes_whole_prompt(req):
            return False
        adapter = req.sampling_params.lora_name  # another adapter's KV is never shared
        mates = [other for other in in_flight if other.sampling_params.lora_name == adapter]
        shared = max((_common_prefix_len(req.fill_ids, other.fill_ids) for other in mates), default=0)
        if shared < IN_BATCH_PREFIX_TOKENS:
            return False
        return shared - self.ledger.cached_prefix_len(req) >= IN_BATCH_PREFIX_TOKENS


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
