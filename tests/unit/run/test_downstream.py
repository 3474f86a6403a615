"""downstream: (lmlab.run.downstream): the callback scores a task exactly as eval.py harness= does (lm-eval's
simple_evaluate over analysis/harness.py's LmlabLM) on the same weights, leaves the model and the random generators
as they were, scores at the steps the rule names, and bad keys are refused by name before training."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lmlab.run.checks import EXAMPLE_TASKS  # noqa: E402
from tests.runs import ROOT  # noqa: E402

TASKS = ["shakespeare_mc", "shakespeare_ppl"]  # examples/lm_eval/: multiple choice and rolling loglikelihood


@pytest.fixture
def model_and_tokenizer(tiny_cfg, monkeypatch):
    """A tiny GPT at its (seeded) init and a character tokenizer of the example tasks' texts; the working directory
    is the checkout's root, where the example tasks' data_files are."""
    from lmlab.data.tokenizer import train_char
    from lmlab.model.gpt import GPT

    monkeypatch.chdir(ROOT)
    texts = [p.read_text() for p in sorted(EXAMPLE_TASKS.glob("*.jsonl"))]
    tok = train_char(texts, vocab_size=128)
    torch.manual_seed(0)
    return GPT(tiny_cfg(vocab_size=tok.get_vocab_size(), max_seq_len=64)), tok


def test_the_callback_scores_what_eval_py_harness_scores(model_and_tokenizer) -> None:
    """The same numbers as the standalone route (lmlab.analysis.harness.run_harness with route lmlab: lm-eval's
    simple_evaluate over LmlabLM, the tasks found by name under harness_include) for the same weights and limit.
    (Without lm-eval's own ~14k task files indexed, 25 s here, and without its bootstrapped standard errors: neither
    changes a score; tests/e2e/run/test_downstream.py compares with run_harness itself.)"""
    import lm_eval
    from lm_eval.tasks import TaskManager

    def manager():
        return TaskManager(include_path=str(EXAMPLE_TASKS), include_defaults=False)

    from lmlab.analysis.harness import LmlabLM
    from lmlab.run.downstream import Downstream, metrics_of

    model, tok = model_and_tokenizer
    callback = Downstream(TASKS, tok, every=1, limit=3)
    ours = callback.measure(model)
    standalone = lm_eval.simple_evaluate(model=LmlabLM(model, tok), tasks=TASKS, limit=3,
                                         task_manager=manager(), bootstrap_iters=0)
    assert ours == metrics_of(standalone["results"])  # exactly: the same scoring, the same documents
    assert set(ours) == {"downstream/shakespeare_mc/acc", "downstream/shakespeare_mc/acc_norm",
                         "downstream/shakespeare_ppl/word_perplexity", "downstream/shakespeare_ppl/bits_per_byte"}
    assert callback.measure(model) == ours  # the same documents every time
    full = Downstream(TASKS[:1], tok, every=1).measure(model)  # limit null: every document of the task
    whole = lm_eval.simple_evaluate(model=LmlabLM(model, tok), tasks=TASKS[:1],
                                    task_manager=manager(), bootstrap_iters=0)
    assert full == metrics_of(whole["results"])


def test_scoring_leaves_the_model_mode_and_the_random_generators_as_they_were(model_and_tokenizer) -> None:
    import numpy as np

    from lmlab.run.downstream import Downstream

    model, tok = model_and_tokenizer
    callback = Downstream(TASKS, tok, every=1, limit=2)
    model.train()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = torch.rand(2), random.random(), np.random.rand()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with torch.enable_grad():
        callback.measure(model)
    assert model.training and all(p.grad is None for p in model.parameters())
    after = torch.rand(2), random.random(), np.random.rand()
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def test_metric_names() -> None:
    from lmlab.run.downstream import metrics_of

    results = {"t": {"alias": "t", "sample_len": 3, "acc,none": 0.5, "acc_stderr,none": "N/A",
                     "exact_match,strict-match": 1, "exact_match_stderr,strict-match": 0.1}}
    assert metrics_of(results) == {"downstream/t/acc": 0.5, "downstream/t/exact_match/strict-match": 1.0}


def test_it_scores_every_n_vals_validations_by_step_and_the_last() -> None:
    from lmlab.run.downstream import Downstream

    callback = Downstream.__new__(Downstream)
    callback.every = 4  # every_n_vals=2 x trainer.val_check_interval=2

    def due(step: int, fn: str = "fit") -> bool:
        return callback.due(SimpleNamespace(global_step=step, max_steps=11, state=SimpleNamespace(fn=fn)))

    assert [s for s in range(1, 12) if due(s)] == [4, 8, 11]
    assert due(6, fn="validate")  # training.py's validation after an early stop


def test_a_resume_carries_the_last_values_it_resumes_after() -> None:
    from lmlab.run.downstream import carried

    last = {"step": 4, "metrics": {"downstream/t/acc": 0.5}}
    assert carried({"downstream": last}, resume_step=6) == last
    assert carried({"downstream": last}, resume_step=3) is None  # scored after the checkpoint: not this run's
    assert carried({"status": "interrupted"}, resume_step=6) is None and carried(None, 0) is None


@pytest.mark.parametrize("override,message", [
    ("downstream.tasks=[hellaswag]", "unknown task 'hellaswag'; each entry is a task of .*shakespeare_mc, "
                                     "shakespeare_ppl.* or the path of an lm-eval task YAML file"),
    ("downstream.tasks=[no/such/task.yaml]", "the task file no/such/task.yaml is not found"),
    ("downstream.every_n_vals=0", r"downstream.every_n_vals=0 must be an integer >= 1"),
    ("downstream.limit=0", r"downstream.limit=0 must be an integer >= 1 or null"),
    ("downstream.tasks=[shakespeare_mc,examples/lm_eval/shakespeare_mc.yaml]", "names the task shakespeare_mc twice"),
])
def test_bad_keys_are_refused_by_name_before_training(override: str, message: str, monkeypatch) -> None:
    from lmlab import compose
    from lmlab.run.checks import check_config

    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match=message):
        check_config(compose(["logger=none", override]), [override])


def test_the_default_and_good_tasks_pass(monkeypatch) -> None:
    from lmlab import compose
    from lmlab.run.checks import check_config

    monkeypatch.chdir(ROOT)
    assert compose(["logger=none"]).downstream.tasks == []  # off by default
    for tasks in ("[shakespeare_mc]", "[shakespeare_mc,examples/lm_eval/shakespeare_ppl.yaml]"):
        check_config(compose(["logger=none", f"downstream.tasks={tasks}"]), [])


def test_a_task_that_does_not_load_or_generates_is_refused_before_training(model_and_tokenizer, tmp_path) -> None:
    from lmlab.run.downstream import Downstream

    _, tok = model_and_tokenizer
    data = tmp_path / "gen.jsonl"
    data.write_text(json.dumps({"q": "To be or not", "a": " to be"}) + "\n")
    generating = tmp_path / "gen.yaml"
    generating.write_text(f"task: toy_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                          "output_type: generate_until\ntest_split: test\ndoc_to_text: '{{q}}'\n"
                          "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n")
    with pytest.raises(ValueError, match="toy_gen generate text .*eval.py run=<run> harness="):
        Downstream([str(generating)], tok, every=1)
    missing = tmp_path / "missing.yaml"
    missing.write_text(generating.read_text().replace(str(data), str(tmp_path / "gone.jsonl"))
                       .replace("toy_gen", "toy_missing"))
    with pytest.raises(ValueError, match=r"downstream.tasks=.*lm-eval could not load them"):
        Downstream([str(missing)], tok, every=1)
