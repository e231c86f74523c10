"""The CUDA path, on a GPU machine (``make test-cuda``; ``make test`` leaves this folder out, CI
machines have no GPU): FlashInfer's paged attention against float64 attention, and the engine on
CUDA against HF transformers on the same GPU, and decode replayed from CUDA graphs against eager
decode, on random-weight Llama checkpoints shaped like SmolLM2 (head_dim 64, 9 query / 3 KV heads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.radix_attention import RadixAttention
from pdserve.mem_cache.memory_pool import KVPool, ReqToTokenPool, slots_for_pages
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.attention_reference import assert_matches, row_reference
from tests.engine.driver import Driver

CUDA = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=HEADS * HEAD_DIM,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
    initializer_range=0.1,  # peaked logits: greedy choices far from ties
    eos_token_id=None,
)
# (cached prefix, new tokens) per request
DECODES = ((57, 1), (200, 1), (0, 1), (1000, 1), (15, 1))
MIXED = ((57, 1), (200, 31), (0, 40), (130, 1), (16, 17), (1000, 33), (0, 1))
PROMPT_LENS = (1, 7, 16, 17, 100, 255, 600, 33)
NEW_TOKENS = 16


@pytest.fixture(autouse=True, scope="module")
def gpu():
    assert torch.cuda.is_available(), "tests/cuda need a CUDA GPU (run them with make test-cuda on one)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-random")
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).save_pretrained(path)
    return path


def _attention_runner(page_size: int, num_pages: int, layer: RadixAttention) -> SimpleNamespace:
    config = SimpleNamespace(
        dtype=torch.bfloat16,
        num_local_heads=HEADS,
        num_local_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        context_length=2048,
    )
    return SimpleNamespace(
        device=CUDA,
        model_config=config,
        kv_pool=KVPool(num_pages, page_size, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, CUDA),
        req_to_token_pool=ReqToTokenPool(8, 2048, CUDA),
        model=torch.nn.Sequential(layer),  # the backend plans each of its layers' kinds
    )


@pytest.mark.parametrize("requests", [DECODES, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("window", [0, 20])
def test_flashinfer_paged_attention_matches_float64(requests, page_size, window):
    """One layer through FlashInferAttnBackend (decode wrapper for an all-decode batch, prefill
    wrapper for extends with cached prefixes), full or sliding-window (``window_left``), pages
    scattered over the pool, against float64 attention, within bfloat16 rounding of the output and
    of the attention weights."""
    from pdserve.layers.attention.flashinfer_backend import AttentionKind, FlashInferAttnBackend

    gen = torch.Generator().manual_seed(0)
    pages_per = [-(-(p + n) // page_size) for p, n in requests]
    layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, 0, sliding_window=window)
    runner = _attention_runner(page_size, sum(pages_per) + 3, layer)
    backend = runner.attn_backend = FlashInferAttnBackend(runner)
    runner.kv_pool.kv_data.copy_(torch.randn(runner.kv_pool.kv_data.shape, generator=gen))
    order = torch.randperm(sum(pages_per) + 3, generator=gen).tolist()
    page_table = torch.zeros(len(requests), max(pages_per), dtype=torch.int64)
    for slot, count in enumerate(pages_per):
        pages, order = order[:count], order[count:]
        page_table[slot, :count] = torch.tensor(pages)
        runner.req_to_token_pool.req_to_token[slot, : count * page_size] = slots_for_pages(
            pages, 0, count * page_size, page_size
        )
    fb = ForwardBatch.init_new(
        input_ids=[0] * sum(n for _, n in requests),
        req_pool_indices=list(range(len(requests))),
        seq_lens=[p + n for p, n in requests],
        extend_prefix_lens=[p for p, _ in requests],
        runner=runner,
    )
    assert fb.forward_mode is (ForwardMode.DECODE if requests is DECODES else ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    kind = AttentionKind.of(layer)
    planned = backend.decode_wrappers if requests is DECODES else backend.prefill_wrappers
    assert backend.wrappers == {kind: planned[kind]}
    tokens = fb.input_ids.shape[0]
    q, k, v = (
        torch.randn(tokens, heads * HEAD_DIM, generator=gen).bfloat16().to(CUDA)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    out = backend.forward(q, k, v, layer, fb).view(tokens, HEADS, HEAD_DIM).cpu()
    k_pages, v_pages = (pages.cpu() for pages in runner.kv_pool.kv_pages(0))
    expected = row_reference(
        q.view(tokens, HEADS, HEAD_DIM).cpu(),
        k_pages,
        v_pages,
        page_table,
        fb.extend_prefix_lens.cpu(),
        fb.extend_seq_lens.cpu(),
        fb.extend_start_loc.cpu(),
        HEAD_DIM**-0.5,
        window,
    )
    assert sorted(expected) == list(range(tokens))
    for row in range(tokens):
        assert_matches(out[row], expected[row])


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run_engine(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams) -> list:
    """Extend every prompt (the longest in two chunks, its second chunk beside the others' first
    decode), then decode all of them together to ``NEW_TOKENS`` each."""
    driver = Driver(runner)
    seqs = [driver.add(p, params) for p in prompts]
    longest = max(seqs, key=lambda s: len(s.prompt))
    driver.step([(s, len(s.prompt) // 2 if s is longest else None) for s in seqs])
    while any(len(s.output_ids) < NEW_TOKENS for s in seqs):
        driver.step([(s, None) for s in seqs if len(s.output_ids) < NEW_TOKENS])
    driver.release(*seqs)
    assert runner.token_to_kv_pool_allocator.available_size() == runner.token_to_kv_pool_allocator.num_pages
    return seqs


def test_engine_on_cuda_float32_matches_hf_greedy(checkpoint):
    """torch_native attention on CUDA in float32: HF's greedy tokens, token for token."""
    runner = ModelRunner(
        checkpoint, dtype="float32", attention_backend="torch_native", device="cuda", max_total_tokens=8192
    )
    assert runner.cuda_graph_runner is None  # torch_native captures no graphs
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(CUDA).eval()
    prompts = _prompts()
    seqs = _run_engine(runner, prompts, SamplingParams(temperature=0.0))
    for prompt, seq in zip(prompts, seqs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device=CUDA),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        assert seq.output_ids == ref[0, len(prompt) :].tolist()


def hf_logprobs(model, seqs) -> list[torch.Tensor]:
    """Each sequence's generated tokens' logprobs under ``model``, teacher-forced (float32 log_softmax)."""
    out = []
    for seq in seqs:
        ids = torch.tensor([seq.prompt + seq.output_ids], device=CUDA)
        with torch.no_grad():
            logits = model(ids).logits[0, len(seq.prompt) - 1 : -1].float()
        chosen = torch.tensor(seq.output_ids, device=CUDA)[:, None]
        out.append(torch.log_softmax(logits, -1).gather(1, chosen).squeeze(1).cpu())
    return out


def test_engine_bfloat16_with_flashinfer_is_as_close_to_float32_as_hf_bfloat16(checkpoint):
    """bfloat16 has no exact reference: the engine's chosen-token logprobs (``auto`` backend, which
    is FlashInfer on CUDA; chunked and mixed extends, then decodes) are compared with HF float32 on
    the same tokens, and must be about as close as HF's own bfloat16 forward is."""
    from pdserve.layers.attention.flashinfer_backend import FlashInferAttnBackend

    runner = ModelRunner(checkpoint, dtype="auto", device="auto", max_total_tokens=8192)
    assert runner.model_config.dtype is torch.bfloat16 and runner.device.type == "cuda"
    assert isinstance(runner.attn_backend, FlashInferAttnBackend)
    seqs = _run_engine(runner, _prompts(), SamplingParams(temperature=0.0, return_logprob=True))
    ours = [torch.tensor(s.logprobs) for s in seqs]
    fp32, bf16 = (
        hf_logprobs(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(CUDA).eval(), seqs)
        for dtype in (torch.float32, torch.bfloat16)
    )
    ours_error = max(float((a - b).abs().max()) for a, b in zip(ours, fp32, strict=True))
    hf_error = max(float((a - b).abs().max()) for a, b in zip(bf16, fp32, strict=True))
    print(f"max |logprob - HF fp32|: engine bf16 + FlashInfer {ours_error:.4f}, HF bf16 {hf_error:.4f}")
    assert ours_error <= 2 * hf_error + 1e-2


def test_cuda_graph_decode_matches_eager(checkpoint):
    """Decode batches of 8 and then 5 requests (padded to the captured 8) replayed from CUDA graphs
    give the eager FlashInfer forward's tokens, and logprobs within bfloat16 noise; padded rows
    write only the pool's padding page, which the allocator never hands out."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, return_logprob=True)
    runs = {}
    for graphs in (True, False):
        runner = ModelRunner(
            checkpoint, dtype="bfloat16", device="cuda", max_total_tokens=8192, disable_cuda_graph=not graphs
        )
        assert (runner.cuda_graph_runner is not None) == graphs
        assert runner.kv_pool.num_pages == runner.token_to_kv_pool_allocator.num_pages + graphs
        driver = Driver(runner)
        seqs = [driver.add(p, params) for p in prompts]
        driver.step([(s, None) for s in seqs])
        for step in range(2 * NEW_TOKENS):
            driver.step([(s, None) for s in (seqs if step < NEW_TOKENS else seqs[:5])])
        driver.release(*seqs)
        assert all(len(s.output_ids) == 1 + NEW_TOKENS + (s in seqs[:5]) * NEW_TOKENS for s in seqs)
        runs[graphs] = seqs
    for replayed, eager in zip(runs[True], runs[False], strict=True):
        assert replayed.output_ids == eager.output_ids
        torch.testing.assert_close(
            torch.tensor(replayed.logprobs), torch.tensor(eager.logprobs), atol=0.05, rtol=0
        )


@pytest.mark.parametrize(("dtype", "backend"), [("float32", "torch_native"), ("bfloat16", "auto")])
def test_speculative_verify_on_cuda_gives_plain_greedy_tokens(checkpoint, dtype, backend):
    """The target as its own draft on the GPU: verify steps (SDPA on torch_native, FlashInfer's prefill
    wrapper under ``auto``; decode steps replayed from CUDA graphs there) keep drafts and give the
    tokens plain greedy decoding gives, with every page of both pools back at the end."""
    from pdserve.speculative.draft_model import DraftModelProposer

    args = dict(dtype=dtype, attention_backend=backend, device="cuda", max_total_tokens=8192)
    runner = ModelRunner(checkpoint, **args)
    proposer = DraftModelProposer.load(checkpoint, checkpoint, **args)
    prompts = _prompts()
    plain = _run_engine(runner, prompts, SamplingParams(temperature=0.0))
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    driver.step([(s, None) for s in seqs])
    accepted = 0
    while min(len(s.output_ids) for s in seqs) < NEW_TOKENS:
        accepted += sum(a.num_accepted_drafts for a in driver.speculate(seqs, proposer, 3))
    driver.release(*seqs)
    for seq in seqs:
        proposer.release(seq.rid)
    assert [s.output_ids[:NEW_TOKENS] for s in seqs] == [s.output_ids for s in plain]
    assert accepted >= 4 * len(seqs)  # drafts of the same model stand
    for pool in (runner.token_to_kv_pool_allocator, proposer.runner.token_to_kv_pool_allocator):
        assert pool.available_size() == pool.num_pages
