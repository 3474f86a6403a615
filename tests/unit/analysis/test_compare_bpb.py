"""compare and bits per byte (issue 62): a bpb column beside the val loss; runs trained with different tokenizers are
ranked by bpb, best first, their significance tested on it, and the report says so in one line, because nats per
token are not comparable across tokenizers. Runs of one tokenizer keep their order and their val-loss ranking."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lmlab.analysis.compare import compare

TOKENIZERS = {"char": {"tokenizer": "char", "vocab_size": 4096}, "bpe": {"tokenizer": "bpe", "vocab_size": 300}}


def _run(sweep: Path, overrides: list[str], data: dict, best: float, bpb: float | None) -> Path:
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    summary = {"status": "completed", "steps": 3, "overrides": overrides, "final_val_loss": best + 0.1,
               "best_val_loss": best, "unigram_val_loss": 3.0, "peak_grad_norm": 1.5, "tokens_per_s": 1000.0,
               "diverged_at_step": None, "config": {"data": {"name": "text_files", **data}}}
    if bpb is not None:
        summary.update(final_val_bpb=bpb + 0.01, best_val_bpb=bpb)
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.csv").write_text("step,train/loss\n0,4.0\n1,3.0\n")
    return run


def _read(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_runs_of_different_tokenizers_are_ranked_by_bpb_and_the_report_says_so(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # char: the lower loss per token (a token is a character) but the worse bits per byte
    _run(sweep, ["data.tokenizer=char"], TOKENIZERS["char"], best=1.4, bpb=2.1)
    _run(sweep, ["data.tokenizer=bpe"], TOKENIZERS["bpe"], best=3.0, bpb=1.6)
    _run(sweep, ["data.tokenizer=bpe", "head=mlm"], TOKENIZERS["bpe"], best=0.5, bpb=None)  # no bpb: last
    rows, md = compare(sweep)
    table = _read(sweep / "compare.csv")
    assert [(r["data.tokenizer"], r["head"]) for r in table] == [("bpe", ""), ("char", ""), ("bpe", "mlm")]
    assert [float(r["best_val_bpb"]) for r in table[:2]] == [1.6, 2.1] and table[2]["best_val_bpb"] == ""
    assert float(table[0]["final_val_bpb"]) == pytest.approx(1.61)
    said = [line for line in md.splitlines() if "bits per byte" in line]
    assert len(said) == 1 and "different tokenizers" in said[0] and "best_val_bpb" in said[0]
    assert "bpe (vocab_size 300)" in said[0] and "char" in said[0]
    header = (sweep / "compare.md").read_text().splitlines()
    assert any("bits per byte" in line for line in header)  # the written report says it too
    cols = list(table[0])
    at = cols.index("best_val_loss")
    assert cols[at + 1: at + 3] == ["final_val_bpb", "best_val_bpb"]  # beside the val loss


def test_one_tokenizer_keeps_the_order_and_says_nothing(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _run(sweep, ["norm=layer"], TOKENIZERS["bpe"], best=2.0, bpb=1.2)
    _run(sweep, ["norm=rms"], TOKENIZERS["bpe"], best=2.2, bpb=1.1)  # (a made-up disagreement: the order stays)
    _, md = compare(sweep)
    assert [r["norm"] for r in _read(sweep / "compare.csv")] == ["layer", "rms"]
    assert "bits per byte" not in md


def test_significance_across_tokenizers_is_on_bpb(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    figures = {("char", 1): (1.4, 2.10), ("char", 2): (1.5, 2.20), ("bpe", 1): (3.0, 1.60), ("bpe", 2): (3.2, 1.65)}
    for (kind, seed), (best, bpb) in figures.items():
        _run(sweep, [f"data.tokenizer={kind}", f"seed={seed}"], TOKENIZERS[kind], best=best, bpb=bpb)
    _, md = compare(sweep, baseline="data.tokenizer=char")
    (row,) = _read(sweep / "compare_significance.csv")
    assert float(row["diff_mean"]) == pytest.approx(((1.60 - 2.10) + (1.65 - 2.20)) / 2)  # bpe - char, in bpb
    assert "best val bpb" in md
    variants = {r["data.tokenizer"]: r for r in _read(sweep / "compare_variants.csv")}
    assert float(variants["bpe"]["best_val_bpb_mean"]) == pytest.approx(1.625)
    assert list(variants) == ["bpe", "char"]  # ranked by bpb
