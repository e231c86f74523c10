"""Scheduler core on the real model, transport-free: chunking, admission, retraction, abort, cache."""

from __future__ import annotations

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.bounds import MAX_SCHEDULER_RID_CHARS
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.req import FinishReason, Req, ReqState
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.table import DuplicateRid
from tests.reference import chat_ids, hf_greedy
from tests.scheduler.driver import PAGE, fresh, ids, make_runner, req
from tests.scheduler.driver import drive as drive_steps


@pytest.fixture(scope="module")
def big_runner() -> ModelRunner:
    return make_runner(8192)


@pytest.fixture(scope="module")
def small_runner() -> ModelRunner:
    return make_runner(12 * PAGE)


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
def overlap(request) -> bool:
    return request.param


def drive(sched: Scheduler, max_steps: int = 2000, on_step=None) -> dict[str, Req]:
    return drive_steps(sched, overlap=False, max_steps=max_steps, on_step=on_step)


def test_chunked_prefill_and_continuous_batching_match_hf(big_runner, overlap):
    prompts = {
        "short": ids("Hi"),
        "medium": ids("Write one sentence about the sea."),
        "long": ids(" ".join(["Summarize: the quick brown fox jumps over the lazy dog."] * 10)),
    }
    sched = fresh(big_runner, role="mixed", chunked_prefill_size=32)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_new=12))
    first = sched.schedule()
    # the budget of 32 tokens is split: no step extends more than the chunk size
    assert sum(first.extend_lens[: first.num_extend]) <= 32
    done = {o.req.rid: o.req for o in sched.process_result(first, sched.run_batch(first)) if o.finished}
    done |= drive_steps(sched, overlap)
    for rid, prompt in prompts.items():
        assert done[rid].output_ids == hf_greedy(prompt, 12), rid
        assert done[rid].state is ReqState.FINISHED


def test_radix_hit_extends_only_the_suffix_and_gives_the_same_tokens(big_runner):
    shared = ids(" ".join(["You are a helpful assistant who answers briefly."] * 8))
    a, b = shared + ids(" Question: what is 2+2?"), shared + ids(" Question: name a colour.")
    sched = fresh(big_runner, role="mixed")
    sched.add_request(req("a", a))
    drive(sched)
    r = req("b", b)
    sched.add_request(r)
    drive(sched)
    assert r.cached_tokens == len(shared) // PAGE * PAGE
    assert r.output_ids == hf_greedy(b, 16)
    assert sched.ledger.cached_pages() > 0

    nocache = fresh(big_runner, role="mixed", disable_radix_cache=True)
    r2 = req("b2", b)
    nocache.add_request(r2)
    drive(nocache)
    assert r2.cached_tokens == 0 and r2.output_ids == r.output_ids
    assert nocache.ledger.cached_pages() == 0


@pytest.mark.parametrize("clock", ["time", "one-reading-per-step"])
def test_retraction_when_decode_runs_out_of_pages_keeps_greedy_output(small_runner, overlap, clock):
    """With a clock read once per step (as a TP group's ranks share rank 0's), requests admitted
    together tie on admit time: the one retracted must still be the newest in the order decodes are
    given pages (it used to be one already in the batch: its pages gone, the batch failed)."""
    questions = ("Tell me a story about a dragon.", "Describe a city at night.", "Write a poem about rain.")
    prompts = [chat_ids([{"role": "user", "content": q}]) for q in questions]
    sched = fresh(small_runner, role="mixed", new_token_reserve=0)
    if clock == "one-reading-per-step":
        sched.clock = lambda: 1.0
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_new=48))
    before = sched.metrics.retracted._value.get()
    done = drive_steps(sched, overlap)
    assert sched.metrics.retracted._value.get() > before, "the pool was meant to be too small"
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].output_ids == hf_greedy(p, 48), i


def test_a_request_that_fits_the_pool_only_just_is_admitted():
    """180 prompt tokens + 4 new = 184 of the pool's 192: the reserve for the new tokens fits the
    prompt's partly filled last page (it used to be rounded up to a page of its own: never admitted).
    Its own runner: another scheduler's cached pages would shrink the pool."""
    prompt = ids("The quick brown fox jumps over the lazy dog. " * 40)[:180]
    sched = fresh(make_runner(12 * PAGE), role="mixed")
    sched.add_request(req("r", prompt, max_new=4))
    done = drive(sched, max_steps=50)
    assert done["r"].output_ids == hf_greedy(prompt, 4)


def test_a_lone_request_longer_than_the_pool_ends_with_length(overlap):
    """Asking for more tokens than the whole pool holds: the request stops at the pool's size with
    finish reason length (as at the context length), instead of retracting itself forever."""
    prompt = ids("Count from one to one thousand:")
    sched = fresh(make_runner(12 * PAGE), role="mixed")
    sched.add_request(req("r", prompt, max_new=400, ignore_eos=True))
    done = drive_steps(sched, overlap, max_steps=400)
    r = done["r"]
    assert r.finish_reason is FinishReason.LENGTH
    assert len(prompt) + len(r.output_ids) == 12 * PAGE
    assert r.output_ids == hf_greedy(prompt, len(r.output_ids))


def test_admission_respects_max_running_requests(big_runner):
    sched = fresh(big_runner, role="mixed", max_running_requests=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", ids(f"Count to {i + 3}."), max_new=4))
    batch = sched.schedule()
    assert len(batch.reqs) == 2 and len(sched.queue.waiting) == 2
    sched.process_result(batch, sched.run_batch(batch))
    assert len(drive(sched)) == 4


def test_abort_in_every_state_frees_every_page_once(big_runner, overlap):
    sched = fresh(big_runner, role="mixed", max_running_requests=2, chunked_prefill_size=16)
    long_prompt = ids(" ".join(["word"] * 60))
    for rid in ("running", "prefilling", "waiting"):
        sched.add_request(req(rid, long_prompt if rid == "prefilling" else ids("Hello there"), max_new=40))

    def on_step(step, s: Scheduler):
        if step == 2:
            assert s.reqs["running"].state is ReqState.RUNNING
            assert s.reqs["prefilling"].state is ReqState.PREFILLING
            assert s.reqs["waiting"].state is ReqState.WAITING
            for rid in ("running", "prefilling", "waiting"):
                assert s.abort_request(rid, "test")

    done = drive_steps(sched, overlap, on_step=on_step)
    assert {r.finish_reason for r in done.values()} == {FinishReason.ABORT}
    assert sched.abort_request("running") is False  # already gone
    assert sched.ledger.free_pages() + sched.ledger.cached_pages() == sched.usable_pages


def test_finished_requests_are_counted_by_finish_reason(big_runner, overlap):
    sched = fresh(big_runner, role="mixed")
    sched.add_request(req("long", ids("Count to ten."), max_new=3, ignore_eos=True))
    first_token = hf_greedy(ids("Hello"), 1)[0]
    sched.add_request(req("stopped", ids("Hello"), max_new=8, stop_token_ids=[first_token]))
    sched.add_request(req("aborted", ids("Hi"), max_new=8))
    sched.abort_request("aborted")
    done = drive_steps(sched, overlap)
    assert {rid: r.finish_reason.value for rid, r in done.items()} == {
        "long": "length",
        "stopped": "stop",
        "aborted": "abort",
    }
    count = sched.metrics.registry.get_sample_value
    for reason in ("length", "stop", "abort"):
        assert count("pdserve:requests_finished_total", {"finish_reason": reason}) == 1
    assert count("pdserve:requests_finished_total", {"finish_reason": "error"}) is None


def test_abort_of_a_request_inside_the_running_forward_applies_after_the_step(big_runner):
    sched = fresh(big_runner, role="mixed")
    sched.add_request(req("x", ids("Hello"), max_new=30))
    batch = sched.schedule()
    assert sched.abort_request("x", "client gone")  # arrives while the forward would run
    outputs = sched.process_result(batch, sched.run_batch(batch))
    assert outputs[0].finished and outputs[0].req.finish_reason is FinishReason.ABORT
    sched.check_invariants()
    assert sched.ledger.used_pages() == 0


def test_bad_requests_are_refused_with_clear_errors(big_runner):
    sched = fresh(big_runner, role="mixed")
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("e", []))
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(req("c", [1] * (sched.reqs.limits.context_len + 1)))
    vocab = big_runner.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, {vocab}\)"):
        sched.add_request(req("v", [1, vocab]))
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        sched.add_request(req("n", [-1, 2]))
    with pytest.raises(ValueError, match=rf"logit_bias names token id {vocab}, outside the vocabulary"):
        sched.add_request(req("b", [1, 2], logit_bias={vocab: 1.0}))
    assert not sched.reqs and not sched.queue.waiting
    for rid in ("", "r" * (MAX_SCHEDULER_RID_CHARS + 1)):  # (internal callers reach it too)
        with pytest.raises(ValueError, match=f"rid must have 1 to {MAX_SCHEDULER_RID_CHARS} characters"):
            sched.add_request(req(rid, [1, 2]))
    sched.add_request(req("d", [1, 2]))
    with pytest.raises(DuplicateRid, match="duplicate rid"):  # (the servicers' ALREADY_EXISTS)
        sched.add_request(req("d", [1, 2]))
    sched.abort_request("d")
    drive(sched)


def test_lpm_orders_by_cached_prefix_and_guards_against_starvation():
    a, b, c = (Req(x, [1, 2], SamplingParams()) for x in "abc")
    prefix = {"a": 0, "b": 64, "c": 16}
    policy = SchedulePolicy("lpm", lambda r: prefix[r.rid], starvation_s=60)
    queue = [a, b, c]
    policy.order(queue)
    assert [r.rid for r in queue] == ["b", "c", "a"]
    a.arrival_time -= 120  # a has waited too long: it goes first
    policy.order(queue)
    assert queue[0] is a
    fcfs = SchedulePolicy("fcfs", lambda r: 0)
    fcfs.order(queue)
    assert [r.rid for r in queue] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="unknown schedule policy"):
        SchedulePolicy("random", lambda r: 0)


def test_long_prompt_is_chunked_beside_the_decoding_batch(big_runner):
    """With 8 requests decoding, a 3,000-token prompt never stalls them: every step while it is
    prefilled is one chunk of at most chunked_prefill_size tokens run beside all 8 decodes, so their
    worst inter-token gap is one chunk step."""
    sched = fresh(big_runner, role="mixed", chunked_prefill_size=256)
    for i in range(8):
        sched.add_request(req(f"d{i}", ids(f"Count from {i} to one hundred:"), max_new=64, ignore_eos=True))
    for _ in range(3):  # all eight are decoding now
        batch = sched.schedule()
        sched.process_result(batch, sched.run_batch(batch))
    assert len(sched.decode.running) == 8
    long_prompt = ids(" ".join(["history"] * 3000))[:3000]
    sched.add_request(req("long", long_prompt, max_new=4))
    chunk_steps = 0
    while sched.reqs["long"].state is not ReqState.RUNNING:
        before = {r.rid: len(r.output_ids) for r in sched.decode.running}
        batch = sched.schedule()
        assert batch.num_extend == 1 and batch.extend_lens[0] <= 256
        assert {r.rid for r in batch.reqs[1:]} == set(before)  # every decoding request runs this step
        sched.process_result(batch, sched.run_batch(batch))
        assert all(len(sched.reqs[rid].output_ids) == n + 1 for rid, n in before.items() if rid in sched.reqs)
        chunk_steps += 1
    assert chunk_steps == -(-3000 // 256)
    drive(sched)


def test_requests_sharing_an_uncached_prefix_compute_it_once(big_runner):
    """Three prompts sharing a ~500-token prefix arrive together: the first is prefilled (in chunks,
    each chunk's full pages cached as soon as it is computed), the others wait for it and then
    extend only their own suffixes; every output is still HF's greedy output."""
    shared = ids(" ".join(["The committee reviewed the annual report in detail."] * 50))
    prompts = {f"q{i}": shared + ids(f" Question {i}: what did the committee do?") for i in range(3)}
    sched = fresh(big_runner, role="mixed", chunked_prefill_size=128)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_new=8))
    extended: dict[str, int] = {rid: 0 for rid in prompts}
    cached_while_prefilling = []
    done = {}
    while sched.has_work():
        if sched.prefill.prefilling:
            cached_while_prefilling.append(sched.ledger.cached_pages())
        batch = sched.schedule()
        for i in range(batch.num_extend):
            extended[batch.reqs[i].rid] += batch.extend_lens[i]
        for out in sched.process_result(batch, sched.run_batch(batch)):
            if out.finished:
                done[out.req.rid] = out.req
        sched.check_invariants()
    shared_pages = len(shared) // PAGE * PAGE
    assert extended["q0"] == len(prompts["q0"])
    for rid in ("q1", "q2"):
        assert done[rid].cached_tokens == shared_pages, rid
        assert extended[rid] == len(prompts[rid]) - shared_pages, rid
    assert sum(extended.values()) < len(shared) + 3 * 40  # the shared part was computed once
    assert cached_while_prefilling[-1] > 0, "chunks are cached while their request still runs"
    for rid, prompt in prompts.items():
        assert done[rid].output_ids == hf_greedy(prompt, 8), rid
    assert sched.ledger.used_pages() == 0


def test_disabled_cache_does_not_hold_back_requests_sharing_a_prefix(big_runner):
    shared = ids(" ".join(["A long shared instruction for every request."] * 10))
    sched = fresh(big_runner, role="mixed", disable_radix_cache=True)
    for i in range(3):
        sched.add_request(req(f"n{i}", shared + ids(f" Item {i}."), max_new=2))
    first = sched.schedule()
    assert first.num_extend == 3  # nothing to wait for: all extend together
    sched.process_result(first, sched.run_batch(first))
    drive(sched)


def test_decode_role_asks_for_a_shared_uncached_prefix_once(big_runner):
    """PD decode role: of three prompts sharing a ~500-token uncached prefix that arrive together,
    only the first asks a prefill worker for its KV; once that KV is in, the others are admitted on
    the cached prefix (sharing its pages), so the shared part crosses the wire once. Here the
    prefill worker is the test: it reports the first token without writing KV (only admission is
    under test), and every request is then aborted with every page freed."""
    shared = ids(" ".join(["The committee reviewed the annual report in detail."] * 50))
    prompts = {f"d{i}": shared + ids(f" Question {i}: what did the committee do?") for i in range(3)}
    sched = fresh(big_runner, role="decode")
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_new=8))
    assert sched.schedule() is None
    assert [r.rid for r in sched.pop_kv_requests()] == ["d0"]
    assert sched.schedule() is None and sched.pop_kv_requests() == []  # d1, d2 still wait for d0's KV
    out = sched.kv_ready("d0", first_token_id=42)
    assert out is not None and not out.finished and not sched.prefill.waiting_for_kv  # d0 runs
    batch = sched.schedule()  # d0 decodes; d1 and d2 are admitted on the cached prefix
    asked = sched.pop_kv_requests()
    assert [r.rid for r in asked] == ["d1", "d2"]
    shared_pages = len(shared) // PAGE
    d0 = next(r for r in batch.reqs if r.rid == "d0")
    for r in asked:
        assert r.cached_tokens == shared_pages * PAGE
        assert r.pages[:shared_pages] == d0.pages[:shared_pages]
    sched.process_result(batch, sched.run_batch(batch))
    for rid in prompts:
        sched.abort_request(rid)
    drive(sched)


def test_decode_role_holds_the_pages_of_a_request_whose_kv_is_arriving_until_drained(big_runner):
    """Abort, deadline or failure of a request still waiting for its KV: the servicer's
    ``on_kv_abandoned`` hook runs once, and the request's pages stay held (``kv_draining``, counted
    used) until ``kv_drained`` says no prefill worker writes them any more, then are freed once; a
    request with its KV in is not held. A rid cannot come back while its pages drain."""
    sched = fresh(big_runner, role="decode")
    seen: list[tuple[str, int]] = []
    sched.set_hooks(on_kv_abandoned=lambda r: seen.append((r.rid, sched.ledger.used_pages())))
    for rid in ("aborted", "expired", "failed", "landed"):
        sched.add_request(req(rid, ids(f"Prompt of the request that is {rid}, long enough for a page."), 4))
    sched.schedule()
    assert len(sched.pop_kv_requests()) == 4
    owned = sched.ledger.used_pages()
    sched.abort_request("aborted")
    sched.reqs["expired"].deadline = 1.0  # long past
    sched.schedule()
    sched.kv_failed("failed", "prefill failed: test")
    sched.kv_ready("landed", first_token_id=42)
    sched.abort_request("landed")
    assert [rid for rid, _ in seen] == ["aborted", "expired", "failed"]
    assert seen[0][1] == owned and all(used > 0 for _, used in seen)
    assert set(sched.prefill.draining) == {"aborted", "expired", "failed"} and not sched.reqs
    with pytest.raises(ValueError, match="duplicate rid"):
        sched.add_request(req("aborted", ids("The same rid again, while its pages drain."), 4))
    held = sched.ledger.used_pages()
    assert held > 0
    for rid in ("aborted", "expired", "failed", "landed"):  # "landed" was never held: a no-op
        sched.kv_drained(rid)
    sched.kv_drained("aborted")  # drained twice: freed once
    assert not sched.prefill.draining and sched.ledger.used_pages() < held
    drive(sched)
