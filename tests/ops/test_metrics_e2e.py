"""Each service's own /metrics, scraped directly, against the metrics table of docs/operations.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.conftest import METRICS_OFFSETS, SERVED_NAMES, OpsStack

OPERATIONS_DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@dataclass(frozen=True)
class Documented:
    name: str  # as queried: counters end in _total
    type: str
    labels: frozenset[str]
    roles: frozenset[str]


def documented() -> dict[str, Documented]:
    """The rows of docs/operations.md's metrics table."""
    rows = {}
    for line in OPERATIONS_DOC.read_text().splitlines():
        if not line.startswith("| `pdserve:"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, kind, labels, roles = cells[0].strip("`"), cells[1], cells[2], cells[3]
        rows[name] = Documented(
            name,
            kind,
            frozenset(re.findall(r"`(\w+)`", labels)),
            frozenset(r.strip() for r in roles.split(",")),
        )
    return rows


def scrape(url: str) -> dict[str, tuple[str, set[frozenset]]]:
    """``pdserve:`` families of one endpoint: name (as queried) -> (type, label-name sets of samples)."""
    text = httpx.get(url, timeout=10).text
    families = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("pdserve:"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        families[name] = (family.type, {frozenset(s.labels) for s in family.samples})
    return families


def test_every_service_exposes_what_the_readme_documents(ops_stack: OpsStack) -> None:
    client = ops_stack.client()
    client.completions.create(model=SERVED_NAMES[0], prompt="A metrics check:", max_tokens=4, temperature=0)
    table = documented()
    assert len(table) >= 25
    for role in METRICS_OFFSETS:
        exposed = scrape(ops_stack.metrics_url(role))
        expected = {name for name, row in table.items() if role in row.roles}
        assert set(exposed) == expected, (
            f"{role}: undocumented {set(exposed) - expected}, missing {expected - set(exposed)}"
        )
        for name, (kind, label_sets) in exposed.items():
            row = table[name]
            assert kind == row.type, f"{role} {name}"
            for labels in label_sets:  # histogram samples add "le"
                assert labels - {"le"} == row.labels | {"model_name"}, f"{role} {name}: {labels}"
        # every sample of the endpoint names the served model, process metrics included
        text = httpx.get(ops_stack.metrics_url(role), timeout=10).text
        for family in text_string_to_metric_families(text):
            assert all(s.labels.get("model_name") == SERVED_NAMES[0] for s in family.samples), family.name


def test_scheduler_values_follow_the_requests(ops_stack: OpsStack) -> None:
    """Counts move by what one request did, on the worker that did it."""

    def values(role: str) -> dict[str, float]:
        text = httpx.get(ops_stack.metrics_url(role), timeout=10).text
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.labels.keys() - {"model_name"}
        }

    before = {role: values(role) for role in ("prefill", "decode")}
    resp = ops_stack.client().completions.create(
        model=SERVED_NAMES[0],
        prompt="Count the stars",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt = resp.usage.prompt_tokens
    after = {role: values(role) for role in ("prefill", "decode")}
    for role in ("prefill", "decode"):
        delta = {k: after[role][k] - before[role].get(k, 0.0) for k in after[role]}
        assert delta["pdserve:prompt_tokens_total"] == prompt
        assert delta["pdserve:request_prompt_tokens_count"] == 1
        assert delta["pdserve:request_prompt_tokens_sum"] == prompt
        assert delta["pdserve:prefix_cache_queries_total"] == prompt
        assert 0 <= delta["pdserve:prefix_cache_hit_tokens_total"] < prompt
        assert 0 <= after[role]["pdserve:kv_cache_usage_perc"] <= 1
    # the prefill worker samples the first token, the decode worker the other five
    assert (
        after["prefill"]["pdserve:generation_tokens_total"]
        - before["prefill"]["pdserve:generation_tokens_total"]
        == 1
    )
    assert (
        after["decode"]["pdserve:request_generation_tokens_sum"]
        - before["decode"].get("pdserve:request_generation_tokens_sum", 0)
        == 6
    )
    assert (
        after["prefill"]["pdserve:kv_transfer_seconds_count"]
        - before["prefill"]["pdserve:kv_transfer_seconds_count"]
        == 1
    )
    assert (
        after["prefill"]["pdserve:kv_transfer_bytes_total"]
        > before["prefill"]["pdserve:kv_transfer_bytes_total"]
    )
