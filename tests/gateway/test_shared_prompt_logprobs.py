"""A request with n > 1 and prompt logprobs: sample 0 alone scores the prompt, and the handle gives
every other sample a copy on its first piece, whichever sample's outputs come first (the
end-to-end check, with the scheduler's prefill counted: tests/scoring/test_scoring_e2e.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.services.gateway.io_struct import ChoiceDelta, SamplingParams, TokenLogprob
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.requests.state import ReqState, RequestHandle, RequestRegistry

SCORES = [TokenLogprob(2, -1.5), TokenLogprob(3, -0.25)]


def handle_of(n: int) -> tuple[RequestHandle, list[ReqState]]:
    metrics = GatewayMetrics(CollectorRegistry())
    handle = RequestHandle("r", None, RequestRegistry(), metrics, lambda s, r: None, lambda h: None)
    states = [ReqState(f"r-{i}", i, [1, 2, 3], SamplingParams(), handle) for i in range(n)]
    for state in states:
        handle.add_choice(state)
    for state in states[1:]:  # as RequestManager._dispatch links them
        state.scorer, state.held = states[0], []
        states[0].samples.append(state)
    return handle, states


async def test_every_sample_gets_sample_0s_prompt_logprobs_once() -> None:
    handle, states = handle_of(4)
    handle.push(states[2], ChoiceDelta(2, "a", [5]))  # before sample 0's scores: held
    handle.push(states[2], ChoiceDelta(2, "b", [6], finish_reason="length"))
    assert handle.queue.empty()
    handle.push(states[0], ChoiceDelta(0, "c", [7], prompt_logprobs=list(SCORES), finish_reason="length"))
    handle.push(states[1], ChoiceDelta(1, "d", [8], finish_reason="length"))  # after them
    handle.abort("client gone", [states[3]])  # an end with no piece before it
    got = [(d.index, d.text, d.prompt_logprobs) async for d in handle]
    assert got == [
        (0, "c", SCORES),
        (2, "a", SCORES),
        (2, "b", []),
        (1, "d", SCORES),
        (3, "", SCORES),
    ]
    assert handle.completed


async def test_samples_are_not_held_for_ever_when_sample_0_fails() -> None:
    handle, states = handle_of(2)
    handle.push(states[1], ChoiceDelta(1, "a", [5], finish_reason="length"))
    handle.push(states[0], ChoiceDelta(0, finish_reason="error", error="boom"))
    got = [(d.index, d.finish_reason, d.prompt_logprobs) async for d in handle]
    assert got == [(0, "error", []), (1, "length", [])]
