"""JSON logs of the whole stack, parsed line by line: the rid on request lines, the stats lines."""

from __future__ import annotations

import secrets
import time

import httpx

from tests.ops.conftest import SERVED_NAMES, OpsStack


def test_every_line_is_json_and_request_lines_carry_the_rid(ops_stack: OpsStack) -> None:
    rid = f"ops-log-{secrets.token_hex(4)}"
    resp = httpx.post(
        f"{ops_stack.base_url}/v1/completions",
        headers={"X-Request-Id": rid},
        json={"model": SERVED_NAMES[1], "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == rid
    missing = httpx.post(
        f"{ops_stack.base_url}/v1/completions",
        headers={"X-Request-Id": f"{rid}-404"},
        json={"model": "no-such-model", "prompt": "x", "max_tokens": 1},
        timeout=30,
    )
    assert missing.status_code == 404
    time.sleep(0.5)  # the access line is written as the response starts, the request line at its end
    records = ops_stack.log_records()  # every line parses, or this raises
    assert all({"timestamp", "level", "service", "message"} <= r.keys() for r in records)
    mentions = [r for r in records if rid in r["message"]]
    assert mentions, "no line mentions the request"
    for record in mentions:
        assert record.get("rid", "").startswith(rid), record
    access = [r for r in records if r["logger"] == "uvicorn.access"]
    assert access and all(r.get("rid") for r in access)  # health polls too get a rid of their own
    access = [r for r in access if r["rid"].startswith(rid)]
    assert [r["rid"] for r in access] == [rid, f"{rid}-404"]
    assert all(r["service"] == "gateway" and r["process"] == "gateway" for r in access)
    assert '"POST /v1/completions HTTP/1.1" 200' in access[0]["message"]
    ended = [r for r in mentions if r["message"].startswith(f"request {rid} ended (completed)")]
    assert [r["rid"] for r in ended] == [rid]


def test_each_scheduler_logs_a_stats_line(ops_stack: OpsStack) -> None:
    start = time.time()
    client = ops_stack.client()
    client.completions.create(model=SERVED_NAMES[0], prompt="The weather today", max_tokens=48, temperature=0)
    time.sleep(1.5)  # one more interval
    stats = [r for r in ops_stack.log_records() if r["message"].startswith("stats: ")]
    by_process: dict[str, list[dict]] = {}
    for record in stats:
        by_process.setdefault(record["process"], []).append(record)
    assert set(by_process) == {"prefill-0", "decode-0"}
    for process, records in by_process.items():
        recent = [
            r for r in records if r["timestamp"] >= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start))
        ]
        assert recent, f"{process}: no stats line during the request"
        for r in recent:
            assert 0 <= r["kv_usage"] <= 1 and 0 <= r["prefix_cache_hit_rate"] <= 1
            assert r["running"] >= 0 and r["queued"] >= 0
            assert f"running {r['running']}, queued {r['queued']}" in r["message"]
        # the decode worker generated tokens in some interval, the prefill worker took prompts
        key = "generation_tokens_per_s" if process == "decode-0" else "prompt_tokens_per_s"
        assert max(r[key] for r in recent) > 0, process
