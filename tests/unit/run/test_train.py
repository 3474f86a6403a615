"""End to end on CPU: train.py -> run directory -> eval.py; resume continues the curve; divergence is a result."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import metric, tiny


@pytest.mark.parametrize("scaler", [None, "a GradScaler"])
def test_fp16_loss_scaling_gets_the_unfused_optimizer(scaler) -> None:
    """Lightning unscales fp16 gradients before clipping only for unfused optimizers (and Lightning turns fp16 into
    bf16 on CPU, so no CPU run can show it): with a loss scaler, optim.fused=null builds the unfused AdamW."""
    from types import SimpleNamespace

    from lmlab.config import arch_config
    from lmlab.run.lit import LitGPT

    cfg = compose(["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.max_seq_len=8",
                   "model.vocab_size=20"])
    lit = LitGPT(model=arch_config(cfg, vocab_size=20).to_dict(), optim=dict(cfg.optim), schedule=dict(cfg.schedule),
                 max_steps=10)
    lit._trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    assert bool(lit.configure_optimizers()["optimizer"].defaults["fused"]) == (scaler is None)


def test_progress_lines_show_each_figure_once_when_it_is_fresh(corpus: Path, tmp_path: Path, capsys) -> None:
    """Logged every 7 steps, printed every step: a line shows the loss and speed only when they were logged since the
    line before (tagged with their step when it is not the line's), never a stale figure again; the losses printed
    are metrics.csv's."""
    import re

    from lmlab import compose
    from lmlab.run.training import train

    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=30", "trainer.log_every_n_steps=7",
                       "trainer.enable_progress_bar=true")), run)
    lines = re.findall(r"^step (\d+)/30(.*)$", capsys.readouterr().out, flags=re.M)
    assert [int(s) for s, _ in lines] == list(range(1, 31))  # every 30 // 20 = 1 step
    shown = {int(s): rest for s, rest in lines if "loss" in rest}
    # a line counts the steps done, metrics.csv numbers them from 0
    logged = {step + 1: v for step, v in metric(run, "train/loss").items()}
    assert sorted(shown) == sorted(logged) == [7, 14, 21, 28], (shown, logged)
    for step, rest in shown.items():
        assert re.search(rf"loss {logged[step]:.4f}  [\d,]+ tok/s  eta", rest), (step, rest)
    assert sum("tok/s" in rest for _, rest in lines) == len(shown)  # the speed too: once per logging step


def test_a_continued_run_first_says_where_from_which_step_and_what_it_kept(corpus: Path, tmp_path: Path,
                                                                         capsys) -> None:
    """Continued with the run's own overrides and one of the command's: the first line names the directory, the step
    and both; Lightning's "Checkpoint directory ... exists and is not empty", which read like a fault, is not shown. A
    fresh start says nothing of the kind."""
    import warnings

    run, cache = tmp_path / "run", tmp_path / "cache"
    own = ["norm=rms", "ffn=swiglu"]
    train(compose(tiny(corpus, cache, *own)), run, overrides=own)
    assert "continuing" not in capsys.readouterr().out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose(tiny(corpus, cache, *own, "trainer.max_steps=40")), run, overrides=[*own, "trainer.max_steps=40"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"continuing {run} from step 30, its overrides kept: norm=rms ffn=swiglu; this command's: " \
                     f"trainer.max_steps=40", out[:3]
    assert not [w for w in caught if "Checkpoint directory" in str(w.message)]
    train(compose(tiny(corpus, cache, *own, "trainer.max_steps=50")), run)  # library use: no command to name
    assert capsys.readouterr().out.splitlines()[0] == f"continuing {run} from step 40"
