"""Deterministic prompt workloads: ``random`` (prompts of about N tokens), ``shared-prefix``,
``tenants`` and ``grounded`` (answers that copy spans of the prompt: ``grounded.py``).

Prompts are built from common English words that BPE vocabularies (SmolLM2, Llama, Qwen, GPT-2)
hold as a single token with their leading space, so a prompt of ``n`` words is about ``n`` tokens;
:func:`benchmarks.serving_lib.tokens.TokenCounter.tokens_per_word` measures the exact ratio on the
served tokenizer when the server can tokenize. The shared-prefix workload is the few-shot /
system-prompt pattern that RadixAttention (SGLang, Zheng et al. 2024) targets: one long preamble
followed by distinct short questions. The tenants workload is many of those at once: each tenant
has its own system prompt, and requests of the tenants arrive in random order, so that workers whose
pools hold only some of the prefixes reward a router that sends each tenant where its prefix is
cached (Dynamo's KV router, llm-d's precise prefix-cache scorer; issue 40).
"""

from __future__ import annotations

import random
from typing import Literal

from benchmarks.serving_lib.grounded import TASKS, grounded_prompt

WorkloadKind = Literal["random", "shared-prefix", "tenants", "grounded"]

_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group country problem
hand part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education river garden window paper music
market light letter voice table field road stone bird tree ship sun rain wind fire snow dog horse apple bread
cloud island forest bridge train winter summer color dream plan song
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
PREAMBLE_HEAD = "Read the following notes carefully, then answer the question at the end.\n\n"
QUESTION_SEP = "\n\n"


def random_words(rng: random.Random, count: int) -> str:
    """``count`` words drawn uniformly (with replacement) from :data:`WORDS`, space-separated."""
    return " ".join(rng.choices(WORDS, k=count))


def words_for(tokens: int, tokens_per_word: float) -> int:
    """How many :data:`WORDS` make about ``tokens`` tokens (at least 1)."""
    return max(1, round(tokens / tokens_per_word))


class PromptSource:
    """An endless, seeded stream of fresh prompts of one workload.

    Every :meth:`take` returns prompts never returned before, so a radix cache cannot reuse one
    level's prompts in the next (only the shared-prefix preamble is meant to be reused). Two sources
    built with the same arguments yield identical sequences, which keeps ``--compare`` runs fair.

    Args:
        kind: ``"random"``, ``"shared-prefix"``, ``"tenants"`` (a preamble per tenant, each
            request of a tenant drawn uniformly) or ``"grounded"`` (the tasks of
            ``grounded.TASKS`` in turn, their grounding text about ``prompt_tokens`` long).
        prompt_tokens: target length of a random prompt (a grounded prompt's text), in tokens.
        prefix_tokens: target length of a preamble, in tokens (shared-prefix and tenants).
        seed: seed of the word choices.
        tokens_per_word: the served tokenizer's tokens per word of :data:`WORDS` (1.0 if unknown).
        tenants: how many tenants (tenants only).

    Attributes:
        preambles: the preambles (one for shared-prefix, one per tenant; none otherwise).

    Raises:
        ValueError: for an unknown ``kind``, a non-positive length or tenant count.
    """

    def __init__(
        self,
        kind: WorkloadKind,
        prompt_tokens: int,
        prefix_tokens: int,
        seed: int,
        tokens_per_word: float = 1.0,
        tenants: int = 16,
    ) -> None:
        if kind not in ("random", "shared-prefix", "tenants", "grounded"):
            raise ValueError(f"unknown workload {kind!r}")
        if prompt_tokens < 1 or prefix_tokens < 1 or tokens_per_word <= 0 or tenants < 1:
            raise ValueError("prompt_tokens, prefix_tokens, tokens_per_word and tenants must be positive")
        self.kind = kind
        self._rng = random.Random(seed)
        self._prompt_words = words_for(prompt_tokens, tokens_per_word)
        self._taken = 0
        count = {"shared-prefix": 1, "tenants": tenants}.get(kind, 0)
        body_words = max(1, words_for(prefix_tokens, tokens_per_word) - len(PREAMBLE_HEAD.split()))
        self.preambles = [PREAMBLE_HEAD + random_words(self._rng, body_words) + "." for _ in range(count)]

    def take(self, count: int) -> list[str]:
        """The next ``count`` prompts."""
        return [self._next() for _ in range(count)]

    def _next(self) -> str:
        self._taken += 1
        if self.kind == "random":
            return random_words(self._rng, self._prompt_words)
        if self.kind == "grounded":
            task = TASKS[(self._taken - 1) % len(TASKS)]
            return grounded_prompt(self._rng, WORDS, task, self._prompt_words)
        preamble = self._rng.choice(self.preambles)
        a, b = self._rng.sample(WORDS, 2)
        question = f"Question {self._taken}: what do the notes say about the {a} and the {b}?"
        return f"{preamble}{QUESTION_SEP}{question}"
