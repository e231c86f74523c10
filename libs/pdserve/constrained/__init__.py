"""Grammar-constrained decoding: grammar specs, their compilation (xgrammar) and per-request matchers.

A request names at most one grammar (``SamplingParams.grammar``). The scheduler compiles it off its
loop with the ``GrammarBackend`` while the request waits in its grammar queue, gives the request a
``Grammar`` (its matcher), and the sampler masks that request's logits with the grammar's token
bitmask every step; the scheduler advances the matcher by each token the request keeps.
"""

from pdserve.constrained.spec import GRAMMAR_KINDS, GrammarSpec

__all__ = ["GRAMMAR_KINDS", "GrammarSpec"]
