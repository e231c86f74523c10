"""The scheduler's managers one by one, on real pools and a real radix cache (no model: no forward
runs here; ``test_scheduler.py`` drives them together on the real model)."""

from __future__ import annotations

import pytest

from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator, ReqToTokenPool
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.admission import IN_BATCH_PREFIX_TOKENS, Admission
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.decode import DecodeManager
from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.handoff import HandOff
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.prefill import PrefillManager
from pdserve.scheduler.remote_prefill import RemotePrefill
from pdserve.scheduler.req import FinishReason, Req, ReqState
from pdserve.scheduler.schedule_batch import StepOutput
from pdserve.scheduler.table import DuplicateRid, RequestLimits, RequestTable
from pdserve.scheduler.waiting import WaitingQueue

PAGE = 4
VOCAB = 1000


class Parts:
    """One scheduler's managers, wired as ``Scheduler.__init__`` wires them, for one role."""

    def __init__(self, role: str, num_pages: int = 64, max_running: int = 8, reserve: int = 4) -> None:
        self.now = 100.0
        clock = lambda: self.now
        config = SchedulerConfig(role=role, max_running_requests=max_running, new_token_reserve=reserve)
        self.ledger = KVLedger(ReqToTokenPool(16, 512), PagedTokenToKVPoolAllocator(num_pages, PAGE), PAGE)
        self.usable = self.ledger.free_pages()
        self.metrics = SchedulerMetrics(role)
        self.policy = SchedulePolicy("fcfs", self.ledger.cached_prefix_len, clock)
        self.queue = WaitingQueue(self.policy, GrammarQueue(None, 1.0, self.metrics), 0, 0.0, self.metrics)
        max_tokens = num_pages * PAGE
        self.decode = (
            HandOff()
            if role == "prefill"
            else DecodeManager(self.ledger, self.queue, self.policy, self.metrics, max_tokens)
        )
        active = lambda: self.prefill.num_active + self.decode.num_active
        admission = Admission(
            self.queue,
            self.ledger,
            self.metrics,
            clock,
            config,
            max_tokens,
            active,
            lambda: self.decode.running,
        )
        self.outstanding: list = []
        self.first_tokens: list[tuple[str, int]] = []
        self.prefill = (
            RemotePrefill(admission, self._first_token, self._end)
            if role == "decode"
            else PrefillManager(admission, self.outstanding)
        )
        limits = RequestLimits(VOCAB, max_tokens, self.decode.prompt_room, self.usable, PAGE)
        self.reqs = RequestTable(
            limits,
            self.queue,
            self.ledger,
            self.metrics,
            clock,
            self._leave,
            self.prefill.draining.__contains__,
            True,
        )

    def _leave(self, req: Req) -> bool:
        self.queue.remove(req)
        self.decode.remove(req)
        return self.prefill.remove(req)

    def _first_token(self, req: Req, token: int, logprob) -> StepOutput:
        self.first_tokens.append((req.rid, token))
        self.decode.start(req)
        return StepOutput(req, [token])

    def _end(self, req: Req, reason: FinishReason, error: str = "") -> None:
        self.reqs.end(req, reason, error)

    def add(self, rid: str, prompt: list[int], max_new: int = 8) -> Req:
        req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new))
        self.reqs.add(req)
        return req

    def conserved(self) -> None:
        self.ledger.check_conservation(self.usable)


def ids(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def run_chunks(parts: Parts, reqs: list[Req], lens: list[int]) -> None:
    """What launching a batch does to an extend's requests: their computed tokens advance, and a
    prompt whose last chunk ran leaves the prefill stage."""
    for req, n in zip(reqs, lens, strict=True):
        req.num_computed += n
        if req.num_computed == req.seq_len:
            parts.prefill.launched(req)
            parts.decode.start(req)


def test_prefill_manager_continues_chunked_prompts_first_within_the_token_budget() -> None:
    parts = Parts("mixed")
    a, b, c = parts.add("a", ids(40)), parts.add("b", ids(40, 100)), parts.add("c", ids(40, 200))
    reqs, lens = parts.prefill.schedule(64)
    assert [r.rid for r in reqs] == ["a", "b"] and lens == [40, 24]  # b is chunked
    run_chunks(parts, reqs, lens)
    reqs, lens = parts.prefill.schedule(64)
    assert [r.rid for r in reqs] == ["b", "c"] and lens == [16, 40]  # b's rest before c
    run_chunks(parts, reqs, lens)
    assert [r.state for r in (a, b, c)] == [ReqState.RUNNING] * 3 and not parts.prefill.prefilling
    assert parts.decode.running == [a, b, c]
    parts.conserved()


def test_admission_takes_requests_in_order_until_one_does_not_fit() -> None:
    """A request that does not fit holds back the ones behind it (so it is not overtaken for ever)."""
    parts = Parts("mixed", num_pages=20, reserve=0)
    parts.add("small", ids(8))  # 2 pages
    parts.add("huge", ids(75, 100))  # 19 pages: not while "small" holds 2 of the 20
    parts.add("after", ids(8, 300))
    reqs, _ = parts.prefill.schedule(512)
    assert [r.rid for r in reqs] == ["small"]
    assert [r.rid for r in parts.queue.waiting] == ["huge", "after"]
    parts.conserved()


def test_admission_stops_at_max_running_requests() -> None:
    parts = Parts("mixed", max_running=2)
    for i in range(4):
        parts.add(f"r{i}", ids(8, 100 * i + 1))
    reqs, _ = parts.prefill.schedule(512)
    assert [r.rid for r in reqs] == ["r0", "r1"] and len(parts.queue.waiting) == 2


def test_a_request_sharing_an_uncached_prefix_with_one_in_flight_waits_for_its_kv() -> None:
    parts = Parts("mixed")
    shared = ids(IN_BATCH_PREFIX_TOKENS + 8)
    first = parts.add("first", shared + [900])
    parts.add("second", shared + [901])
    parts.add("other", ids(12, 500))
    reqs, lens = parts.prefill.schedule(512)
    assert [r.rid for r in reqs] == ["first", "other"]  # "second" waits for "first"'s pages
    run_chunks(parts, reqs, lens)
    parts.ledger.cache_unfinished(first)  # (what processing "first"'s batch does)
    reqs, lens = parts.prefill.schedule(512)
    assert [r.rid for r in reqs] == ["second"]
    assert reqs[0].cached_tokens == len(shared) // PAGE * PAGE and lens == [
        len(shared) + 1 - reqs[0].cached_tokens
    ]


class ThreeTokenDecode(DecodeManager):
    """A decode stage whose requests compute three tokens a step (a verify step's shape)."""

    def num_tokens(self, req: Req) -> int:
        return 3


def test_decode_manager_gives_each_request_slots_for_the_tokens_it_computes() -> None:
    parts = Parts("mixed")
    parts.decode = ThreeTokenDecode(parts.ledger, parts.queue, parts.policy, parts.metrics, 256)
    reqs, lens = parts.prefill.schedule(512)
    assert reqs == []
    req = parts.add("a", ids(7))
    reqs, lens = parts.prefill.schedule(512)
    run_chunks(parts, reqs, lens)
    req.output_ids.append(5)  # its first token: 8 tokens, 2 full pages
    batch, lens = parts.decode.schedule(in_flight=False)
    assert batch == [req] and lens == [3]
    assert len(req.pages) * PAGE >= req.seq_len + 2  # positions 7, 8, 9 have slots
    parts.conserved()


def test_decode_manager_retracts_the_newest_when_the_pool_is_short() -> None:
    parts = Parts("mixed", num_pages=6, reserve=0)
    old, new = parts.add("old", ids(12)), parts.add("new", ids(12, 100))  # 3 pages each, all 6 in use
    parts.now = 101.0
    reqs, lens = parts.prefill.schedule(512)
    run_chunks(parts, reqs, lens)
    new.admit_time += 1  # admitted later
    for req in (old, new):
        req.output_ids.append(7)  # its first token: 13 tokens, each needs a 4th page
    assert parts.decode.schedule(in_flight=True) is None  # a retraction is due: process the batch first
    assert parts.decode.running == [old, new]
    batch, lens = parts.decode.schedule(in_flight=False)
    assert batch == [old] and lens == [1]
    assert new.state is ReqState.WAITING and parts.queue.waiting == [new] and new.pages == []
    assert parts.metrics.retracted._value.get() == 1
    parts.conserved()


def test_remote_prefill_waiting_ready_failed_draining() -> None:
    """Decode role: admitted requests wait for their KV with pages reserved; one that lands decodes;
    one that ends while its KV arrives keeps its pages (the hook stops its transfer) until drained."""
    parts = Parts("decode")
    abandoned = []
    parts.prefill.on_abandoned = abandoned.append
    landed, aborted, failed = (parts.add(rid, ids(10, 100 * i + 1)) for i, rid in enumerate("laf"))
    assert parts.prefill.schedule(512) == ([], [])
    assert parts.prefill.pop_requests() == [landed, aborted, failed] and parts.prefill.pop_requests() == []
    assert all(r.state is ReqState.WAITING_FOR_KV and len(r.pages) == 3 for r in (landed, aborted, failed))
    out = parts.prefill.kv_ready("l", 42, cached_tokens=4, transferred_bytes=1000)
    assert out.req is landed and parts.first_tokens == [("l", 42)] and landed.state is ReqState.RUNNING
    assert landed.num_computed == 10 and landed.cached_tokens == 4 and parts.prefill.kv_ready("l", 1) is None
    assert parts.reqs.abort("a", "client went away")
    out = parts.prefill.kv_failed("f", "prefill failed: test", retryable=True)
    assert out.finished and failed.retryable and failed.finish_reason is FinishReason.ERROR
    assert abandoned == [aborted, failed] and set(parts.prefill.draining) == {"a", "f"}
    held = parts.ledger.used_pages()
    with pytest.raises(DuplicateRid):
        parts.add("a", ids(10))
    parts.prefill.kv_drained("a")
    parts.prefill.kv_drained("a")  # twice: freed once
    parts.prefill.kv_drained("l")  # never held: a no-op
    assert parts.ledger.used_pages() == held - 3 and set(parts.prefill.draining) == {"f"}
    parts.prefill.kv_drained("f")
    parts.reqs.end(landed, FinishReason.ABORT)
    assert parts.ledger.used_pages() == 0
    parts.conserved()


def test_hand_off_keeps_a_prefilled_request_until_its_kv_is_sent() -> None:
    """Prefill role: a prompt whose first token is sampled leaves this worker's scheduling (it is
    never decoded here), waits to be sent, and ends as its decode worker's, not counted here."""
    parts = Parts("prefill")
    req = parts.add("p", ids(12))
    reqs, lens = parts.prefill.schedule(512)
    run_chunks(parts, reqs, lens)
    assert req.state is ReqState.PREFILLING and parts.decode.schedule(in_flight=False) == ([], [])
    req.output_ids.append(3)
    assert parts.decode.hands_on(req) and parts.decode.pop() == [req] and parts.decode.pop() == []
    parts.reqs.end(req, FinishReason.STOP)  # (``Scheduler.prefill_sent``)
    assert parts.ledger.used_pages() == 0 and parts.ledger.cached_pages() == 3  # its prompt is cached
    parts.conserved()


def test_request_table_checks_before_anything_is_queued_and_ends_once() -> None:
    parts = Parts("mixed")
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        parts.add("bad", [VOCAB])
    with pytest.raises(ValueError, match="more KV pages"):
        parts.add("long", ids(parts.usable * PAGE))
    assert not parts.reqs and not parts.queue.waiting
    req = parts.add("r", ids(8))
    with pytest.raises(DuplicateRid):
        parts.add("r", ids(8))
    ended = []
    parts.reqs.on_request_end = ended.append
    assert parts.reqs.abort("r", "stop") and not parts.reqs.abort("r", "again")
    assert ended == [req] and req.state is ReqState.ABORTED and not parts.queue.waiting
    assert [out.req for out in parts.reqs.pop_aborted()] == [req] and parts.reqs.pop_aborted() == []
