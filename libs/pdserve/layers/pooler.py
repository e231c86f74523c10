"""Pooling a prompt's final hidden states into one embedding (``/v1/embeddings``; SGLang's and
vLLM's ``pooler``).

The rule (``model_pooling``): a sentence-transformers checkpoint whose ``modules.json`` names a
``Pooling`` module pools as its ``config.json`` says: ``pooling_mode_mean_tokens`` → ``mean``,
``pooling_mode_lasttoken`` → ``last``, any other mode (cls, max, weighted) is not served (None).
Every other decoder checkpoint pools its last token (vLLM's default for decoder-only embedding
models: under causal attention only the last position has seen the whole input). The pooled
vector is L2-normalised in float32.

The hidden states are the decoder's output after its final norm (HF transformers'
``last_hidden_state``), before the LM head. A prompt computed in chunks pools chunk by chunk: a
chunk gives its last row (``last``) or the float32 sum of its rows (``mean``), and ``finish``
turns what the chunks gave into the embedding. A pooling request computes its whole prompt (no
cached prefix: ``Req.computes_whole_prompt``), so every position is summed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_KINDS = ("last", "mean")


def model_pooling(model_path: Path) -> str | None:
    """The pooling ``model_path``'s checkpoint implies: ``last``, ``mean``, or None for a
    sentence-transformers pooling mode pdserve does not serve (see the module docstring).

    Raises:
        ValueError: a ``modules.json`` or pooling ``config.json`` that is not valid JSON.
    """
    modules = Path(model_path) / "modules.json"
    if not modules.is_file():
        return "last"
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = json.loads((Path(model_path) / module.get("path", "") / "config.json").read_text())
            if config.get("pooling_mode_mean_tokens"):
                return "mean"
            if config.get("pooling_mode_lasttoken"):
                return "last"
            return None
    return "last"


@dataclass(slots=True)
class PoolingRows:
    """Which requests of a forward batch pool their chunk: ``kinds[b]`` is ``last``, ``mean`` or
    None (a request that does not embed)."""

    kinds: list[str | None]

    def select(self, rows: list[int]) -> PoolingRows:
        """The rows of the requests ``rows`` alone (a sub-batch, in that order)."""
        return PoolingRows([self.kinds[r] for r in rows])

    def compute(
        self, hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """Each pooling request's part of its chunk from the batch's final hidden states.

        Args:
            hidden: ``[T, H]`` (model dtype): every token of the batch.
            starts / lens: int64 ``[B]``: each request's first flat token and its token count.

        Returns:
            ``[B]``: float32 ``[H]`` on the CPU (the chunk's last row, or the sum of its rows), None
            for a request that does not pool.
        """
        out: list[torch.Tensor | None] = []
        for kind, s, n in zip(self.kinds, starts.tolist(), lens.tolist(), strict=True):
            if kind == "last":
                out.append(hidden[s + n - 1].float().cpu())
            elif kind == "mean":
                out.append(hidden[s : s + n].float().sum(0).cpu())
            else:
                out.append(None)
        return out


def accumulate(pooled: torch.Tensor | None, part: torch.Tensor, kind: str) -> torch.Tensor:
    """What a prompt's chunks pooled so far, with one more chunk's ``part`` (float32 ``[H]``)."""
    return part if pooled is None or kind == "last" else pooled + part


def finish(pooled: torch.Tensor, kind: str, num_tokens: int) -> list[float]:
    """The L2-normalised embedding of a ``num_tokens`` prompt from its chunks' ``accumulate``d parts."""
    vector = pooled / num_tokens if kind == "mean" else pooled
    return torch.nn.functional.normalize(vector, dim=0).tolist()
