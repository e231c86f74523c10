"""Fuzzing the gateway's HTTP API from its own OpenAPI document (schemathesis): no 5xx, ever.

Every operation gets schema-valid requests (positive mode, which run on the real model) and invalid
ones (negative mode: wrong types, out-of-range numbers, missing fields, ...), seeded so that a run
repeats. Requests that would generate for long are cut to a few tokens (``max_tokens`` and friends
at most ``MAX_NEW``, ``n`` and batches at most 2): the fuzzer is after input handling, not
throughput; out-of-range values are left as drawn. After the run, every scheduler is idle with its
KV pool conserved (the ``colocated`` fixture checks it). The statuses seen and the time taken are
printed (``-s``) for the record.
"""

from __future__ import annotations

import time
from collections import Counter

import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.stack import Stack

SEED = 19
MAX_NEW = 4
# examples per operation and mode; positive ones of the generating endpoints run the model
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 60}
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
SIZE_FIELDS = (
    "max_tokens", "max_completion_tokens", "max_output_tokens",
    "max_new_tokens", "min_tokens", "min_new_tokens",
)  # fmt: skip
LIMIT = {"/generate": "max_new_tokens", "/v1/responses": "max_output_tokens"}  # else max_tokens


def shrink(body: object, path: str) -> None:
    """Cut a generating request's size fields (valid ones only) and add a small ``max_tokens``."""
    if path not in GENERATING or not isinstance(body, dict):
        return
    if path == "/generate" and body.get("sampling_params") is None:  # absent or null: the defaults
        body["sampling_params"] = {}
    params = body.get("sampling_params") if path == "/generate" else body
    if not isinstance(params, dict):
        return
    for name in SIZE_FIELDS:
        value = params.get(name)
        if type(value) is int and 0 < value < 2**31:
            params[name] = min(value, MAX_NEW)
    limit = LIMIT.get(path, "max_tokens")
    if params.get(limit) is None:  # absent or null: both mean "up to the context length"
        params[limit] = MAX_NEW
    if type(params.get("n")) is int and 1 <= params["n"] <= 128:
        params["n"] = min(params["n"], 2)
    for name in ("prompt", "text", "input_ids"):
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], list | str):
            body[name] = value[:2]


class Record:
    """What the fuzzer sent and got: (operation, status) counts, and the 5xx answers."""

    def __init__(self) -> None:
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.errors: list[str] = []


def fuzz(operation, mode: GenerationMode, examples: int, base_url: str, record: Record) -> None:
    """``examples`` seeded requests of ``mode`` to ``operation``; statuses and 5xx go to ``record``."""
    session = requests.Session()

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case) -> None:
        shrink(case.body, operation.path)
        response = case.call(base_url=base_url, session=session, timeout=120)
        record.statuses[(operation.label, response.status_code)] += 1
        if response.status_code >= 500:
            record.errors.append(f"{operation.label} {case.body!r:.300} -> {response.text[:300]}")

    try:
        call()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to get wrong (GET /health)


def test_fuzzed_requests_never_get_a_server_error(colocated: Stack) -> None:
    schema = schemathesis.openapi.from_url(f"{colocated.base_url}/openapi.json")
    record = Record()
    started = time.monotonic()
    for result in schema.get_all_operations():
        for mode, examples in EXAMPLES.items():
            fuzz(result.ok(), mode, examples, colocated.base_url, record)
    took = time.monotonic() - started
    by_status = Counter(status for (_, status) in record.statuses.elements())
    print(f"\nfuzz: {by_status.total()} requests in {took:.0f} s; statuses {dict(sorted(by_status.items()))}")
    for (label, status), count in sorted(record.statuses.items()):
        print(f"  {label}: {status} x{count}")
    assert not record.errors, record.errors[:5]
