"""Sliding-window-aware KV memory (``--swa-full-tokens-ratio``, ``pdserve.mem_cache.swa_pool``) on
tiny random Gemma 3 (5 local : 1 global shaped as 2 local : 1 global) and Mistral (every layer
local) checkpoints (``tests.families``, window 12, pages of 4 tokens), through the scheduler with
overlap and chunked prefill: greedy tokens equal HF transformers fp32 while the local layers' pages
behind each window are given back, a long sequence holds about window / length of its full pages in
the local pool, and both pools are conserved after every step."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.mem_cache.swa_pool import SWAKVPool
from tests.families import WINDOW, hf_greedy, hf_model, make_checkpoint
from tests.scheduler.driver import drive, fresh, req

PAGE = 4
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    return [ids[:3], ids[3:43], ids[43:153]]  # the last: 110 tokens, ~9 windows of 12


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request, tmp_path_factory, prompts) -> tuple[str, ModelRunner, list[list[int]]]:
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = hf_model(path)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf
    torch.set_num_threads(2)
    runner = ModelRunner(
        path,
        dtype="float32",
        page_size=PAGE,
        max_total_tokens=2048,
        max_running_requests=4,
        swa_full_tokens_ratio=0.25,
    )
    yield request.param, runner, expected
    del runner


def test_greedy_equals_hf_while_windows_slide(family, prompts):
    """Three requests at once, the long prompt in chunks of 16 beside the others' decodes, the
    overlapped loop: HF's tokens, and local pages given back while the requests run."""
    name, runner, expected = family
    assert isinstance(runner.kv_pool, SWAKVPool)
    sched = fresh(runner, chunked_prefill_size=16)
    assert sched.ledger.tree.disable  # no radix cache over an SWA pool (yet)
    peak = []
    reqs = [req(f"r{i}", p, max_new=NEW_TOKENS) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    done = drive(
        sched,
        overlap=True,
        on_step=lambda n, s: peak.append((s.ledger.swa_used_pages(), s.ledger.used_pages())),
    )
    assert [done[r.rid].output_ids for r in reqs] == expected, name
    assert max(full - swa for swa, full in peak) > 0  # local pages went back while they ran
    assert sched.ledger.swa_used_pages() == 0


def test_a_long_sequence_holds_about_a_window_of_local_pages(family, prompts):
    """One request of 110 + 30 tokens: once its window has slid, it holds ~(window + a page) / page
    local pages, against ~length / page full pages (what a pool without windows holds in every
    layer); counted from the map of full to local pages after every step."""
    name, runner, expected = family
    sched = fresh(runner, chunked_prefill_size=16)
    long = req("long", prompts[-1], max_new=NEW_TOKENS)
    sched.add_request(long)
    held: list[tuple[int, int]] = []  # (local, full) pages in use before each step
    done = drive(sched, on_step=lambda n, s: held.append((s.ledger.swa_used_pages(), s.ledger.used_pages())))
    assert done["long"].output_ids == expected[-1], name
    assert held[-1] == (0, 0)  # after the request finished
    length = len(prompts[-1]) + NEW_TOKENS - 1  # the tokens with KV before the last step
    assert held[-2][1] == math.ceil(length / PAGE)
    prompt_pages = math.ceil(len(prompts[-1]) / PAGE)
    assert held[1] == (prompt_pages - 1, prompt_pages)  # the first chunk ran: one page behind
    decoding = [swa for swa, full in held if full > prompt_pages]
    assert len(decoding) > 20
    assert max(decoding) <= math.ceil(WINDOW / PAGE) + 1  # the window's pages and a partial one
    assert held[-2][0] / held[-2][1] <= (WINDOW + PAGE) / length
