"""A run directory written by the previous lmlab (tests/golden/run_0db55d9: main at 0db55d9, before the derived sizes
were declared and saved; its YaRN scaling's original_max_len is null) still evaluates, exports and resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.runs import ROOT, cli, metric

OLD = ROOT / "tests" / "golden" / "run_0db55d9"
# The overrides it was trained with (its .hydra/overrides.yaml), the corpus and cache moved to this test's own
ARGS = ["data=text_files", "data.batch_size=8", "data.val_windows=32", "trainer.val_check_interval=10",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "monitor.every_n_steps=5",
        "monitor.attn_every_n_steps=10", "schedule.warmup_steps=5", "logger=none", "threads=1", "model.n_layer=1",
        "model.d_model=16", "model.n_head=2", "model.max_seq_len=32", "ffn=swiglu", "position=rope", "norm=rms",
        "rope_scaling=yarn", "rope_scaling.factor=2"]


@pytest.fixture
def old_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(OLD, run)
    return run


def test_the_old_record_has_no_derived_sizes() -> None:
    """The premise: what the fixture holds is the old record (no ffn_hidden, original_max_len null)."""
    model = json.loads((OLD / "summary.json").read_text())["model"]
    assert "ffn_hidden" not in model and model["rope_scaling"]["original_max_len"] is None


def test_an_old_run_evaluates_to_what_the_previous_eval_gave(old_run: Path, corpus: Path, tmp_path: Path) -> None:
    """3.222942864522338: eval.py run= of this directory with main at 0db55d9 (its training measured 3.22289 on the
    same windows in its own batches). Its record names the corpus where it was trained (/tmp/oldrun/corpus): pointed
    at the same seeded corpus here, as a user who moved a run and its data would."""
    summary = json.loads((old_run / "summary.json").read_text())
    summary["config"]["data"].update(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    (old_run / "summary.json").write_text(json.dumps(summary))
    res = cli(str(ROOT / "eval.py"), f"run={old_run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    loss = json.loads((old_run / "eval" / "eval.json").read_text())["rows"][0]["loss"]
    # float32 forwards: another CPU's kernels round differently (1.7e-9 relative seen on an AVX-512 EPYC); any
    # change to what is rebuilt (an init, a size, a scaling, other windows) moves the loss by far more than 1e-6
    assert loss == pytest.approx(3.222942864522338, rel=1e-6)


def test_an_old_run_exports_to_transformers_with_the_same_logits(old_run: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from lmlab.record.rundir import load_model

    res = cli(str(ROOT / "eval.py"), f"run={old_run}", "export=hf", f"out={tmp_path / 'hf'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.arange(20).remainder(30)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, load_model(old_run)(idx), rtol=1e-5, atol=1e-5)


def test_an_old_run_resumes_where_it_stopped(old_run: Path, corpus: Path, tmp_path: Path) -> None:
    """The same corpus (tests.runs.write_corpus is seeded) and overrides, 4 more steps: the architecture check
    accepts the old record, and the curve goes on from step 20."""
    args = [*ARGS, f"data.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=24"]
    before = metric(old_run, "train/loss")
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={old_run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((old_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 24
    after = metric(old_run, "train/loss")
    assert sorted(after) == list(range(24)) and all(after[s] == before[s] for s in before)
    assert summary["model"]["ffn_hidden"] is not None  # the record the resumed run saved is the new one
