"""Su's position probe (data=position_probe, lmlab/data/probe.py): the task's data, its per-position metrics against a
hand computation, the study's sweep composing pair by pair, the position-blindness argument on the model itself, a
short training run leaving probe.json and summary figures, and compare's probe table and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from lmlab import CONF_DIR, build_model, compose
from lmlab.analysis.compare import compare
from lmlab.data import build_datamodule as _build_datamodule
from lmlab.data.probe import PositionProbeDataModule, position_metrics, probe_pair
from lmlab.run.training import check_config

SWEEP = yaml.safe_load((CONF_DIR / "experiment" / "position_probe.yaml").read_text())["hydra"]["sweeper"]["params"]
PAIRS = [(p, s) for p in SWEEP["position"].split(",") for s in SWEEP["attention.score"].split(",")]


def build_datamodule(cfg):
    return _build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len,
                             seed=cfg.seed)


def test_the_probe_is_zeros_in_and_positions_out() -> None:
    data = build_datamodule(compose(["data=position_probe", "model.max_seq_len=8", "data.val_windows=3"]))
    assert isinstance(data, PositionProbeDataModule) and data.vocab_size == 9  # token 0 and the positions 1 .. 8
    x, y = next(iter(data.train_dataloader()))
    assert x.tolist() == [[0] * 8] and y.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]  # batch_size 1: Su's [1, ..., n]
    vx, vy = data.val_inputs()
    assert vx.shape == (3, 8) and (vx == 0).all() and (vy == torch.arange(1, 9)).all()
    again = PositionProbeDataModule({"val_windows": 3}, seq_len=8, seed=7).val_inputs()  # any seed, any call
    assert all(torch.equal(a, b) for a, b in zip((vx, vy), again))
    batches = [b for b in data.val_dataloader()]
    assert torch.equal(torch.cat([b[1] for b in batches]), vy)
    assert data.unigram_entropy("val") == pytest.approx(math.log(8))  # uniform over 8 positions
    assert data.tokenizer.encode("0 0 3 8").ids == [0, 0, 3, 8]


def test_bad_probe_keys_are_refused() -> None:
    with pytest.raises(ValueError, match=r"does not take \['tokenizer'\]"):
        PositionProbeDataModule({"name": "position_probe", "tokenizer": "char"}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="data.batch_size=0 must be an integer >= 1"):
        PositionProbeDataModule({"batch_size": 0}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="model.max_seq_len=1 must be at least 2"):
        PositionProbeDataModule({}, seq_len=1, seed=0)


def test_position_metrics_by_hand() -> None:
    # 2 windows x 3 positions, vocab 4; targets 1, 2, 3. Argmaxes: window 0 -> 1, 3, 3; window 1 -> 1, 0, 1 (a tie
    # between classes 1 and 2 goes to 1).
    targets = torch.tensor([[1, 2, 3], [1, 2, 3]])
    logits = torch.full((2, 3, 4), -9.0)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 2, 3] = 0.0
    logits[1, 0, 1] = logits[1, 1, 0] = 0.0
    logits[1, 2, 1] = logits[1, 2, 2] = 0.0
    m = position_metrics(logits, targets)
    assert m["position"] == [1, 2, 3] and m["windows"] == 2
    assert m["accuracy"] == [1.0, 0.0, 0.5]  # position 3: right in window 0 only
    assert m["error"] == [0.0, 1.5, 1.0]  # |3−2| and |0−2|; |3−3| and |1−3|
    assert m["prediction"] == [1.0, 1.5, 2.0]
    assert m["mean_accuracy"] == pytest.approx(0.5) and m["mean_error"] == pytest.approx(2.5 / 3)
    p1 = 1 / (1 + 3 * math.exp(-9))  # the one class at 0 among -9s
    p_tie = 1 / (2 + 2 * math.exp(-9))
    other = math.exp(-9) * p1  # a class at -9 beside one at 0
    expected = [p1, (other + other) / 2, (p1 + math.exp(-9) * p_tie) / 2]  # window 1, position 3: 3 is at -9
    assert m["p_true"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("position", "score"), PAIRS, ids=[f"{p}-{s}" for p, s in PAIRS])
def test_every_swept_pair_composes_and_builds(position: str, score: str) -> None:
    cfg = compose(["experiment=position_probe", f"position={position}", f"attention.score={score}"])
    assert (cfg.data.name, cfg.position.name, cfg.attention.score, cfg.model.max_seq_len) == (
        "position_probe", position, score, 64)
    check_config(cfg)
    data = build_datamodule(cfg)
    model = build_model(cfg, vocab_size=data.vocab_size)
    x, _ = data.val_inputs()
    assert model(x).shape == (1, 64, 65)


@pytest.mark.parametrize(("position", "score", "blind"), [
    ("none", "softmax", True), ("none", "softmax_plus", True), ("none", "relu2", True),  # relu2: Σ relu²(c)/(i+1)
    ("rope", "softmax", True), ("alibi", "softmax", True), ("rope", "softmax_plus", True),  # weights only, rows sum 1
    ("alibi", "softmax_plus", True), ("rope", "relu2", False), ("alibi", "relu2", False),
    ("learned", "softmax", False), ("sinusoidal", "softmax", False), ("learned", "relu2", False),
])
def test_which_models_see_the_same_thing_everywhere(position: str, score: str, blind: bool) -> None:
    """The argument the probe tests, on an untrained model (random weights): the logits at every position of the
    all-zero input are equal (to float rounding) exactly when the scheme acts only on attention weights whose rows
    sum to one, or when relu2 has no positions."""
    cfg = compose(["experiment=position_probe", f"position={position}", f"attention.score={score}",
                   "init=xavier", "model.max_seq_len=16"])
    model = build_model(cfg, vocab_size=17).eval()
    with torch.no_grad():
        logits = model(probe_pair(16)[0][None])[0]  # (16, 17)
    spread = (logits - logits[0]).abs().max().item() / logits.abs().max().item()
    assert (spread < 1e-5) == blind, spread


def _fake_probe_run(sweep: Path, position: str, accuracy: list[float], error: list[float]) -> None:
    run = sweep / f"position={position}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 10,
                                                  "overrides": [f"position={position}"]}))
    probe = {"step": 10, "chance_accuracy": 1 / 3, "position": [1, 2, 3], "accuracy": accuracy, "error": error,
             "p_true": [0.5] * 3, "mean_accuracy": sum(accuracy) / 3, "mean_error": sum(error) / 3,
             "mean_p_true": 0.5}
    (run / "probe.json").write_text(json.dumps(probe))


def test_compare_tables_and_plots_the_probe(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _fake_probe_run(sweep, "none", [0.0, 1.0, 0.0], [1.0, 0.0, 1.0])
    _fake_probe_run(sweep, "learned", [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    _, md = compare(sweep)
    assert "Position probe" in md
    rows = {r.split(",")[0]: r.split(",") for r in (sweep / "compare_probe.csv").read_text().splitlines()}
    assert rows["position"] == ["position", "n", "step", "accuracy", "error", "p_true", "chance_accuracy"]
    assert float(rows["none"][3]) == pytest.approx(1 / 3) and float(rows["none"][4]) == pytest.approx(2 / 3)
    assert float(rows["learned"][3]) == 1.0 and float(rows["learned"][4]) == 0.0
    assert (sweep / "plots" / "position_probe.png").stat().st_size > 1000
