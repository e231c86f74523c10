"""The Hugging Face transformers reference: fp32 greedy ``generate()`` on the same weights the server
serves: the default GGUF as ``pdserve.model_source`` converts it (dequantized by transformers and
kept in float16; ``tests/test_model_source.py`` checks that conversion against transformers' own
float32 dequantization of the GGUF)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def hf_model():
    """SmolLM2-135M-Instruct loaded by transformers from the converted checkpoint, in float32 (eval)."""
    from transformers import AutoModelForCausalLM

    from pdserve.model_source import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model(), dtype=torch.float32).eval()


@functools.cache
def hf_prompt_logprobs(prompt: tuple[int, ...]) -> torch.Tensor:
    """float32 ``[L - 1, V]``: HF's log_softmax at positions 0..L-2 of ``prompt``, scoring its tokens
    1..L-1 (what prompt logprobs and ``echo`` with ``logprobs`` return)."""
    with torch.no_grad():
        logits = hf_model()(torch.tensor([list(prompt)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def hf_embedding(prompt: list[int]) -> torch.Tensor:
    """float32 ``[H]``: HF's ``last_hidden_state`` (after the final norm) at the last position of
    ``prompt``, L2-normalised: the embedding of last-token pooling (``pdserve.layers.pooler``)."""
    with torch.no_grad():
        hidden = hf_model().model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0)


@functools.cache
def context_length() -> int:
    """``max_position_embeddings`` of the default model's config.json."""
    from transformers import AutoConfig

    from pdserve.model_source import resolve_model

    return AutoConfig.from_pretrained(resolve_model()).max_position_embeddings


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model())


def vocab_size() -> int:
    """The HF tokenizer's size (added tokens included): token ids a request may name are below it."""
    return len(hf_tokenizer())


class _AddLogitBias:
    """An HF logits processor adding ``bias`` (token id -> value) to every step's scores."""

    def __init__(self, bias: dict[int, float]):
        self.ids, self.values = list(bias), torch.tensor(list(bias.values()))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values
        return scores


def hf_greedy(
    input_ids: list[int],
    max_new_tokens: int,
    logit_bias: dict[int, float] | None = None,
    min_new_tokens: int = 0,
    processors: list | None = None,
) -> list[int]:
    """Greedy continuation of ``input_ids`` by HF ``generate()``; stops at EOS like the server.
    ``logit_bias`` (token id -> value) is added to the logits before each argmax; EOS is masked
    until ``min_new_tokens`` tokens were generated; ``processors`` are further logits processors."""
    from transformers import LogitsProcessorList

    model = hf_model()
    processors = LogitsProcessorList(([_AddLogitBias(logit_bias)] if logit_bias else []) + (processors or []))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]),
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            logits_processor=processors,
            min_new_tokens=min_new_tokens or None,
        )
    return out[0, len(input_ids) :].tolist()


def chat_ids(messages: list[dict]) -> list[int]:
    """The prompt ids the model's own chat template gives (add_generation_prompt=True)."""
    tok = hf_tokenizer()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@functools.cache
def xgrammar_compiler():
    """An xgrammar compiler of its own over the reference tokenizer (EOS 2 ends a grammar)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer(), vocab_size=49152, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1)


def hf_constrained_greedy(input_ids: list[int], max_new_tokens: int, kind: str, grammar: str) -> list[int]:
    """Greedy continuation by HF ``generate()`` under xgrammar's own HF logits processor
    (``kind``: json_schema, compact as the server writes it; regex; ebnf; structural_tag)."""
    from xgrammar.contrib.hf import LogitsProcessor

    compiler = xgrammar_compiler()
    compile_fn = {
        "json_schema": lambda g: compiler.compile_json_schema(g, any_whitespace=False),
        "regex": compiler.compile_regex,
        "ebnf": compiler.compile_grammar,
        "structural_tag": compiler.compile_structural_tag,
    }[kind]
    return hf_greedy(input_ids, max_new_tokens, processors=[LogitsProcessor(compile_fn(grammar))])
