"""A grammar along a draft (speculative decoding): the mask of each draft position is the grammar's after
the draft tokens before it, a draft is cut at the first token the grammar refuses and after one that
ends it, and the matcher is back where it was."""

from __future__ import annotations

import pytest
import torch

from pdserve.constrained import GrammarSpec
from pdserve.constrained.backend import GrammarBackend
from pdserve.sampling.sampler import Sampler
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.sampling.verify import accept, verify_inputs
from tests.reference import hf_tokenizer

VOCAB = 49152
EOS = 2
REGEX = r"(yes|no), [0-9]{2}"


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS])
    yield backend
    backend.close()


@pytest.fixture
def grammar(backend):
    return backend.matcher(backend.compile(GrammarSpec("regex", REGEX))[0].result(timeout=120))


def mask_after(backend, tokens: list[int]) -> torch.Tensor:
    """The bitmask row of a fresh matcher that accepted ``tokens`` one by one."""
    fresh = backend.matcher(backend.compile(GrammarSpec("regex", REGEX))[0].result(timeout=120))
    for t in tokens:
        assert fresh.accept(t)
    bitmask = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    fresh.fill_bitmask(bitmask, 0)
    return bitmask[0]


def encode(text: str) -> list[int]:
    return hf_tokenizer().encode(text)


@pytest.mark.parametrize(
    ("draft_text", "extra"),
    [
        ("no, 4", []),  # every token stands
        ("no, 4", encode("x")),  # "x" is refused: cut before it
        ("yes, 42", [EOS, *encode("!")]),  # EOS ends the grammar: cut after it
    ],
)
def test_masks_follow_the_draft_and_cut_it(backend, grammar, draft_text, extra):
    prefix = encode(draft_text)
    draft = prefix + extra
    before = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(before, 0)
    masks = grammar.masks_along(draft, VOCAB)
    stand = len(prefix) + (1 if extra[:1] == [EOS] else 0)
    assert len(masks) == stand + 1
    for j, mask in enumerate(masks):
        if j and draft[j - 1] == EOS:
            continue  # an ended grammar masks nothing (the request is finished)
        assert torch.equal(mask.words, mask_after(backend, draft[:j]))
    after = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(after, 0)
    assert torch.equal(before, after)  # rolled back
    assert all(grammar.accept(t) for t in prefix)  # and still accepts the draft from its start


def test_verify_rows_are_masked_position_by_position(grammar):
    """A greedy request under the grammar verifying a draft that breaks it: the draft is cut, every
    row's token is one the grammar allows there, and the kept tokens form a valid prefix."""
    torch.manual_seed(0)
    draft = encode("no, ") + encode("zz")
    inputs = verify_inputs(
        [SamplingParams(temperature=0.0)], [[]], [[1]], [draft], [EOS], VOCAB, grammars=[grammar]
    )
    assert inputs.drafts == [encode("no, ")]
    logits = torch.randn(len(inputs.drafts[0]) + 1, VOCAB)
    logits[torch.arange(len(inputs.drafts[0])), inputs.drafts[0]] += 100  # the model agrees with the draft
    result = Sampler()(logits, inputs.sampling_info, drafts=inputs.draft_rows)
    kept = accept(result, inputs.drafts)[0].token_ids
    assert kept[:-1] == encode("no, ") and len(kept) == len(encode("no, ")) + 1
    assert all(grammar.accept(t) for t in kept)  # the bonus token is a digit the grammar allows
    assert hf_tokenizer().decode(kept[-1:]).isdigit()
