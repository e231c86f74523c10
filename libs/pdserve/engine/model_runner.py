"""``ModelRunner``: owns the weights, the KV pools, the attention backend and the sampler of one
scheduler (of one TP rank of it), and runs one ``ForwardBatch`` into next tokens (SGLang's
``model_runner.py``)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.engine.cuda_graph_runner import CudaGraphRunner
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.layers.attention import create_attention_backend
from pdserve.layers.quantization import resolve_quantization
from pdserve.layers.radix_attention import layer_windows
from pdserve.lora.limits import DEFAULT_MAX_LOADED_LORAS
from pdserve.lora.manager import LoraManager
from pdserve.mem_cache.memory_pool import (
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    num_pages_for_budget,
)
from pdserve.mem_cache.swa_pool import make_swa_pool, swa_layer_weight
from pdserve.models.loader import load_model
from pdserve.sampling.sampler import GenerationBatchResult, Sampler

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV pool's dtype for ``--kv-cache-dtype``: ``auto`` is the model's; ``bfloat16`` also under
    a float32 model on CPU (attention then runs in bfloat16: queries rounded to it).

    Raises:
        ValueError: any other choice (another dtype than the model's on CUDA, or float32 KV under a
            bfloat16 model).
    """
    if kv_cache_dtype in ("auto", str(model_dtype).removeprefix("torch.")):
        return model_dtype
    if kv_cache_dtype == "bfloat16" and model_dtype == torch.float32 and device.type == "cpu":
        return torch.bfloat16
    raise ValueError(
        f"--kv-cache-dtype {kv_cache_dtype} with a {str(model_dtype).removeprefix('torch.')} model on "
        f"{device.type}: choose auto (the model's dtype), or bfloat16 under a float32 model on CPU"
    )


class ModelRunner:
    """One model replica (or one TP rank's shard of it) with its KV memory.

    Args:
        model_path: Hugging Face-style checkpoint directory (config.json, *.safetensors).
        dtype: ``auto`` (bfloat16 where native, else float32), ``float32``, ``bfloat16`` or ``float16``.
        attention_backend: ``auto``, ``torch_native`` or ``flashinfer``.
        page_size: tokens per KV page.
        max_total_tokens: KV pool size in tokens; else ``kv_cache_memory`` bytes; else
            ``kv_memory_fraction`` of the device's free memory, at most what
            ``max_running_requests`` full-context requests need.
        max_running_requests: request slots of ``req_to_token``.
        device: ``cpu``, ``cuda[:i]`` or ``auto`` (CUDA when there is a GPU).
        quantization: None, ``auto`` (``w4a8`` on CPUs for the ``auto`` dtype: ``resolve_quantization``)
            or a method of ``pdserve.layers.quantization.METHODS``.
        disable_cuda_graph: on CUDA, run decode batches eagerly instead of replaying CUDA graphs
            (``CudaGraphRunner``, captured up to ``max_running_requests`` when the attention
            backend supports it; the KV pool then has one extra page for padded rows).
        max_model_len: serve at most this many tokens per request (``--max-model-len``); default
            the model's context.
        kv_cache_dtype: the KV pool's dtype (``--kv-cache-dtype``): ``auto`` (the model's), or
            ``bfloat16`` under a float32 model on CPU (half the KV bytes to store and read; the
            C kernels then attend as in a bfloat16 model: queries rounded to bfloat16, float32
            sums, the output widened back).
        expert_parallel: under TP, a mixture-of-experts model's ranks hold whole experts
            (``--enable-expert-parallel``; ``pdserve.distributed.expert_parallel``).
        swa_full_tokens_ratio: for a model with sliding-window layers, keep their KV in a pool of
            its own of this many tokens per full-pool token, freed as windows slide
            (``pdserve.mem_cache.swa_pool``; ``--swa-full-tokens-ratio``); None: every layer in
            one pool. Ignored for a model without sliding-window layers.
        max_loras: LoRA adapter slots (``--max-loras``; ``pdserve.lora.manager``); 0: no adapters.
        max_lora_rank: the largest adapter rank accepted (``--max-lora-rank``).
        max_loaded_loras: adapters held in host memory at once (``--max-loaded-loras``).

    Raises:
        ValueError: a ``kv_cache_dtype`` other than the model's outside that case; an SWA pool on
            CUDA (not supported yet); ``max_loaded_loras`` outside ``[max_loras, 1024]``.

    Attributes:
        model_config, model, req_to_token_pool, token_to_kv_pool_allocator, kv_pool, attn_backend,
        device, cuda_graph_runner (None when decode runs eagerly), swa_pages (``SWAPageMap`` of
        the SWA pool, None without one), lora_manager (None without ``max_loras``).
    """

    def __init__(
        self,
        model_path: Path,
        dtype: str = "auto",
        attention_backend: str = "auto",
        page_size: int = 16,
        max_total_tokens: int | None = None,
        kv_cache_memory: int | None = None,
        max_running_requests: int = 64,
        device: str = "cpu",
        quantization: str | None = None,
        disable_cuda_graph: bool = False,
        kv_memory_fraction: float = 0.25,
        max_model_len: int | None = None,
        tp: TpGroup = SINGLE_RANK,
        kv_cache_dtype: str = "auto",
        expert_parallel: bool = False,
        swa_full_tokens_ratio: float | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_loaded_loras: int = DEFAULT_MAX_LOADED_LORAS,
    ):
        self.device = resolve_device(device)
        self.tp = tp
        self.model_config = cfg = ModelConfig.from_pretrained(
            Path(model_path), dtype, self.device, max_model_len, tp.size, tp.rank
        )
        quantization = resolve_quantization(quantization, self.device, cfg.dtype, tp.size, dtype != "auto")
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, cfg.dtype, self.device)
        self.model = load_model(
            model_path,
            cfg.hf_config,
            cfg.architecture,
            cfg.context_length,
            cfg.dtype,
            self.device,
            quantization,
            tp,
            expert_parallel,
        )
        self.lora_manager = (
            LoraManager(self.model, max_loras, max_lora_rank, max_loaded_loras) if max_loras else None
        )
        windows = layer_windows(self.model)
        swa = swa_full_tokens_ratio is not None and any(windows)
        if swa and self.device.type != "cpu":
            raise ValueError("--swa-full-tokens-ratio: the sliding-window KV pool runs on CPU only so far")
        layers = swa_layer_weight(windows, swa_full_tokens_ratio) if swa else cfg.num_layers
        bytes_per_token = math.ceil(
            KVPool.bytes_per_token(1, cfg.num_local_kv_heads, cfg.head_dim, kv_dtype) * layers
        )
        if max_total_tokens is None and kv_cache_memory is None:
            kv_cache_memory = min(
                int(_free_memory(self.device) * kv_memory_fraction),
                max_running_requests * cfg.context_length * bytes_per_token,
            )
        num_pages = num_pages_for_budget(page_size, bytes_per_token, max_total_tokens, kv_cache_memory)
        num_pages = tp.min_int(num_pages)  # every rank schedules the same pages: the smallest pool
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, cfg.context_length, self.device)
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(num_pages, page_size)
        want_graphs = self.device.type == "cuda" and not disable_cuda_graph
        self.swa_pages = None
        try:
            if swa:
                self.kv_pool, self.swa_pages = make_swa_pool(
                    self.token_to_kv_pool_allocator, windows, swa_full_tokens_ratio, cfg.context_length,
                    cfg.num_local_kv_heads, cfg.head_dim, kv_dtype, self.device,
                )  # fmt: skip
            else:
                self.kv_pool = KVPool(
                    num_pages + want_graphs,  # the last page: padded rows of graph replays
                    page_size,
                    cfg.num_layers,
                    cfg.num_local_kv_heads,
                    cfg.head_dim,
                    kv_dtype,
                    self.device,
                )
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            gib = num_pages * page_size * bytes_per_token / 2**30
            raise RuntimeError(
                f"cannot allocate a KV pool of {num_pages} pages of {page_size} tokens ({gib:.2f} GiB) on "
                f"{self.device}: {e}. A restarted worker keeps the pool size of its first start: free "
                "that memory, or give a smaller --max-total-tokens / --kv-cache-memory"
            ) from e
        self.attn_backend = create_attention_backend(attention_backend, self)
        self.cuda_graph_runner = None
        if want_graphs and self.attn_backend.supports_cuda_graph:
            self.cuda_graph_runner = CudaGraphRunner(self, max_running_requests, pad_page=num_pages)
        elif want_graphs:
            logger.info("%s captures no CUDA graphs: decode runs eagerly", type(self.attn_backend).__name__)
        self.sampler = Sampler()
        logger.info(
            "loaded %s (%s, %s, quantization %s, TP rank %d of %d) on %s: %d KV pages of %d tokens"
            " (%.1f MiB, %s), backend %s",
            cfg.architecture,
            model_path,
            cfg.dtype,
            quantization or "none",
            tp.rank,
            tp.size,
            self.device,
            num_pages,
            page_size,
            self.kv_pool.nbytes / 2**20,
            str(kv_dtype).removeprefix("torch."),
            type(self.attn_backend).__name__,
        )

    @torch.inference_mode()
    def forward_batch_generation(self, forward_batch: ForwardBatch) -> GenerationBatchResult:
        """Run the batch, write its KV, and sample one next token per request from the logits of
        each request's last computed position; where requests embed (``fb.pooling``), their chunk's
        pooled hidden states beside (``GenerationBatchResult.pooled``)."""
        logits, pooled = self.forward_pooled_logits(forward_batch)
        result = self.sample(forward_batch, logits)
        result.pooled = pooled
        return result

    @torch.inference_mode()
    def forward_pooled_logits(
        self, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        """``forward_logits``, and where requests embed (``fb.pooling``) what each one's chunk pools
        (``PoolingRows.compute``: float32 ``[hidden]`` per request, None for the others); None
        when none does."""
        fb = forward_batch
        if fb.pooling is None:
            return self.forward_logits(fb), None
        hidden = self._hidden_states(fb)  # an extend: never a CUDA graph replay
        pooled = fb.pooling.compute(hidden, fb.extend_start_loc, fb.extend_seq_lens)
        return self.model.compute_logits(hidden[fb.logits_index]), pooled

    @torch.inference_mode()
    def forward_logits(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run the batch and write its KV; logits ``[N, vocab]`` (model dtype) of its logits rows
        (``fb.logits_index``: each request's last computed position, or its last ``k + 1`` when it
        verifies ``k`` draft tokens; under TP every rank's vocabulary slice gathered on every rank)."""
        return self.forward_hidden_and_logits(forward_batch)[1]

    @torch.inference_mode()
    def forward_hidden_and_logits(
        self, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``forward_logits``, with the final (normed) hidden states ``[N, hidden]`` of the logits
        rows beside the logits: what the LM head read, which an EAGLE / MTP draft head takes as its
        input (``pdserve.speculative.proposer``); None for a batch replayed from a CUDA graph."""
        fb = forward_batch
        if (
            fb.lora_slots is None
            and self.cuda_graph_runner is not None
            and self.cuda_graph_runner.can_run(fb)
        ):
            return None, self.cuda_graph_runner.replay(fb)
        hidden = self._hidden_states(fb)[fb.logits_index]
        return hidden, self.model.compute_logits(hidden)

    def _hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """The final (normed) hidden states ``[T, hidden]`` of every token of the batch."""
        self.attn_backend.init_forward_metadata(fb)
        if self.lora_manager is not None:
            self.lora_manager.prepare(fb.lora_slots)
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def sample(self, forward_batch: ForwardBatch, logits: torch.Tensor) -> GenerationBatchResult:
        """One token per row of ``logits`` (``forward_logits``) under the batch's sampling info: a
        next token per request, or per logits row of a verify batch (what each position samples;
        ``pdserve.sampling.verify`` turns them into accepted tokens). Where the batch scores prompt
        tokens (``fb.prompt_logprobs``), their logprobs come from their rows first, and each request
        samples from its last row."""
        fb = forward_batch
        prompt = None
        if fb.prompt_logprobs is not None:
            prompt = fb.prompt_logprobs.compute(logits)
            logits = logits[fb.prompt_logprobs.sample_rows(logits.device)]
        info, tops = fb.sampling_info, fb.top_logprobs_nums
        result = self.sampler(logits, info, fb.return_logprob, tops, fb.draft_rows)
        result.prompt_logprobs = prompt
        return result


def resolve_device(name: str) -> torch.device:
    """``auto`` → the current CUDA device when PyTorch sees a GPU, else ``cpu``; otherwise ``name``.

    Raises:
        ValueError: a CUDA device where PyTorch sees none.
    """
    if name == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: PyTorch sees no CUDA GPU here (use cpu or auto)")
    return torch.device(name)


def _free_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (host memory available for CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


__all__ = ["GenerationBatchResult", "ModelRunner"]
