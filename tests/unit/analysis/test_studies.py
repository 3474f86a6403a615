"""lmlab.analysis.studies on sweeps written by hand: steps to a target, the best lr per width, the coordinate check's
ratio,
and the state bytes per parameter of each optimizer (AdamW 8, Muon 4 on its matrices)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.analysis.studies import (
    coord_check,
    lr_transfer,
    residual_placement,
    speedrun_ladder,
    state_bytes_per_param,
    steps_to,
)
from lmlab.config import arch_config
from lmlab.model.resolve import resolve


def _run(root: Path, name: str, config: dict, rows: list[dict], status: str = "completed", **summary) -> None:
    d = root / name
    d.mkdir(parents=True)
    keys = sorted({k for r in rows for k in r})
    (d / "metrics.csv").write_text(",".join(keys) + "\n" + "".join(
        ",".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"status": status, "overrides": [], "config": config, **summary}))


def _ladder_run(root: Path, row: str, seed: int, curve: list[tuple[int, float]], **summary) -> None:
    _run(root, f"{row}-{seed}", {"residual": {"standard": {}}, "placement": {"name": "pre"}},
         [{"step": s, "val/loss": v} for s, v in curve], final_val_loss=curve[-1][1],
         **{"overrides": [f"speedrun_step={row}", f"seed={seed}"], **summary})


def test_steps_to_target() -> None:
    assert steps_to([(25, 3.0), (50, 2.4), (75, 2.1)], 2.4) == 50
    assert steps_to([(25, 3.0)], 2.0) is None


def test_lr_transfer_stars_each_widths_best_lr(tmp_path: Path) -> None:
    losses = {("sp", 64): [2.0, 1.8, 2.2], ("sp", 128): [1.9, 2.0, 2.5], ("mup", 64): [2.0, 1.8, 2.2],
              ("mup", 128): [1.9, 1.7, 2.1]}
    for (param, width), values in losses.items():
        for lr, loss in zip((1e-3, 3e-3, 1e-2), values):
            _run(tmp_path, f"{param}{width}{lr}", {"param": {"name": param}, "model": {"d_model": width},
                                                    "optim": {"lr": lr}}, [{"step": 0, "val/loss": loss}],
                 best_val_loss=loss)
    table = lr_transfer(tmp_path).splitlines()
    assert table[2] == "| sp | 64 | 2.000 | **1.800** | 2.200 | 0.003 |"
    assert table[3] == "| sp | 128 | **1.900** | 2.000 | 2.500 | 0.001 |"  # the best lr moved under sp
    assert table[5] == "| mup | 128 | 1.900 | **1.700** | 2.100 | 0.003 |"
    assert (tmp_path / "lr_transfer.png").stat().st_size > 0


def test_coord_check_ratio(tmp_path: Path) -> None:
    for param, rms in (("sp", {64: 1.0, 128: 4.0}), ("mup", {64: 1.0, 128: 1.1})):
        for width, v in rms.items():
            rows = [{"step": t, "act/rms/layer_00": 0.5, "act/rms/layer_01": v * t} for t in (1, 2)]
            _run(tmp_path, f"{param}{width}", {"param": {"name": param}, "model": {"d_model": width}}, rows)
    table = coord_check(tmp_path)
    assert "| sp | 2 | 8 | 4.00x |" in table  # the last step (2): act/rms of the last layer per width
    assert "| mup | 2 | 2.2 | 1.10x |" in table
    assert (tmp_path / "mup_coord_check.png").stat().st_size > 0


@pytest.mark.parametrize(("optim", "expected"), [("adamw", 8.0), ("lamb", 8.0), ("schedulefree", 8.0), ("lion", 4.0),
                                                 ("muon", None)])
def test_state_bytes_per_parameter(optim: str, expected: float | None) -> None:
    """Two fp32 moments (8 bytes) for AdamW, LAMB and schedule-free (z and v: x is derived), plus a step counter per
    tensor; Muon keeps one momentum buffer (4 bytes) on its matrices and AdamW's 8 on the rest."""
    cfg = compose([f"optim={optim}", "model.n_layer=2", "model.d_model=64"])
    model = resolve(arch_config(cfg, vocab_size=50)).to_dict()
    got = state_bytes_per_param({"model": model, "config": OmegaConf.to_container(cfg, resolve=True)})
    if expected is None:
        d, L, V = 64, 2, 50
        hidden = L * (4 * d * d + 2 * 4 * d * d)  # qkv + proj, fc + proj (hidden_mult 4)
        total = hidden + V * d + 128 * d + (2 * L + 1) * d * 2  # tied embedding, learned positions, LayerNorms
        expected = (4 * hidden + 8 * (total - hidden)) / total
    assert got == pytest.approx(expected, rel=0.01)


def test_speedrun_ladder_orders_the_rows_and_pairs_each_with_the_one_before(tmp_path: Path) -> None:
    """Rows in ladder order; Δ is the paired mean over seeds of row − row before; steps to the first row's final loss
    are interpolated on each seed's val curve and averaged."""
    _ladder_run(tmp_path, "00_gpt2", 0, [(0, 4.0), (100, 3.0), (200, 2.0)])
    _ladder_run(tmp_path, "00_gpt2", 1, [(0, 4.0), (100, 3.2), (200, 2.2)])
    _ladder_run(tmp_path, "01_rope", 0, [(0, 4.0), (100, 2.5), (200, 1.5)])  # reaches 2.2 at step 100 + 0.3·100
    _ladder_run(tmp_path, "01_rope", 1, [(0, 4.0), (100, 2.1), (200, 1.6)])  # at (4.0 − 2.2) / (4.0 − 2.1)·100
    _ladder_run(tmp_path, "02_muon", 0, [(0, 4.0), (100, 3.9)], status="diverged")
    table = speedrun_ladder(tmp_path).splitlines()
    assert table[0] == "target val loss 2.2"  # the first row's highest final: each of its seeds gets there
    # seed 0 reaches 2.2 at 100 + 0.8·100 = 180, seed 1 at its end, 200
    assert table[4] == "| 00_gpt2 | llm.c baseline: 45 min | 2.100 ± 0.141 | — | 190 | completed |"
    # Δ: (1.5 − 2.0, 1.6 − 2.2) = (−0.5, −0.6): mean −0.55, sd 0.0707, t = −11, p = 0.058 (1 df)
    assert table[5].startswith("| 01_rope | #2: 45 → 31.4 min")
    assert "| -0.550 (p=0.058) | 112 | completed |" in table[5]  # (130 + 94.7) / 2
    assert table[6].endswith("| — | — | not reached | diverged |")  # no completed seed: no final, no Δ
    assert (tmp_path / "speedrun_ladder_val_loss.png").stat().st_size > 0


def test_residual_placement_grid_says_how_each_run_ended(tmp_path: Path) -> None:
    for residual, placement, status, loss in (("standard", "pre", "completed", 2.5), ("standard", "post",
                                               "collapsed", 3.36), ("unet", "post", "completed", 2.6)):
        _run(tmp_path, f"{residual}-{placement}", {"residual": {residual: {}}, "placement": {"name": placement}},
             [{"step": 0, "val/loss": loss}], status=status, final_val_loss=loss, steps=150)
    _run(tmp_path, "rezero", {"residual": {"scaled": {}}, "placement": {"name": "post"}}, [{"step": 0, "val/loss": 2}],
         final_val_loss=2.0, overrides=["residual=scaled", "residual.scaled.branch_init=0"])
    table = residual_placement(tmp_path).splitlines()
    assert table[0] == "| residual | pre | post |"
    assert table[2] == "| standard | 2.500 | collapsed (step 150) |"
    assert "| scaled (ReZero: branch_init=0) | — | 2.000 |" in table  # no run of that pair in the sweep
    assert "| unet | — | 2.600 |" in table
