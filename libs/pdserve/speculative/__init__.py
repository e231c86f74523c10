"""Speculative decoding: proposers that draft tokens for running requests, and what the scheduler
calls to keep the KV of verified tokens only (the verify forward and the acceptance rule are the
engine's and the sampler's: ``ForwardMode.TARGET_VERIFY``, ``pdserve.sampling.verify``)."""

from pdserve.speculative.proposer import DraftRequest, Drafts, Proposer

__all__ = ["DraftRequest", "Drafts", "Proposer"]
