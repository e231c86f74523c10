"""Driving the scheduler core step by step in a test, the way ``SchedulerLoop`` does, without a loop.

``drive(sched, overlap=True)`` runs the overlapped order synchronously: step N+1 is scheduled and run
before step N's result is processed (its decode inputs filled in from step N's sampled ids), which is
what the loop's forward thread does while the loop thread processes step N.
"""

from __future__ import annotations

import weakref

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.mem_cache.radix_cache import RadixCache
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_batch_info import step_seed
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig, StepOutput
from tests.reference import hf_tokenizer

PAGE = 16
POISON_SEED = 424_242  # a request seeded with it breaks the forward of any batch it is in


def make_runner(max_total_tokens: int) -> ModelRunner:
    torch.set_num_threads(2)
    return ModelRunner(resolve_model(), dtype="float32", page_size=PAGE, max_total_tokens=max_total_tokens)


def ids(text: str) -> list[int]:
    return hf_tokenizer()(text)["input_ids"]


def req(rid: str, prompt: list[int], max_new: int = 16, **params) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, **({"temperature": 0.0} | params)))


# the radix tree of the latest scheduler on each runner (they share its KV pool); weak on the runner,
# so that a test's runner (1 GB and more) is freed with it: the tree refers to its allocator, not to it
_last_tree: weakref.WeakKeyDictionary[ModelRunner, RadixCache] = weakref.WeakKeyDictionary()


def fresh(runner: ModelRunner, **config) -> Scheduler:
    """A new scheduler on ``runner``'s pools, after the previous one's cached pages went back."""
    previous = _last_tree.get(runner)
    if previous is not None:
        previous.reset()
    sched = Scheduler(runner, SchedulerConfig(**config))
    _last_tree[runner] = sched.ledger.tree
    return sched


def step(sched: Scheduler, prev, overlap: bool):
    """One loop iteration; returns ``(outputs, batch still to process)``."""
    outputs: list[StepOutput] = []
    batch = sched.schedule()
    if batch is None and sched.needs_results and prev is not None:
        outputs += sched.process_result(prev)
        prev = None
        batch = sched.schedule()
    if batch is not None:
        sched.run_batch(batch)  # sets batch.result; reads prev's result for pending inputs
    if prev is not None:
        outputs += sched.process_result(prev)
    if batch is not None and not overlap:
        outputs += sched.process_result(batch)
        batch = None
    return outputs + sched.pop_aborted(), batch


def drive(sched: Scheduler, overlap: bool = False, max_steps: int = 2000, on_step=None) -> dict[str, Req]:
    """Run steps until idle; returns every finished request by rid. After every step the KV pages
    must be conserved, and at the end nothing may be left in use."""
    done: dict[str, Req] = {}
    prev = None
    for n in range(max_steps):
        if on_step is not None:
            on_step(n, sched)
        outputs, prev = step(sched, prev, overlap)
        for out in outputs:
            if out.finished:
                done[out.req.rid] = out.req
        sched.check_invariants()
        if prev is None and not sched.has_work() and not outputs:
            break
    assert not sched.has_work(), "scheduler did not drain"
    assert sched.ledger.used_pages() == 0
    return done


def cached_sequences(tree: RadixCache) -> list[tuple[int, ...]]:
    """Every token sequence ``tree`` holds, from the root to each node."""
    out, stack = [], [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key = prefix + tuple(child.key)
            out.append(key)
            stack.append((child, key))
    return out


class PoisonedSampler:
    """The real sampler, except that a batch holding a request seeded with ``POISON_SEED`` raises
    (as a forward that one request's inputs break would); ``verify_failures`` counts the batches it
    failed that verified drafts."""

    def __init__(self, real):
        self.real = real
        self.poisoned = {step_seed(POISON_SEED, k) for k in range(256)}
        self.calls = 0
        self.verify_failures = 0

    def __call__(self, logits, info, return_logprob=False, top_logprobs_nums=None, drafts=None):
        self.calls += 1
        if info is not None and self.poisoned.intersection(info.step_seeds):
            self.verify_failures += drafts is not None
            raise RuntimeError("injected failure")
        return self.real(logits, info, return_logprob, top_logprobs_nums, drafts)
