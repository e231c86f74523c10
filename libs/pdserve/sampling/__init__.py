"""Sampling: per-request parameters, their batched tensors, and the sampler."""

from pdserve.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
