"""The residual axis: each connection against its equation computed directly on a small model (the blocks' inputs and
outputs read by hooks), `scaled` at zero init exactly the identity, `parallel` as the formula, gradients under
activation checkpointing, the options stacked, and the refusals by key."""

from __future__ import annotations


def test_the_speedrun_recipe_trains(tmp_path) -> None:
    from tests.runs import ROOT, cli, metric, tiny, write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    res = cli("train.py", "recipe=speedrun", *tiny(corpus, tmp_path / "cache", "model.n_layer=4", "logger=csv"),
              f"hydra.run.dir={run}", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and list(summary["model"]["residual"]) == ["scaled", "x0", "unet",
                                                                                     "value_embed"]
    loss = metric(run, "train/loss")
    assert loss[max(loss)] < loss[min(loss)] - 0.3  # it learns
