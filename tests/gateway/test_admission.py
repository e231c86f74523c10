"""The gateway's pending limit: configured, or sized from what the healthy decode workers report."""

from __future__ import annotations

import pytest

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.io_struct import GenerateReqInput, SamplingParams
from pdserve.services.gateway.requests.admission import check_pending, pending_limit
from pdserve.services.gateway.routing.workers import WorkerPool


def pool(*capacities: int | None) -> WorkerPool:
    decode = WorkerPool("decode", [f"10.0.0.{i}:1" for i in range(len(capacities))])
    for worker, capacity in zip(decode.workers, capacities, strict=True):
        worker.capacity = capacity
    return decode


def test_default_is_the_sum_of_the_healthy_decode_workers_capacities() -> None:
    decode = pool(126, 192)
    assert pending_limit(None, decode) == 318
    decode.workers[1].healthy = False
    assert pending_limit(None, decode) == 126


def test_no_default_limit_until_every_worker_reported_a_bounded_queue() -> None:
    assert pending_limit(None, pool(126, None)) is None  # not reported yet
    assert pending_limit(None, pool(126, 0)) is None  # --max-queued-requests 0: unbounded
    assert pending_limit(None, pool()) is None


def test_configured_limit_wins_and_zero_means_none() -> None:
    assert pending_limit(7, pool(126)) == 7
    assert pending_limit(0, pool(126)) is None


def request(prompts: int = 1, n: int = 1) -> GenerateReqInput:
    return GenerateReqInput("r", ["hi"] * prompts, SamplingParams(), n=n)


def test_past_the_limit_is_a_429_with_retry_after() -> None:
    decode = pool(3)
    check_pending(request(), 2, None, decode)
    with pytest.raises(GatewayError) as refused:
        check_pending(request(), 3, None, decode)
    error = refused.value
    assert (error.status, error.headers, error.code) == (429, {"Retry-After": "1"}, "too_many_requests")
    assert error.message == "the server is overloaded: 3 sub-requests in flight (limit 3); retry later"
    assert error.grpc_code.name == "RESOURCE_EXHAUSTED"


def test_sub_requests_count_and_a_fan_out_past_the_limit_is_a_400() -> None:
    decode = pool(8)
    check_pending(request(prompts=2, n=3), 2, None, decode)  # 2 + 6 = 8
    with pytest.raises(GatewayError) as refused:
        check_pending(request(prompts=2, n=3), 3, None, decode)
    assert refused.value.status == 429
    with pytest.raises(GatewayError) as refused:
        check_pending(request(prompts=3, n=3), 0, None, decode)
    assert (refused.value.status, refused.value.param) == (400, "n")
    check_pending(request(prompts=100, n=128), 10**6, 0, decode)  # 0: no limit


def test_more_sub_requests_than_the_decode_queues_hold_are_a_400() -> None:
    decode = pool(192)
    decode.workers[0].max_queued = 128  # they arrive together: only 128 can wait, whatever the limit
    embed = GenerateReqInput("r", [[t] for t in range(150)], SamplingParams(embed=True))
    for configured in (None, 1000):
        with pytest.raises(GatewayError) as refused:
            check_pending(embed, 0, configured, decode)
        assert (refused.value.status, refused.value.param) == (400, "input")
        want = "the request fans out into 150 inputs; this server takes at most 128 at once"
        assert refused.value.message == want
    with pytest.raises(GatewayError) as refused:
        check_pending(request(n=129), 0, None, decode)
    assert (refused.value.status, refused.value.param) == (400, "n")
    check_pending(request(n=128), 0, None, decode)
    decode.workers[0].max_queued = 0  # an unbounded queue: only the limit counts
    check_pending(request(n=150), 0, None, decode)
