"""Unit tests (no model) of what a tensor-parallel scheduler's step seam sends and refuses: a new
request reaches the other ranks without rank 0's tracing span, and constrained requests are refused
under TP (their grammars compile per process, at times the ranks would not agree on)."""

from __future__ import annotations

import pickle
import threading

import pytest

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.route import Route
from pdserve.services.common.events import NewRequest
from pdserve.services.common.grammar_wait import GRAMMAR_UNDER_TP, tp_refusal

TP2 = TpGroup(rank=0, size=2)


@pytest.mark.parametrize(
    "grammar",
    [{"json_schema": '{"type": "object"}'}, {"regex": "[a-z]+"}, {"ebnf": 'root ::= "yes" | "no"'}],
)
def test_constrained_requests_are_refused_under_tp(grammar):
    params = SamplingParams(max_new_tokens=4, **grammar)
    assert tp_refusal(params, TP2) == GRAMMAR_UNDER_TP
    assert "--tp-size > 1" in GRAMMAR_UNDER_TP
    assert tp_refusal(params, SINGLE_RANK) == ""


def test_free_requests_run_under_tp():
    assert tp_refusal(SamplingParams(max_new_tokens=4), TP2) == ""


def test_new_request_reaches_other_ranks_without_the_span():
    span = threading.Lock()  # like an OpenTelemetry span: an object of this process, not picklable
    route = Route(output_address="a:1")
    req = Req(rid="r1", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(), route=route, span=span)
    copy = pickle.loads(pickle.dumps(NewRequest(req)))
    assert copy.req.rid == "r1" and copy.req.origin_input_ids == [1, 2, 3]
    assert copy.req.route == Route(output_address="a:1") and copy.req.span is None
    assert req.span is span  # rank 0's own request keeps it (it applies its own object)
    plain = pickle.loads(pickle.dumps(NewRequest(Req("r2", [4], SamplingParams()))))
    assert plain.req.rid == "r2"
