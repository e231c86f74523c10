"""Sliding-window-aware KV memory (``--swa-full-tokens-ratio``, ``pdserve.mem_cache.swa_pool``) on
tiny random Gemma 3 (local layers interleaved with a global one) and Mistral (every layer local)
checkpoints (``tests.families``: window 12, pages of 4 tokens), through the scheduler with overlap
and chunked prefill: greedy tokens equal HF transformers fp32 while the local layers' pages behind
each window are given back, radix-cache hits past the window (and after the local pool evicted
cached local pages) give the same tokens, a long sequence holds about window / length of its full
pages in the local pool, two tensor-parallel ranks (Gemma 3's two KV heads split, Mistral's one
replicated) give the same tokens, and both pools are conserved after every step."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.distributed import TpGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator
from pdserve.mem_cache.swa_pool import SWAKVPool, SWAPageMap, swa_layer_weight
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.speculative.ngram import NgramProposer
from tests.engine.test_tensor_parallel import run_ranks
from tests.families import WINDOW, hf_greedy, hf_model, make_checkpoint
from tests.scheduler.driver import drive, fresh, req

PAGE = 4
NEW_TOKENS = 30
IDS = torch.randint(0, 300, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
PROMPTS = [IDS[:3], IDS[3:43], IDS[43:153]]  # the last: 110 tokens, ~9 windows of 12


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    torch.set_num_threads(2)
    runner = ModelRunner(
        path,
        dtype="float32",
        page_size=PAGE,
        max_total_tokens=2048,
        max_running_requests=4,
        swa_full_tokens_ratio=0.25,
    )
    assert isinstance(runner.kv_pool, SWAKVPool)
    yield request.param, runner, hf_model(path)
    del runner


def served(runner: ModelRunner, prompts: list[list[int]], **config) -> list:
    """The finished requests of ``prompts``, all submitted at once, overlapped, prompts in chunks of 16."""
    sched = fresh(runner, chunked_prefill_size=16, **config)
    reqs = [req(f"r{i}", p, max_new=NEW_TOKENS) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    done = drive(sched, overlap=True)
    return [done[r.rid] for r in reqs], sched


def test_greedy_equals_hf_while_windows_slide(family):
    """On the C attention kernel (every token a row), then on the gather + SDPA path (masked
    windows: it reads the null page behind them)."""
    name, runner, hf = family
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    done, sched = served(runner, PROMPTS)
    assert [r.output_ids for r in done] == expected, name
    assert sched.ledger.swa_used_pages() == 0
    kernel_backend = runner.attn_backend
    runner.attn_backend = TorchNativeAttnBackend(runner, use_cpu_kernels=False)
    try:
        assert [r.output_ids for r in served(runner, PROMPTS)[0]] == expected, name
    finally:
        runner.attn_backend = kernel_backend


def test_speculative_decoding_over_an_swa_pool(family):
    """n-gram drafts on a repetitive prompt, verified every step: rejected drafts are cut before the
    window slides (``KVLedger.truncate`` then ``slide_windows``), and the tokens are HF's."""
    name, runner, hf = family
    prompt = IDS[:20] * 4
    sched = Scheduler(runner, SchedulerConfig(speculative_policy="always"), proposer=NgramProposer())
    sched.add_request(req("spec", prompt, max_new=NEW_TOKENS))
    assert drive(sched, overlap=True)["spec"].output_ids == hf_greedy(hf, prompt, NEW_TOKENS), name
    assert sched.metrics.registry.get_sample_value("pdserve:spec_decode_num_draft_tokens_total") > 0
    sched.ledger.tree.reset()


def test_radix_hits_past_the_window(family):
    """The long prompt, then a pool's worth of other prompts (the local pool evicts cached local
    pages, least recently read first: the long prompt's), then the long prompt twice and its first
    50 tokens with another ending: the first backs off to where its window is whole and recomputes
    the rest (which makes the cache's pages whole again), the others hit far past the window (their
    local layers read cached local pages before the match end). HF's tokens every time."""
    name, runner, hf = family
    long, branch = PROMPTS[2] + [7, 8, 9], PROMPTS[2][:50] + [5, 6, 7, 8]
    expected = hf_greedy(hf, long, NEW_TOKENS)
    sched = fresh(runner, chunked_prefill_size=16)

    def serve(*prompts: list[int], max_new: int = NEW_TOKENS) -> list:
        reqs = [req(f"r{len(prompt)}-{i}", prompt, max_new=max_new) for i, prompt in enumerate(prompts)]
        for r in reqs:
            sched.add_request(r)
        done = drive(sched, overlap=True)
        return [done[r.rid] for r in reqs]

    assert serve(long)[0].output_ids == expected
    serve(*(IDS[200 + 110 * i : 310 + 110 * i] for i in range(5)), max_new=2)  # 5 x 28 pages > 128 local
    assert sched.ledger.swa.held_pages() < sched.ledger.cached_pages()  # cached pages lost local pages
    backed_off, hit = serve(long)[0], serve(long)[0]
    assert backed_off.output_ids == hit.output_ids == expected, name
    assert backed_off.cached_tokens < hit.cached_tokens == (len(long) - 1) // PAGE * PAGE
    other = serve(branch)[0]
    assert other.output_ids == hf_greedy(hf, branch, NEW_TOKENS), name
    assert other.cached_tokens == 48  # the 12 whole pages of its 53-token key, windows intact


def test_a_long_sequence_holds_about_a_window_of_local_pages(family):
    """One request of 110 + 30 tokens (without a radix cache, which would keep its prompt's local
    pages, evictable, as it keeps the full ones): once its window has slid, its local pages are
    the window's and a partial one, against ~length / page full pages (what a pool without windows
    holds in every layer), counted from the full -> local page map before every step."""
    name, runner, hf = family
    sched = fresh(runner, chunked_prefill_size=16, disable_radix_cache=True)
    sched.add_request(req("long", PROMPTS[2], max_new=NEW_TOKENS))
    metrics = SchedulerMetrics("mixed")
    metrics.watch_local_pages(runner.swa_pages)
    held: list[tuple[int, int]] = []  # (local, full) pages held before each step

    def on_step(n, s) -> None:
        held.append((s.ledger.swa.held_pages(), s.ledger.used_pages()))
        assert metrics.registry.get_sample_value("pdserve:swa_pages_used") == held[-1][0]

    done = drive(sched, on_step=on_step)
    assert done["long"].output_ids == hf_greedy(hf, PROMPTS[2], NEW_TOKENS), name
    assert held[-1] == (0, 0)  # after the request finished
    length = len(PROMPTS[2]) + NEW_TOKENS - 1  # the tokens with KV before the last step
    assert held[-2][1] == math.ceil(length / PAGE)
    prompt_pages = math.ceil(len(PROMPTS[2]) / PAGE)
    assert held[1] == (prompt_pages - 1, prompt_pages)  # the first chunk ran: one page behind
    decoding = [swa for swa, full in held if full > prompt_pages]
    assert len(decoding) > 20
    assert max(decoding) <= math.ceil(WINDOW / PAGE) + 1  # the window's pages and a partial one
    assert held[-2][0] / held[-2][1] <= (WINDOW + PAGE) / length
    assert metrics.registry.get_sample_value("pdserve:swa_pages_total") == 128  # 512 x 0.25


def pages_held(sched: Scheduler) -> tuple[int, int]:
    return sched.ledger.swa.held_pages(), sched.ledger.used_pages()


def served_on_rank(tp: TpGroup, root, names: list[str]) -> dict:
    """Each family's ``PROMPTS`` through a scheduler on this rank's shard (every rank schedules the
    same; rank 0 samples): tokens, this rank's KV heads, and the most local pages held at once."""
    out = {}
    for name in names:
        runner = ModelRunner(
            root / name, dtype="float32", page_size=PAGE, max_total_tokens=2048, max_running_requests=4,
            swa_full_tokens_ratio=0.25, tp=tp,
        )  # fmt: skip
        config = SchedulerConfig(chunked_prefill_size=16, disable_radix_cache=True)
        sched = Scheduler(TpModelWorker(runner), config)
        reqs = [req(f"r{i}", p, max_new=NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        for r in reqs:
            sched.add_request(r)
        held: list[tuple[int, int]] = []  # (local, full) pages held before each step
        done = drive(sched, overlap=True, on_step=lambda n, s, held=held: held.append(pages_held(s)))
        out[name] = {
            "tokens": [done[r.rid].output_ids for r in reqs],
            "kv_heads": (runner.kv_pool.full.num_kv_heads, runner.kv_pool.swa.num_kv_heads),
            "pages": (runner.token_to_kv_pool_allocator.num_pages, runner.swa_pages.num_pages),
            "local_free": runner.swa_pages.available_size(),
            "last_step_held": held[-2],
        }
    return out


def test_two_tensor_parallel_ranks(tmp_path):
    """TP=2 over both page spaces: Gemma 3's two KV heads one a rank, Mistral's one on both; every
    rank's pools alike, conserved after every step and whole at the end, HF's tokens while the long
    prompt's windows slide, and at its last step a window's local pages against its every full page."""
    names = ["gemma3", "mistral"]
    for name in names:
        make_checkpoint(name, tmp_path / name)
    ranks = run_ranks(2, served_on_rank, (tmp_path, names), tmp_path)
    assert ranks[0] == ranks[1]
    for name in names:
        got = ranks[0][name]
        hf = hf_model(tmp_path / name)
        assert got["tokens"] == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS], name
        assert got["kv_heads"] == (1, 1), name
        assert got["pages"] == (512, 128) and got["local_free"] == 128, name
        local, full = got["last_step_held"]  # the long request's last step (its windows slid)
        assert local <= math.ceil(WINDOW / PAGE) + 1 and full == math.ceil(
            (len(PROMPTS[2]) + NEW_TOKENS - 1) / PAGE
        )


def test_the_ratio_is_checked():
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        swa_layer_weight([4, 0], 1.5)
    assert swa_layer_weight([4, 4, 0], 0.25) == 1.5


def test_a_match_backs_off_to_the_last_whole_window():
    """``whole_prefix``: a match may end at position ``p`` only where the pages of ``(p - window, p)``
    still have local pages (window 8, pages of 4: full pages 3-7 hold positions 0-19)."""
    pool = SWAKVPool(16, 8, [8, 0], 4, 1, 2, torch.float32)
    pages = SWAPageMap(pool, PagedTokenToKVPoolAllocator(16, 4))
    match = [3, 4, 5, 6, 7]
    assert pages.map(match)
    assert pages.whole_prefix(match) == 5
    pages.unmap([6])  # positions 12-15: read from 16 and 20 on, not from 12 (positions 5-11)
    assert pages.whole_prefix(match) == 3
    assert pool.full_to_swa[6].item() == pool.null_page == 8
    pages.unmap([4])  # positions 4-7: read from 8 and 12 on, not from 4 (positions 0-3)
    assert pages.whole_prefix(match) == 1
    pages.unmap([3])
    assert pages.whole_prefix(match) == 0
    assert pages.available_size() == 8 - 2


def test_a_pd_decode_worker_maps_only_the_last_window(family):
    """A PD decode worker's prompt KV arrives whole from a prefill worker: of its full pages only
    those the first decode step's window reads get local pages (``arriving_local_pages``, where the
    prefill worker writes them); the others never do. An abort gives every page back."""
    name, runner, hf = family
    sched = fresh(runner, role="decode")
    pd = req("pd", PROMPTS[2], max_new=NEW_TOKENS)
    sched.add_request(pd)
    assert sched.schedule() is None and sched.prefill.pop_requests() == [pd]
    pages, behind = math.ceil(len(PROMPTS[2]) / PAGE), (len(PROMPTS[2]) + 1 - WINDOW) // PAGE
    local = sched.ledger.arriving_local_pages(pd)
    assert len(pd.pages) == pages and len(local) == pages - behind == sched.ledger.swa.held_pages(), name
    assert sched.ledger.swa.local_pages(pd.pages[behind:]) == local
    with pytest.raises(ValueError, match="hold no local KV page"):
        sched.ledger.swa.local_pages(pd.pages[behind - 1 :])
    assert sched.abort_request("pd")
    sched.ledger.check_conservation(sched.usable_pages)
    assert sched.ledger.swa.held_pages() == 0 and sched.ledger.free_pages() == sched.usable_pages
