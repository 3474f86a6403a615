"""compile=true|reduce-overhead|max-autotune (issue 60: CUDA graphs offered where the step is static): the mode
reaches torch.compile, a wrong value is refused naming the key and the choices, and FSDP2 (per-block compile inside
its hooks) is refused with a mode."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose
from lmlab.run.checks import check_config
from lmlab.run.lit import compile_mode

SMALL = ["model.n_layer=1", "model.d_model=32", "model.n_head=2"]


def test_the_mode_reaches_torch_compile(monkeypatch) -> None:
    from lmlab.config import arch_config
    from lmlab.run.lit import LitGPT

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    cfg = compose(SMALL)
    for value in (True, "reduce-overhead", "max-autotune"):
        LitGPT(model=arch_config(cfg, vocab_size=20).to_dict(), optim=dict(cfg.optim), schedule=dict(cfg.schedule),
               max_steps=10, compile=value)
    assert seen == [{}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"}]
    assert compile_mode(True) == {} and compile_mode("reduce-overhead") == {"mode": "reduce-overhead"}


def test_bad_modes_and_fsdp2_are_refused() -> None:
    check_config(compose(["compile=reduce-overhead", *SMALL]))
    with pytest.raises(ValueError, match=r"compile='fast' must be .*reduce-overhead"):
        check_config(compose(["compile=fast", *SMALL]))
    with pytest.raises(ValueError, match=r"compile=reduce-overhead with trainer=fsdp2"):
        check_config(compose(["compile=reduce-overhead", "trainer=fsdp2", "trainer.accelerator=cpu",
                              "trainer.devices=2", *SMALL]))
