"""Router policies (round_robin, least_load, cache_aware) and the approximate prefix tree; LoRA
adapters: cache_aware keys on the adapter, and among equal workers one holding the adapter wins."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.policies import CacheAwarePolicy
from pdserve.services.gateway.routing.prefix_tree import ApproxPrefixTree
from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

DECODES = ["d0:1", "d1:1", "d2:1"]


def router(policy: str, prefills: list[str] | None = None) -> Router:
    return Router(WorkerPool("decode", DECODES), WorkerPool("prefill", prefills or []), policy)


def test_round_robin_cycles_healthy_workers_and_fails_with_none() -> None:
    r = router("round_robin", ["p0:1", "p1:1"])
    routes = [r.route([1, 2, 3]) for _ in range(6)]
    assert [x.decode.address for x in routes] == DECODES * 2
    assert [x.prefill_address for x in routes] == ["p0:1", "p1:1"] * 3
    assert [x.fallback_prefill_addresses for x in routes[:2]] == [["p1:1"], ["p0:1"]]
    r.decode.workers[1].healthy = False
    assert {r.route([1]).decode.address for _ in range(4)} == {"d0:1", "d2:1"}
    for w in r.decode.workers:
        w.healthy = False
    with pytest.raises(GatewayError) as e:
        r.route([1])
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"


def test_colocated_routes_have_no_prefill() -> None:
    route = router("round_robin").route([5, 6])
    assert route.prefill is None and route.prefill_address == ""


def test_least_load_uses_reported_load_and_local_in_flight() -> None:
    r = router("least_load")
    for w, load in zip(r.decode.workers, [5, 0, 3], strict=True):
        w.reported_load = load
    routes = [r.route([1]) for _ in range(3)]
    # d1 (reported 0) takes requests until its in-flight count reaches d2's reported 3.
    assert [x.decode.address for x in routes] == ["d1:1"] * 3
    assert r.decode.workers[1].load == 3
    tie = r.route([1])
    assert tie.decode.address in {"d1:1", "d2:1"}  # d1 and d2 both at 3: broken round-robin
    routes[0].release()
    routes[0].release()  # idempotent
    assert r.decode.workers[1].in_flight == 2 + (tie.decode.address == "d1:1")


def test_least_load_spreads_equal_workers() -> None:
    r = router("least_load")
    routes = [r.route([1]) for _ in range(3)]
    assert sorted(x.decode.address for x in routes) == DECODES
    for x in routes:
        x.release()
    assert [w.in_flight for w in r.decode.workers] == [0, 0, 0]


def test_cache_aware_keeps_conversations_on_their_worker() -> None:
    """Multi-turn chats share a long prefix with their earlier turns: each stays on one worker."""
    rng = random.Random(0)
    r = router("cache_aware", ["p0:1", "p1:1"])
    systems = {c: [rng.randrange(49152) for _ in range(200)] for c in "abc"}
    history = dict(systems)
    placed: dict[str, set[str]] = {c: set() for c in systems}
    prefill_placed: dict[str, set[str]] = {c: set() for c in systems}
    for _turn in range(5):
        for c in systems:
            history[c] = history[c] + [rng.randrange(49152) for _ in range(20)]
            route = r.route(history[c])
            placed[c].add(route.decode.address)
            prefill_placed[c].add(route.prefill_address)
            route.release()
    assert all(len(v) == 1 for v in placed.values()), placed
    assert all(len(v) == 1 for v in prefill_placed.values()), prefill_placed
    # Distinct conversations went to distinct workers (ties broke by load, not all onto one).
    assert len({next(iter(v)) for v in placed.values()}) == 3


def test_cache_aware_leaves_an_overloaded_worker() -> None:
    policy = CacheAwarePolicy(balance_threshold=4)
    pool = WorkerPool("decode", DECODES)
    prompt = list(range(100))
    home = policy.select(pool.workers, prompt)
    assert policy.select(pool.workers, prompt) is home
    home.reported_load = 10  # more than 4 above the others
    other = policy.select(pool.workers, prompt)
    assert other is not home and other.load == 0


def test_cache_aware_needs_the_match_to_cover_the_threshold() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5)
    workers = WorkerPool("decode", DECODES).workers
    home = policy.select(workers, list(range(10)))
    home.in_flight = 1  # so a fresh prompt prefers another worker
    short_match = list(range(3)) + [99] * 20  # shares 3 of 23 tokens
    assert policy.select(workers, short_match) is not home
    assert policy.select(workers, list(range(10)) + [7]) is home


def test_cache_aware_keys_on_the_adapter() -> None:
    """The same tokens under another adapter (or the base model) match nothing: another worker's KV."""
    policy = CacheAwarePolicy()
    workers = WorkerPool("decode", DECODES).workers
    prompt = list(range(40))
    home = policy.select(workers, prompt, "pirate")
    home.in_flight = 1  # so an unmatched prompt goes elsewhere
    assert policy.select(workers, prompt + [7], "pirate") is home
    assert policy.select(workers, prompt + [7], "poet") is not home
    assert policy.select(workers, prompt + [7]) is not home


@pytest.mark.parametrize("policy", ["least_load", "cache_aware", "kv_aware"])
def test_a_worker_holding_the_adapter_wins_among_equals(policy: str) -> None:
    """Among equally good workers, one that reported the adapter in its LoRA slots (it need not load
    it, evicting another); load comes first. cache_aware without a match is least_load; kv_aware
    here has no index of any worker, so every score is the load's."""
    kv = {role: KVIndexes(BackendClients(), WorkerPool(role, [])) for role in ("decode", "prefill")}
    r = Router(WorkerPool("decode", DECODES), WorkerPool("prefill", []), policy, kv_indexes=kv)
    d0, d1, d2 = r.decode.workers
    d1.lora_resident = frozenset({"pirate"})
    d2.lora_resident = frozenset({"pirate", "poet"})
    chosen = set()
    for i in range(4):
        route = r.route([i] * 40, "pirate")
        chosen.add(route.decode.address)
        route.release()
    assert chosen == {"d1:1", "d2:1"}  # both hold it: in turn, never d0
    route = r.route([9] * 40, "poet")
    assert route.decode is d2
    route.release()
    d2.reported_load = 1  # busier than the idle workers that would load it
    assert r.route([8] * 40, "poet").decode is not d2


def test_unhealthy_worker_is_forgotten_by_cache_aware() -> None:
    r = router("cache_aware")
    route = r.route(list(range(50)))
    r.forget("decode", route.decode)
    assert r._decode_policy.tree.match(list(range(50))) == {}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(
    inserts=st.lists(
        st.tuples(st.sampled_from("xyz"), st.lists(st.integers(0, 3), min_size=1, max_size=12)), max_size=25
    ),
    query=st.lists(st.integers(0, 3), max_size=14),
)
def test_prefix_tree_match_equals_brute_force(inserts, query) -> None:
    tree = ApproxPrefixTree(max_tokens_per_tenant=10**6)
    for tenant, ids in inserts:
        tree.insert(ids, tenant)
    expected = {}
    for tenant, ids in inserts:
        n = _common(ids, query)
        if n:
            expected[tenant] = max(expected.get(tenant, 0), n)
    assert tree.match(query) == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=40))
def test_prefix_tree_eviction_bounds_each_tenant_and_keeps_the_newest(seqs) -> None:
    bound = 40
    tree = ApproxPrefixTree(max_tokens_per_tenant=bound)
    for ids in seqs:
        tree.insert(ids, "w")
        assert tree.tenant_tokens["w"] <= max(bound, len(ids))
        # The prompt just inserted is the most recent: never evicted by its own insert.
        assert tree.match(ids)["w"] == len(ids)
    # What the tree counts equals the tokens stored on nodes tagged with the tenant.
    stack, stored = [tree.root], 0
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        stored += len(node.key) if "w" in node.tenants else 0
    assert stored == tree.tenant_tokens["w"]
