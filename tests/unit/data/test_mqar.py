"""Zoology's multi-query associative recall (data=mqar, lmlab/data/mqar.py): the examples' structure, a stream
deterministic in the seed that a resume continues, fixed validation examples, the recall metric against a perfect
copier and a constant guesser, bad keys refused by name, the loss ignoring every position but the queries (chunked
too), compare's table and plot, and a short run that leaves its figures and resumes exactly."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from lmlab import build_model, compose
from lmlab.data import build_datamodule as _build_datamodule
from lmlab.data.mqar import IGNORE, MQARDataModule, recall_metrics
from lmlab.run.training import check_config

SMALL = {"n_pairs": 4, "n_queries": 3, "vocab_size": 32, "batch_size": 4, "val_windows": 64}


def small(seed: int = 0, seq_len: int = 32, **keys) -> MQARDataModule:
    return MQARDataModule({"name": "mqar", **SMALL, **keys}, seq_len=seq_len, seed=seed)


def copier(x: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """What a perfect recaller predicts, from the inputs alone: after the pairs, at a token that is one of the
    example's keys, the value paired with it (elsewhere 0)."""
    keys, values = x[:, 0:2 * n_pairs:2], x[:, 1:2 * n_pairs:2]
    match = x[:, :, None] == keys[:, None, :]  # (N, T, n_pairs)
    pred = torch.where(match.any(-1), values.gather(1, match.int().argmax(-1)), 0)
    pred[:, :2 * n_pairs] = 0
    return pred


def test_an_example_is_pairs_then_queries_of_their_keys() -> None:
    data = small()
    task = data.task
    assert (task.n_keys, task.n_values, data.vocab_size) == (15, 16, 32)  # Zoology: keys 1 .. 15, values 16 .. 31
    x, y = data.val_inputs()
    assert x.shape == y.shape == (64, 32) and x.dtype == y.dtype == torch.long
    for xi, yi in zip(x.tolist(), y.tolist()):
        keys, values = xi[0:8:2], xi[1:8:2]
        assert len(set(keys)) == 4 and len(set(values)) == 4  # distinct within the example
        assert all(1 <= k < 16 for k in keys) and all(16 <= v < 32 for v in values)  # disjoint vocabularies
        asked = [t for t, target in enumerate(yi) if target != IGNORE]
        assert len(asked) == 3 and all(t >= 8 and (t - 8) % 2 == 0 for t in asked)  # after the pairs, on a slot
        assert len({xi[t] for t in asked}) == 3  # each key asked once
        for t in asked:
            assert xi[t] in keys and yi[t] == values[keys.index(xi[t])]  # the target is the key's value
        assert all(target == IGNORE for t, target in enumerate(yi) if t not in asked)
    assert recall_metrics(copier(x, 4), x, y, 4)["accuracy"] == 1.0  # the inputs alone determine every target
    xb, yb = next(iter(data.train_dataloader()))  # the training stream has the same structure
    assert xb.shape == (4, 32) and (yb != IGNORE).sum(1).tolist() == [3] * 4
    assert torch.equal(copier(xb, 4)[yb != IGNORE], yb[yb != IGNORE])
    assert data.unigram_entropy("train") == data.unigram_entropy("val") == pytest.approx(math.log(16))
    assert data.tokenizer.encode("0 5 31").ids == [0, 5, 31]


def test_the_stream_is_the_seeds_and_validation_is_every_runs() -> None:
    a, b, other = small(seed=3), small(seed=3), small(seed=4)
    first = [a.train_dataset[i] for i in range(6)]
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in
               zip(first, (b.train_dataset[i] for i in range(6))))  # deterministic given the seed
    assert not torch.equal(first[0][0], other.train_dataset[0][0])  # another seed, another stream
    for one, two in zip(a.val_inputs(), other.val_inputs()):  # the validation examples: the same whatever the seed
        assert torch.equal(one, two)
    assert not torch.equal(a.val_inputs()[0][0], first[0][0])  # their own stream, not the first training examples
    assert torch.equal(torch.cat([batch[1] for batch in a.val_dataloader()]), a.val_inputs()[1])


def test_a_restored_trainer_continues_the_stream_where_it_stopped() -> None:
    straight = small(seed=3)
    batches = iter(straight.train_dataloader())
    stream = [next(batches) for _ in range(5)]
    resumed = small(seed=3)
    resumed.trainer = SimpleNamespace(global_step=3, accumulate_grad_batches=1, world_size=1, global_rank=0)
    assert resumed.state_dict()["examples"] == 12  # 3 steps of 4
    again = iter(resumed.train_dataloader())
    for want in stream[3:]:
        got = next(again)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    resumed.load_state_dict(straight.state_dict())  # the same recipe and seed: accepted quietly


def test_recall_metrics_of_a_perfect_copier_and_a_constant_guess() -> None:
    data = small(val_windows=2000)
    x, y = data.val_inputs()
    right = F.one_hot(y.clamp(min=0), data.vocab_size).float()  # logits built to be right at every query
    perfect = recall_metrics(right, x, y, 4)
    assert perfect["accuracy"] == 1.0 and perfect["queries"] == 6000 and perfect["examples"] == 2000
    assert perfect["by_query"] == [1.0] * 3 and perfect["by_key_position"] == [1.0] * 4
    constant = torch.zeros(2000, 32, data.vocab_size)
    constant[..., data.task.first_value] = 1.0  # always the first value: right as often as a guess
    guess = recall_metrics(constant, x, y, 4)
    assert guess["accuracy"] == pytest.approx(data.task.chance_accuracy, abs=0.015)
    assert data.figures()["recall_chance_accuracy"] == 1 / 16


def test_recall_metrics_by_hand() -> None:
    # 1 example, 2 pairs (keys 1, 2; values 5, 6), queries at 4 (key 2) and 6 (key 1); the model gets key 2 only
    x = torch.tensor([[1, 5, 2, 6, 2, 0, 1, 3]])
    y = torch.full_like(x, IGNORE)
    y[0, 4], y[0, 6] = 6, 5
    pred = torch.tensor([[0, 0, 0, 0, 6, 0, 6, 0]])
    m = recall_metrics(pred, x, y, 2)
    assert m["accuracy"] == 0.5 and m["by_query"] == [1.0, 0.0] and m["by_key_position"] == [0.0, 1.0]
    unasked = recall_metrics(pred[:, :5], x[:, :5], y[:, :5], 2)  # key 1 never asked: no accuracy for it
    assert unasked["by_key_position"] == [None, 1.0]


def test_bad_keys_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"data\.n_pairs=8 with data\.n_queries=8 needs .* = 32 positions, more than "
                                         r"model\.max_seq_len=16: at most data\.n_pairs=4 fits"):
        small(n_pairs=8, n_queries=None, seq_len=16, vocab_size=64)
    with pytest.raises(ValueError, match=r"data\.n_pairs=7 with data\.n_queries=2 .* at most data\.n_pairs=6 fits"):
        small(n_pairs=7, n_queries=2, seq_len=16, vocab_size=64)
    with pytest.raises(ValueError, match=r"data\.vocab_size=16 has 7 keys .* data\.n_pairs=8 .* "
                                         r"data\.vocab_size >= 18 fits"):
        small(n_pairs=8, n_queries=None, vocab_size=16)
    with pytest.raises(ValueError, match=r"data\.n_queries=5 must be at most data\.n_pairs=4"):
        small(n_queries=5)
    with pytest.raises(ValueError, match=r"data\.n_pairs=0 must be an integer >= 1"):
        small(n_pairs=0)
    with pytest.raises(ValueError, match=r"data\.power_a=0 must be a float > 0"):
        small(power_a=0)
    with pytest.raises(ValueError, match=r"does not take \['data\.tokenizer'\]"):
        small(tokenizer="char")


def test_a_resume_with_another_task_is_refused_before_the_fit() -> None:
    from lmlab.run.plan import check_same_data

    saved = {"MQARDataModule": small().state_dict()}
    check_same_data("resume", small(), saved)
    with pytest.raises(ValueError, match=r"data=mqar \(data\.n_pairs.*\) is not the data the checkpoint was trained"):
        check_same_data("resume", small(n_pairs=5), saved)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_loss_counts_the_queries_only(chunked: bool) -> None:
    cfg = compose(["data=mqar", "data.n_pairs=4", "data.vocab_size=32", "model.max_seq_len=32", "model.n_layer=1",
                   "model.d_model=32", "model.n_head=2", f"model.chunked_loss={str(chunked).lower()}"])
    data = _build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=32, seed=0)
    model = build_model(cfg, vocab_size=data.vocab_size)
    x, y = data.val_inputs()
    x, y = x[:8], y[:8]
    asked = y != IGNORE
    logits = model(x)
    want = F.cross_entropy(logits[asked].float(), y[asked])  # the queries' loss alone
    assert model(x, y).item() == pytest.approx(want.item(), rel=1e-5)
    model(x, y).backward()  # and training through it: no gradient from the ignored positions is asked
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_train_py_data_mqar_composes() -> None:
    cfg = compose(["data=mqar"])
    assert (cfg.data.name, cfg.data.n_pairs, cfg.data.vocab_size) == ("mqar", 8, 8192)
    check_config(cfg)
    data = _build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len, seed=0)
    assert isinstance(data, MQARDataModule) and data.task.n_queries == 8 and data.vocab_size == 8192
    hybrid = compose(["data=mqar", "mixer=linear", "mixer.pattern=[linear,attention]", "position=rope"])
    check_config(hybrid)  # the study's stacks compose with it


def _fake_recall_run(sweep: Path, mixer: str, seed: int, by_key: list[float]) -> None:
    run = sweep / f"mixer={mixer},seed={seed}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 10,
                                                  "overrides": [f"mixer={mixer}", f"seed={seed}"]}))
    recall = {"step": 10, "n_pairs": 2, "n_queries": 2, "chance_accuracy": 1 / 16, "by_query": by_key,
              "by_key_position": by_key, "accuracy": sum(by_key) / 2}
    (run / "recall.json").write_text(json.dumps(recall))


def test_compare_tables_and_plots_the_recall(tmp_path: Path) -> None:
    from lmlab.analysis.compare import compare

    sweep = tmp_path / "sweep"
    _fake_recall_run(sweep, "attention", 0, [1.0, 1.0])
    _fake_recall_run(sweep, "linear", 0, [0.0, 0.5])
    _fake_recall_run(sweep, "linear", 1, [0.5, 0.5])
    _, md = compare(sweep)
    assert "MQAR recall" in md
    with open(sweep / "compare_recall.csv") as f:
        rows = {r["mixer"]: r for r in csv.DictReader(f)}
    assert list(rows["linear"]) == ["mixer", "n", "step", "n_pairs", "n_queries", "accuracy", "chance_accuracy"]
    assert rows["linear"]["n"] == "2" and float(rows["linear"]["accuracy"]) == pytest.approx(0.375)  # seeds averaged
    assert float(rows["attention"]["accuracy"]) == 1.0 and float(rows["attention"]["chance_accuracy"]) == 1 / 16
    assert (sweep / "plots" / "mqar_recall.png").stat().st_size > 1000
    assert not (sweep / "compare_probe.csv").exists()  # the probe's section stays out of it
