"""Build a scheduler rank's engine, scheduler and NIXL agent from its parsed flags."""

from __future__ import annotations

import argparse
import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoTokenizer

from pdserve.constrained.backend import GrammarBackend
from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.kv_transfer import POOL_LAYOUT, KVAgentInfo, KVLayout, KVTransferAgent
from pdserve.kv_transfer.net_devices import restrict_ucx_to
from pdserve.mem_cache.swa_pool import SWAKVPool
from pdserve.model_source import resolve_model, served_model_names
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.services.common.forward_lock import ForwardLock
from pdserve.speculative.draft_model import DraftModelProposer
from pdserve.speculative.ngram import NgramProposer


def build_scheduler(args: argparse.Namespace, role: str, tp: TpGroup = SINGLE_RANK) -> Scheduler:
    """ModelRunner (this rank's weights and pools, attention backend) behind a ``TpModelWorker``,
    the grammar backend (which loads the tokenizer only when the first constrained request comes)
    and the scheduler core for ``role``."""
    model_path = resolve_model(args.model, args.revision)
    runner = ModelRunner(
        model_path,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        kv_cache_memory=args.kv_cache_memory,
        kv_memory_fraction=args.kv_memory_fraction,
        max_running_requests=args.max_running_requests,
        quantization=args.quantization,
        device=rank_device(args.device, tp),
        disable_cuda_graph=args.disable_cuda_graph or role == "prefill",  # a prefill worker never decodes
        max_model_len=args.max_model_len,
        tp=tp,
        kv_cache_dtype=args.kv_cache_dtype,
        expert_parallel=args.enable_expert_parallel,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        max_loras=args.max_loras if args.enable_lora or args.lora_modules else 0,
        max_lora_rank=args.max_lora_rank,
        max_loaded_loras=args.max_loaded_loras,
    )
    for name, path in args.lora_modules:  # a bad adapter stops the start, naming it
        runner.lora_manager.add(name, path)
    config = SchedulerConfig(
        role=role,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache,
        max_queued_requests=args.max_queued_requests,
        max_queue_time=args.max_queue_time,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_policy=args.speculative_policy,
        kv_tier_memory=args.kv_tier_memory,
    )
    model_name = served_model_names(args.model, args.served_model_name)[0]
    cfg = runner.model_config
    grammars = None  # under TP constrained requests are refused (``grammar_wait.tp_refusal``)
    if tp.size == 1:
        grammars = GrammarBackend(
            lambda: AutoTokenizer.from_pretrained(model_path),
            cfg.vocab_size,
            list(cfg.eos_token_ids),
            compile_timeout=config.grammar_compile_timeout,
        )
    proposer = build_proposer(args, role, tp, model_path, runner) if role != "prefill" else None
    metrics = SchedulerMetrics(role, model_name)
    if runner.swa_pages is not None:
        metrics.watch_local_pages(runner.swa_pages)
    return Scheduler(TpModelWorker(runner), config, metrics, grammars, proposer)


def build_proposer(args: argparse.Namespace, role: str, tp: TpGroup, model_path, runner: ModelRunner):
    """The drafter of ``--speculative-algorithm`` (None for ``none``; ``auto`` is ``ngram`` on a CPU
    and ``none`` on a GPU, where speculation was not measured): an n-gram index, or a draft
    model in a ``ModelRunner`` of its own in this worker, in the target's dtype and quantization, with
    a KV pool as large as the target's.

    Raises:
        ValueError: a draft model under TP (not supported yet), ``draft`` without a draft model path,
            or a draft model whose tokenizer or vocabulary differs from the target's (both named).
    """
    algorithm = args.speculative_algorithm
    if algorithm == "auto":
        algorithm = "ngram" if runner.device.type == "cpu" else "none"
    if algorithm == "none":
        return None
    if algorithm == "ngram":
        return NgramProposer()  # deterministic in the tokens: every TP rank drafts the same
    if tp.size > 1:
        raise ValueError(
            "--speculative-algorithm draft is not supported with --tp-size > 1 yet (each rank would "
            "run the draft model and sample its drafts alone); use ngram"
        )
    if not args.speculative_draft_model_path:
        raise ValueError("--speculative-algorithm draft needs --speculative-draft-model-path")
    draft_path = resolve_model(args.speculative_draft_model_path)
    return DraftModelProposer.load(
        draft_path,
        model_path,
        dtype=args.dtype,
        quantization=args.quantization,
        page_size=args.page_size,
        max_total_tokens=runner.token_to_kv_pool_allocator.num_pages * args.page_size,
        max_running_requests=args.max_running_requests,
        device=str(runner.device),
    )


def rank_device(device: str, tp: TpGroup) -> str:
    """The device of ``tp.rank``: ``device`` itself without TP, else GPU ``rank`` of those visible
    (``auto`` / ``cuda``: the launcher gives a TP scheduler one GPU per rank) or the CPU.

    Raises:
        ValueError: a single GPU (``cuda:i``) named for several ranks.
    """
    if tp.size == 1 or device == "cpu":
        return device
    if device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} names one GPU; a TP group of {tp.size} takes cuda:0..{tp.size - 1}"
        )
    return f"cuda:{tp.rank}" if device == "cuda" or torch.cuda.is_available() else "cpu"


async def build_scheduler_off_loop(
    args: argparse.Namespace, role: str, tp: TpGroup = SINGLE_RANK
) -> Scheduler:
    """``build_scheduler`` on a one-off thread that has exited when this returns.

    Not ``asyncio.to_thread``: the default executor's thread would stay alive with the OpenMP
    team that loading the weights started, and libgomp, seeing more threads than cores, then
    sleeps at every barrier of the forward instead of spinning (measured on 2 cores: ~20% fewer
    output tok/s, ~100x more context switches; see ``make bench-gateway``).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, build_scheduler, args, role, tp)


def overlap_schedule(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether the loop of a scheduler on ``device`` overlaps each step's CPU work with the next forward
    (``SchedulerLoop``): as ``--enable-overlap-schedule`` / ``--disable-overlap-schedule`` say, else
    on, except on a CPU where the forward's OpenMP threads (``torch.get_num_threads()`` per rank,
    times ``--tp-size``) take every core this process may use.

    There the loop thread, preparing step N+1 while step N's forward runs, takes a core from the
    forward's team, whose threads all wait at each region's end for the one that lost it. Measured on
    a 2-core Zen 4 (2026-12-07, PD 1+1, SmolLM2-135M w4a8 with n-gram speculation, medians of three
    rounds of ``make bench-llama``): without the overlap 0.90x / 1.13x / 1.00x the output tok/s at
    concurrency 1 / 16 / 64 on random prompts, 1.10x at one stream on the input-grounded workload.
    """
    if args.enable_overlap_schedule or args.disable_overlap_schedule:
        return args.enable_overlap_schedule
    if device.type != "cpu":
        return True
    return torch.get_num_threads() * args.tp_size < len(os.sched_getaffinity(0))


def forward_lock(args: argparse.Namespace) -> ForwardLock | None:
    """The forwards' turn of ``--forward-lock`` (None without it).

    Raises:
        OSError: the lock file cannot be opened (a clear start-up error).
    """
    return ForwardLock(args.forward_lock) if args.forward_lock else None


def build_kv_agent(scheduler: Scheduler, role: str, address: str, host: str) -> KVTransferAgent:
    """One NIXL agent per scheduler rank with its whole KV pool (its heads) registered; its UCX
    transports use only the interface of ``host``, the internal address the process binds
    (``restrict_ucx_to``). Its name, ``{role}-{address}-rank{r}``, is the same after a restart: its
    peers then replace the dead process's agent with it (``KVTransferAgent.add_peer``: another
    incarnation under a known name) instead of keeping both loaded."""
    restrict_ucx_to(host)
    runner = scheduler.runner
    cfg = runner.model_config
    pool = runner.kv_pool
    local = pool.swa if isinstance(pool, SWAKVPool) else None  # the local layers' pages
    layout = KVLayout(
        model=f"{cfg.architecture}:{cfg.num_layers}x{cfg.hidden_size}:vocab{cfg.vocab_size}",
        dtype=str(pool.dtype).removeprefix("torch."),
        page_size=scheduler.page_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_local_kv_heads,
        head_dim=cfg.head_dim,
        layout=POOL_LAYOUT,
        tp_size=cfg.tp_size,
        tp_rank=cfg.tp_rank,
        num_local_layers=0 if local is None else local.num_layers,
        kv_head_start=cfg.local_kv_head_start,
        total_kv_heads=cfg.num_kv_heads,
    )
    name = f"{role}-{address}-rank{cfg.tp_rank}"
    full = pool if local is None else pool.full
    return KVTransferAgent(name, full.kv_data, layout, None if local is None else local.kv_data)


async def gather_agents(agent: KVTransferAgent, tp: TpGroup) -> list[KVAgentInfo]:
    """Every rank's agent info, in rank order (a collective of the group's control plane)."""
    if tp.size == 1:
        return [agent.local_info()]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-agents") as pool:
        return await asyncio.get_running_loop().run_in_executor(
            pool, tp.all_gather_object, agent.local_info()
        )
