"""The KV tier under the scheduler, on the real model: a working set about 4x the pool comes back
from the tier (loaded back, not recomputed) with the greedy tokens of HF transformers fp32, and the
pool's and the tier's pages are conserved."""

from __future__ import annotations

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.mem_cache.kv_tier import KVTier, make_tier
from pdserve.scheduler.scheduler import Scheduler
from tests.reference import hf_greedy
from tests.scheduler.driver import PAGE, drive, fresh, ids, make_runner, req

POOL_PAGES = 12
TOPICS = ("the sea", "mountains", "bread", "a violin", "copper")


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(POOL_PAGES * PAGE)


def prompt(topic: str) -> list[int]:
    """About 9 pages of tokens (~145), no page shared with another topic's prompt."""
    return ids(f"Notes on {topic}. " + " ".join([f"This line is about {topic}, and only {topic}."] * 13))


def tier_pages_in_tree(sched: Scheduler) -> int:
    return sum(len(node.host_value) for node in sched.ledger.tree._parents_first() if node.in_tier)


def test_a_prefix_evicted_to_the_tier_is_loaded_back_with_hf_greedy_tokens(runner):
    tier_bytes = 48 * runner.kv_pool.page_nbytes
    sched = fresh(runner, role="mixed", kv_tier_memory=tier_bytes)
    tier = sched.ledger.tree.tier
    assert isinstance(tier, KVTier) and tier.num_pages == 48
    prompts = {topic: prompt(topic) for topic in TOPICS}
    assert sum(len(p) for p in prompts.values()) >= 3.5 * POOL_PAGES * PAGE  # the working set: ~4x the pool

    outputs: dict[str, list[list[int]]] = {topic: [] for topic in TOPICS}
    cached: dict[str, list[int]] = {topic: [] for topic in TOPICS}
    for round_ in range(2):
        for topic, ids_ in prompts.items():
            sched.add_request(req(f"{topic}-{round_}", ids_, max_new=2))
            (done,) = drive(sched, overlap=True).values()
            outputs[topic].append(done.output_ids)
            cached[topic].append(done.cached_tokens)
            assert tier.used_pages() == tier_pages_in_tree(sched)
    for topic, ids_ in prompts.items():
        assert cached[topic][0] == 0
        # every whole page of the prompt but the last token's came back from the tier
        assert cached[topic][1] == (len(ids_) - 1) // PAGE * PAGE, topic
        assert outputs[topic][1] == outputs[topic][0], topic
    first = TOPICS[0]
    assert outputs[first][1] == hf_greedy(prompts[first], 2)
    sample = sched.metrics.registry.get_sample_value
    hits = sample("pdserve:kv_tier_hit_tokens_total")
    assert hits >= sum(cached[topic][1] for topic in TOPICS) - POOL_PAGES * PAGE  # most came from the tier
    assert sample("pdserve:kv_tier_load_seconds_count") >= len(TOPICS) - 1
    assert sample("pdserve:kv_tier_pages_total") == 48

    assert sched.flush_cache()
    assert tier.used_pages() == 0 and sched.ledger.free_pages() == sched.usable_pages


def test_the_tier_is_refused_where_it_cannot_work_yet(runner):
    with pytest.raises(ValueError, match="no KV page"):
        make_tier(runner, runner.kv_pool.page_nbytes - 1)
    assert make_tier(runner, 0) is None
    with pytest.raises(ValueError, match="kv_tier_memory"):
        fresh(runner, kv_tier_memory=-1)
