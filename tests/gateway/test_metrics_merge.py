"""/metrics merging: real scheduler and gateway registries, re-exposed with role/worker labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.services.gateway.metrics import GatewayMetrics, render_merged


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_merge_labels_every_worker_and_keeps_values() -> None:
    gateway = GatewayMetrics("m")
    gateway.requests.labels("/v1/completions", "200").inc(3)
    gateway.ttft.observe(0.2)
    workers = {
        "d0:1": SchedulerMetrics("decode", "m"),
        "d1:1": SchedulerMetrics("decode", "m"),
        "p0:1": SchedulerMetrics("prefill", "m"),
    }
    for i, m in enumerate(workers.values()):
        m.num_running.set(i + 1)
        m.kv_transfer_bytes.inc(100 * (i + 1))
        m.ttft.observe(0.01 * (i + 1))
    backends = [(m.role, address, m.text()) for address, m in workers.items()]

    text = render_merged(gateway, "gw:9", backends).decode()
    got = samples(text)

    def key(name: str, role: str, worker: str, **labels: str) -> tuple[str, frozenset]:
        return name, frozenset({"role": role, "worker": worker, "model_name": "m", **labels}.items())

    for i, (address, m) in enumerate(workers.items()):
        assert got[key("pdserve:num_running_reqs", m.role, address)] == i + 1
        assert got[key("pdserve:kv_transfer_bytes_total", m.role, address)] == 100 * (i + 1)
        assert got[key("pdserve:time_to_first_token_seconds_count", m.role, address)] == 1
    assert (
        got[
            key("pdserve:gateway_requests_total", "gateway", "gw:9", endpoint="/v1/completions", status="200")
        ]
        == 3
    )
    assert got[key("pdserve:time_to_first_token_seconds_sum", "gateway", "gw:9")] == 0.2
    # One family per name: the gateway's and the schedulers' TTFT histograms are merged, not repeated.
    assert text.count("# TYPE pdserve:time_to_first_token_seconds histogram") == 1
    assert text.count("# TYPE pdserve:num_running_reqs gauge") == 1


def test_unparsable_backend_text_is_skipped() -> None:
    text = render_merged(GatewayMetrics(), "gw:9", [("decode", "d0:1", "this is { not prometheus")]).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "pdserve:e2e_request_latency_seconds" in names
