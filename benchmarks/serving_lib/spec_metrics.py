"""Speculative decoding's counters of a pdserve server, read from its gateway's ``/metrics`` around
one load level: the drafting steps, draft tokens and accepted draft tokens of the level, from which
the acceptance rate and vLLM's mean accepted length (1 + accepted / drafting steps) follow."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def spec_counters(root_url: str, api_key: str | None = None) -> dict[str, float]:
    """``{counter: value}`` summed over the server's schedulers; empty where the server has no such
    metrics (another server, or /metrics unreachable)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(f"{root_url}/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    names = {f"pdserve:spec_decode_{c}_total": c for c in COUNTERS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] = out.get(names[sample.name], 0.0) + sample.value
    return out


def spec_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The level's drafting steps and draft / accepted tokens, its acceptance rate and mean accepted
    length; empty when nothing was drafted."""
    delta = {c: after.get(c, 0.0) - before.get(c, 0.0) for c in COUNTERS}
    if not delta["num_drafts"]:
        return {}
    return delta | {
        "acceptance_rate": delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1.0),
        "mean_accepted_len": 1 + delta["num_accepted_tokens"] / delta["num_drafts"],
    }
