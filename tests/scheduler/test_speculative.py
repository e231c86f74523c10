"""Speculative decoding in the scheduler core on the real model: greedy outputs token for token those
of decoding without it (and of HF transformers fp32), with n-gram drafts and with the target as its
own draft model (which must accept every greedy draft); chunked prefill, radix hits, retraction,
abort mid-verify and grammars; pages conserved after every step (``drive``) and the radix tree
holding verified tokens only."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.constrained.backend import GrammarBackend
from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req, ReqState
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.speculative.draft_model import DraftModelProposer
from pdserve.speculative.ngram import NgramProposer
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.scheduler.driver import PAGE, POISON_SEED, PoisonedSampler, cached_sequences, drive, make_runner

NEW = 32
PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at dusk, trimmed the wick, polished the "
    "great lens and watched the ships pass the rocks until morning."
)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(8192)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    return {
        "repeat": chat_ids([{"role": "user", "content": f"Repeat this sentence exactly:\n\n{PASSAGE}"}]),
        "rename": chat_ids([{"role": "user", "content": f"Rename the function area to surface:\n\n{code}"}]),
        "colors": chat_ids([{"role": "user", "content": "Name three colors."}]),
    }


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
def overlap(request) -> bool:
    return request.param


def scheduler(runner, proposer=None, **config) -> Scheduler:
    sched = Scheduler(runner, SchedulerConfig(**config), proposer=proposer)
    sched.ledger.tree.reset()
    return sched


def greedy(rid: str, prompt: list[int], max_new: int = NEW, **params) -> Req:
    return Req(rid, list(prompt), SamplingParams(**{"temperature": 0.0, "max_new_tokens": max_new} | params))


def run(sched: Scheduler, prompts: dict[str, list[int]], overlap: bool, **params) -> dict[str, Req]:
    for rid, prompt in prompts.items():
        sched.add_request(greedy(rid, prompt, **params))
    done = drive(sched, overlap=overlap)
    assert set(done) == set(prompts)
    return done


def assert_cache_verified(sched: Scheduler, done: dict[str, Req]) -> None:
    """Each sequence the radix tree holds is a prefix of some request's verified tokens."""
    verified = [r.origin_input_ids + r.output_ids for r in done.values()]
    for key in cached_sequences(sched.ledger.tree):
        assert any(list(key) == seq[: len(key)] for seq in verified), key


def counts(sched: Scheduler) -> tuple[float, float, float]:
    m = sched.metrics
    return (
        m.spec_decode_num_drafts._value.get(),
        m.spec_decode_num_draft_tokens._value.get(),
        m.spec_decode_num_accepted_tokens._value.get(),
    )


def test_ngram_speculation_gives_the_greedy_tokens_of_hf(runner, prompts, overlap):
    sched = scheduler(runner, NgramProposer(), speculative_policy="always", chunked_prefill_size=32)
    done = run(sched, prompts, overlap, return_logprob=True, top_logprobs_num=2)
    plain = run(scheduler(runner), prompts, overlap, return_logprob=True, top_logprobs_num=2)
    for rid, prompt in prompts.items():
        assert done[rid].output_ids == plain[rid].output_ids == hf_greedy(prompt, NEW), rid
        assert done[rid].state is ReqState.FINISHED
        # logprobs of the accepted tokens are those of plain decoding (float32 GEMMs: within 1e-4)
        got = torch.tensor([lp for _, lp, _ in done[rid].output_logprobs])
        want = torch.tensor([lp for _, lp, _ in plain[rid].output_logprobs])
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for _, _, top in done[rid].output_logprobs] == [
            [t for t, _ in top] for _, _, top in plain[rid].output_logprobs
        ]
    drafts, drafted, accepted = counts(sched)
    assert drafts > 0 and accepted >= 20  # the repeated sentence: most drafts stand
    assert accepted <= drafted
    assert_cache_verified(sched, done)


def test_radix_hit_and_opt_out_keep_the_tokens(runner, prompts):
    sched = scheduler(runner, NgramProposer(), speculative_policy="always")
    first = run(sched, {"a": prompts["repeat"]}, overlap=False)
    again = run(sched, {"b": prompts["repeat"]}, overlap=False)
    assert again["b"].cached_tokens >= len(prompts["repeat"]) // PAGE * PAGE - PAGE
    assert again["b"].output_ids == first["a"].output_ids == hf_greedy(prompts["repeat"], NEW)
    before = counts(sched)
    out = run(sched, {"c": prompts["rename"]}, overlap=False, speculative_num_draft_tokens=0)
    assert counts(sched) == before  # it opted out: nothing drafted for it
    assert out["c"].output_ids == hf_greedy(prompts["rename"], NEW)
    assert_cache_verified(sched, first | again | out)


def test_max_tokens_and_stop_ids_cut_the_accepted_tokens(runner, prompts):
    plain = run(scheduler(runner), {"p": prompts["repeat"]}, overlap=False)["p"].output_ids
    sched = scheduler(runner, NgramProposer(), speculative_policy="always")
    short = run(sched, {"s": prompts["repeat"]}, overlap=False, max_new=7)["s"]
    assert short.output_ids == plain[:7] and short.finish_reason.value == "length"
    stop = plain[12]
    stopped = run(sched, {"t": prompts["repeat"]}, overlap=False, stop_token_ids=[stop])["t"]
    assert stopped.output_ids == plain[: plain.index(stop) + 1] and stopped.finish_reason.value == "stop"


def test_retraction_under_a_short_pool_keeps_greedy_output(prompts):
    small = make_runner(16 * PAGE)
    sched = scheduler(small, NgramProposer(), speculative_policy="always")
    done = run(sched, {"x": prompts["repeat"], "y": prompts["colors"]}, overlap=True)
    for rid, prompt in (("x", prompts["repeat"]), ("y", prompts["colors"])):
        assert done[rid].output_ids == hf_greedy(prompt, NEW), rid


def test_abort_mid_verify_releases_everything(runner, prompts):
    sched = scheduler(runner, NgramProposer(), speculative_policy="always")
    sched.add_request(greedy("x", prompts["repeat"]))

    def abort_in_verify(n: int, s: Scheduler) -> None:
        if any(b.verifies for b in s.outstanding) and s.request("x") is not None:
            assert s.abort_request("x", "client gone")

    done = drive(sched, overlap=True, on_step=abort_in_verify)
    assert done["x"].state is ReqState.ABORTED and len(done["x"].output_ids) < NEW
    assert sched.ledger.used_pages() == 0 and sched.ledger.req_to_token_pool.available_size() > 0
    assert_cache_verified(sched, done)


def test_a_forward_failure_in_a_verify_batch_fails_only_the_request_responsible(runner, prompts, monkeypatch):
    """A request that breaks the forward joins while the others verify drafts: the verify batch is
    bisected with each request's per-position sampling rows, the bad request fails alone, and the
    others keep HF's greedy tokens, their drafts still verified."""
    sampler = PoisonedSampler(runner.sampler)
    monkeypatch.setattr(runner, "sampler", sampler)
    sched = scheduler(runner, NgramProposer(), speculative_policy="always")
    for rid, prompt in prompts.items():
        sched.add_request(greedy(rid, prompt))

    def poison_while_verifying(n: int, s: Scheduler) -> None:
        if "bad" not in added and any(b.verifies for b in s.outstanding):
            added.add("bad")
            s.add_request(greedy("bad", prompts["colors"], max_new=8, temperature=1.0, seed=POISON_SEED))

    added: set[str] = set()
    done = drive(sched, overlap=True, on_step=poison_while_verifying)
    assert sampler.verify_failures > 0  # the failing batches verified drafts
    assert done["bad"].state is ReqState.FAILED and "injected failure" in done["bad"].error
    for rid, prompt in prompts.items():
        assert done[rid].output_ids == hf_greedy(prompt, NEW), rid
    assert counts(sched)[2] > 0
    assert_cache_verified(sched, done)


def test_the_target_as_its_own_draft_model_accepts_every_greedy_draft(prompts):
    """Quantized (w4a8: every matmul per row) target and draft: the draft computes what the target
    computes, so every greedy draft stands, and the outputs are those of decoding without it."""
    torch.set_num_threads(2)
    args = dict(dtype="float32", quantization="w4a8", page_size=PAGE, max_total_tokens=4096)
    target = ModelRunner(resolve_model(), **args)
    draft = DraftModelProposer.load(resolve_model(), resolve_model(), **args, max_running_requests=8)
    sched = scheduler(target, draft, speculative_policy="always", speculative_num_draft_tokens=3)
    subset = {k: prompts[k] for k in ("repeat", "colors")}
    done = run(sched, subset, overlap=True)
    plain = run(scheduler(target), subset, overlap=True)
    for rid in subset:
        assert done[rid].output_ids == plain[rid].output_ids, rid
    drafts, drafted, accepted = counts(sched)
    assert drafts > 0 and accepted == drafted
    assert draft.kv.pages_in_use() == 0 and not draft.kv.seqs  # its own pool emptied as requests end


def test_structured_output_under_speculation_is_the_plain_one(runner):
    """A JSON-schema request whose drafts the grammar cuts: the same tokens as without speculation,
    and valid JSON of the schema."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "city": {"enum": ["Paris", "Rome", "Oslo"]},
        },
        "required": ["name", "city"],
        "additionalProperties": False,
    }
    prompt = chat_ids([{"role": "user", "content": "Give a person as JSON: name Ada Lovelace, city Rome."}])
    backend = GrammarBackend(hf_tokenizer, 49152, [2])
    outputs = []
    try:
        for proposer in (NgramProposer(), None):
            sched = Scheduler(
                runner,
                SchedulerConfig(speculative_policy="always"),
                grammar_backend=backend,
                proposer=proposer,
            )
            sched.ledger.tree.reset()
            r = greedy("j", prompt, max_new=48, json_schema=json.dumps(schema))
            sched.add_request(r)
            sched.grammar_future("j").exception(timeout=120)
            drive(sched, overlap=True)
            outputs.append(r.output_ids)
            if proposer is not None:
                assert counts(sched)[1] > 0  # drafts were verified under the grammar
    finally:
        backend.close()
    assert outputs[0] == outputs[1]
    value = json.loads(hf_tokenizer().decode(outputs[0], skip_special_tokens=True))
    assert value["city"] in ("Paris", "Rome", "Oslo")


def test_seeded_sampling_under_ngram_speculation_gives_the_plain_tokens(runner, prompts):
    """Deterministic drafts: each position samples with its own step seed as without speculation, and
    the rejection rule with a point-mass ``q`` keeps the samples up to the first that differs, so a
    seeded request's tokens are its non-speculative ones."""
    subset = {k: prompts[k] for k in ("repeat", "colors")}
    params = dict(temperature=0.7, top_p=0.9, seed=1234)
    sched = scheduler(runner, NgramProposer(), speculative_policy="always")
    spec = run(sched, subset, overlap=False, **params)
    plain = run(scheduler(runner), subset, overlap=False, **params)
    for rid in subset:
        assert spec[rid].output_ids == plain[rid].output_ids, rid
    assert counts(sched)[2] > 0
