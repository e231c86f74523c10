"""The speculative flags as a scheduler service parses and builds them (``bootstrap.build_proposer``):
n-gram, a draft model in its own runner, and the refusals at start-up (a draft of another vocabulary,
naming both checkpoints; a draft without its path)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.serving_lib.tiny_model import tiny_checkpoint
from pdserve.distributed import SINGLE_RANK
from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.services.common.bootstrap import build_proposer
from pdserve.services.common.scheduler_main import make_parser
from pdserve.services.decode.main import ROLE
from pdserve.speculative.draft_model import DraftModelProposer
from pdserve.speculative.ngram import NgramProposer


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(tiny_checkpoint(), dtype="float32", max_total_tokens=1024)


def args(*flags: str):
    return make_parser(ROLE).parse_args(["--dtype", "float32", *flags])


def test_ngram_and_draft_proposers_are_built(runner):
    off = args("--speculative-algorithm", "none")
    assert build_proposer(off, "decode", SINGLE_RANK, resolve_model(), runner) is None
    default = args()  # auto: n-gram on a CPU
    assert isinstance(build_proposer(default, "decode", SINGLE_RANK, resolve_model(), runner), NgramProposer)
    ngram = args("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6")
    assert isinstance(build_proposer(ngram, "decode", SINGLE_RANK, resolve_model(), runner), NgramProposer)
    draft = args("--speculative-algorithm", "draft", "--speculative-draft-model-path", str(tiny_checkpoint()))
    proposer = build_proposer(draft, "mixed", SINGLE_RANK, resolve_model(), runner)
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.runner.token_to_kv_pool_allocator.num_pages == runner.token_to_kv_pool_allocator.num_pages


def test_bad_speculative_configurations_are_refused_at_start(runner, tmp_path):
    no_path = args("--speculative-algorithm", "draft")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        build_proposer(no_path, "decode", SINGLE_RANK, resolve_model(), runner)
    other = tmp_path / "draft"
    shutil.copytree(tiny_checkpoint(), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 32000}))
    flags = args("--speculative-algorithm", "draft", "--speculative-draft-model-path", str(other))
    with pytest.raises(ValueError) as e:
        build_proposer(flags, "decode", SINGLE_RANK, resolve_model(), runner)
    assert str(other) in str(e.value) and str(resolve_model()) in str(e.value)
    with pytest.raises(SystemExit):  # a step verifies at least one draft
        args("--speculative-num-draft-tokens", "0")
