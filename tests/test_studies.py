"""lmlab.studies on sweeps written by hand: steps to a target, the best lr per width, the coordinate check's ratio,
and the state bytes per parameter of each optimizer (AdamW 8, Muon 4 on its matrices)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.config import arch_config
from lmlab.model.resolve import resolve
from lmlab.studies import coord_check, lr_transfer, state_bytes_per_param, steps_to


def _run(root: Path, name: str, config: dict, rows: list[dict], status: str = "completed", **summary) -> None:
    d = root / name
    d.mkdir(parents=True)
    keys = sorted({k for r in rows for k in r})
    (d / "metrics.csv").write_text(",".join(keys) + "\n" + "".join(
        ",".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"status": status, "overrides": [], "config": config, **summary}))


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
