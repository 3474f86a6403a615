"""compare's speed section (issue 60): each variant's achieved model FLOP/s (tokens/s x train FLOPs per token) against
the baseline's, and a variant below 0.67x flagged implementation-bound, naming the path lmlab runs it on — a deeper
model with fewer tokens/s but as many FLOP/s is not flagged; a windowed model and an MoE at half the FLOP/s are."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lmlab.analysis.compare import compare
from lmlab.analysis.compare_speed import IMPLEMENTATION_BOUND, model_flops_per_s, slow_paths

DENSE = {"attention": {"name": "mha", "window": None, "pattern": None, "doc_mask": False, "softcap": None},
         "ffn": {"name": "mlp"}, "mixer": {"name": "attention", "pattern": None}}


def _run(sweep: Path, overrides: list[str], tokens_per_s: float, flops_per_token: float, config: dict) -> None:
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "status": "completed", "steps": 10, "overrides": overrides, "final_val_loss": 2.0, "best_val_loss": 2.0,
        "unigram_val_loss": 3.0, "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token, "device": "cpu",
        "config": config}))


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {r["variant"]: r for r in csv.DictReader(f)}


def test_variants_below_the_bound_are_flagged_naming_their_path(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # (variant, tokens/s per seed, FLOPs per token, config): FLOP/s 6e9 (dense), 3e9, 2.7e9, 7.2e9
    cases = [("dense", (1000.0, 1000.0), 6e6, DENSE),
             ("window", (480.0, 520.0), 6e6, {**DENSE, "attention": {**DENSE["attention"], "window": 64}}),
             ("moe", (900.0, 900.0), 3e6, {**DENSE, "ffn": {"name": "moe", "n_experts": 8, "top_k": 2}}),
             ("deep", (600.0, 600.0), 1.2e7, DENSE)]
    for name, speeds, flops, config in cases:
        for seed, tps in enumerate(speeds):
            _run(sweep, [f"variant={name}", f"seed={seed}"], tps, flops, config)
    _, md = compare(sweep, baseline="dense")
    rows = _rows(sweep / "compare_speed.csv")
    want = {"dense": 1.0, "window": 3e9 / 6e9, "moe": 2.7e9 / 6e9, "deep": 7.2e9 / 6e9}
    for name, ratio in want.items():
        assert float(rows[f"variant={name}"]["vs_baseline"]) == pytest.approx(ratio)
        assert rows[f"variant={name}"]["implementation_bound"] == str(ratio < IMPLEMENTATION_BOUND)
    assert float(rows["variant=window"]["model_flops_per_s"]) == pytest.approx(3e9)  # the mean over its two seeds
    assert rows["variant=window"]["paths"] == "mask (window 64): lmlab's banded SDPA"
    assert rows["variant=moe"]["paths"] == "router (ffn=moe, 8 experts, top 2): routing and dispatch"
    notes = [line for line in md.splitlines() if line.startswith("Note:") and "implementation-bound" in line]
    assert len(notes) == 2 and any("variant=window runs at 0.50x" in n for n in notes)
    assert any("variant=moe runs at 0.45x" in n for n in notes)
    assert "variant=deep" not in "".join(notes)  # fewer tokens/s, as many FLOP/s: the architecture's own cost


def test_the_figure_and_the_paths_of_each_kind_of_run() -> None:
    assert model_flops_per_s({"model_flops_per_s": 5e9, "tokens_per_s": 1.0, "flops_per_token": 1.0}) == 5e9
    assert model_flops_per_s({"tokens_per_s": 2000.0, "flops_per_token": 3e6}) == pytest.approx(6e9)  # older runs
    assert model_flops_per_s({"tokens_per_s": None, "flops_per_token": 3e6}) is None
    assert slow_paths(DENSE, "cuda") == []
    hybrid = {**DENSE, "mixer": {"name": "gdn", "pattern": ["gdn", "gdn", "gdn", "attention"]},
              "attention": {**DENSE["attention"], "doc_mask": True, "softcap": 30.0}}
    assert slow_paths(hybrid, "cuda") == ["mask (documents, softcap 30.0): FlexAttention",
                                          "mixer (gdn): lmlab's PyTorch chunked path"]
    assert slow_paths(hybrid, "cuda", "fla")[-1] == "mixer (gdn): fla's kernels"  # the path the run recorded


def test_one_variant_or_no_figures_adds_no_section(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        _run(sweep, ["variant=dense", f"seed={seed}"], 1000.0, 6e6, DENSE)
    _, md = compare(sweep)
    assert not (sweep / "compare_speed.csv").exists() and "FLOP/s" not in md


def test_a_runs_recorded_speed_is_tokens_per_s_times_its_flops_per_token() -> None:
    """summary.json's model_flops_per_s and mfu (lmlab.run.perf.Throughput.figures), counted by hand: 2,000 tokens/s
    x 3e6 FLOPs per token on 2 devices of peak 1e10 each."""
    from lmlab.run.perf import Throughput

    got = Throughput(3e6, peak=1e10).figures(2000.0, world_size=2)
    assert got["model_flops_per_s"] == pytest.approx(6e9) and got["mfu"] == pytest.approx(6e9 / 2e10)
    assert Throughput(3e6).figures(2000.0, 1)["mfu"] is None and Throughput(3e6).figures(None, 1)[
        "model_flops_per_s"] is None
    assert model_flops_per_s({"model_flops_per_s": got["model_flops_per_s"]}) == pytest.approx(6e9)
