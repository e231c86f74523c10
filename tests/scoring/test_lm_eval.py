"""lm-evaluation-harness scores the served model as it scores the checkpoint itself: a tiny local
multiple-choice task and a generate-until task (JSONL in tests/scoring/data) run through the
colocated stack with lm-eval's ``local-completions`` model (``echo`` + ``logprobs``, then plain
greedy completions with stop strings) and through its ``hf`` model on the same checkpoint in float32
give the same accuracy, the same per-item log-likelihoods within 1e-4 and the same generations.
No network: the tasks are read from a local ``include_path`` and the datasets' JSON builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model_source import resolve_model
from tests.stack import SERVED_MODEL

DATA = Path(__file__).parent / "data"
TOL = 1e-4


def task_yaml(name: str, data: str, rest: str) -> str:
    """An lm-eval task ``name`` over the JSONL file ``data`` of tests/scoring/data (its test split)."""
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA / data}\n"
    return head + "test_split: test\n" + rest


MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""

GENERATE = """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ["pdserve_multiple_choice", "pdserve_generate"]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    (tasks / "multiple_choice.yaml").write_text(task_yaml(TASKS[0], "multiple_choice.jsonl", MULTIPLE_CHOICE))
    (tasks / "generate.yaml").write_text(task_yaml(TASKS[1], "generate.jsonl", GENERATE))
    return TaskManager(include_path=str(tasks), include_defaults=False)


def evaluate(model: str, model_args: dict, task_manager) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=task_manager,
        batch_size=1,
        device="cpu",
        log_samples=True,
    )


def per_item(results: dict, task: str) -> list:
    """Each item's filtered responses, by document id: (loglikelihood, is_greedy) per choice of a
    multiple-choice item, the generated text of a generate-until one."""
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_scores_the_served_model_as_the_checkpoint(colocated, task_manager, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checkpoint = str(resolve_model())
    served = evaluate(
        "local-completions",
        {
            "base_url": f"{colocated.base_url}/v1/completions",
            "model": SERVED_MODEL,
            "tokenizer": checkpoint,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        task_manager,
    )
    reference = evaluate("hf", {"pretrained": checkpoint, "dtype": "float32"}, task_manager)

    mc = "pdserve_multiple_choice"
    assert served["results"][mc]["acc,none"] == reference["results"][mc]["acc,none"]
    ours, theirs = per_item(served, mc), per_item(reference, mc)
    assert len(ours) == len(theirs) == 6
    for item_ours, item_theirs in zip(ours, theirs, strict=True):
        assert [g for _, g in item_ours] == [g for _, g in item_theirs]  # is_greedy per choice
        assert [ll for ll, _ in item_ours] == pytest.approx([ll for ll, _ in item_theirs], abs=TOL)

    gen = "pdserve_generate"
    assert per_item(served, gen) == per_item(reference, gen)
    assert served["results"][gen]["exact_match,none"] == reference["results"][gen]["exact_match,none"]
    assert any(text for [text] in per_item(served, gen))  # the generations are not all empty
