"""The block Jacobian estimate (lmlab.run.jacobian) against autograd's full Jacobian on a tiny model, and the note's
Pre/Post-Norm contrast it is for."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.run.jacobian import block_inputs, block_jacobian_norms


def _model(placement: str, n_layer: int = 3) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, n_layer=n_layer, d_model=8, n_head=2, max_seq_len=4,
                         placement={"name": placement}))


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_estimate_matches_autograds_full_jacobian(placement: str) -> None:
    model = _model(placement).eval()
    idx = torch.randint(0, 20, (1, 4))
    exact = []
    for block, (x, rest, kwargs) in zip(model.h, block_inputs(model, idx)):
        J = torch.autograd.functional.jacobian(lambda h, b=block: b(h, *rest, **kwargs), x)  # (1,4,8,1,4,8)
        exact.append(J.reshape(x.numel(), x.numel()).norm().item() / math.sqrt(x.numel()))
    estimate = block_jacobian_norms(model, idx, probes=800)
    assert estimate == pytest.approx(exact, rel=0.08)  # the estimate's relative sd: ~1/√(2·800·n/‖J‖ spread)
    few = block_jacobian_norms(model, idx, probes=4)
    assert few != estimate and few == pytest.approx(exact, rel=0.5)


def test_pre_norm_keeps_the_identity_path_post_norm_rescales_it() -> None:
    """Pre: J = I + J_F·J_N, so its RMS gain is about 1 or more (the identity is there); Post: J = J_N·(I + J_F), the
    norm divides the stream by its RMS, so a stream larger than unit RMS is shrunk at each layer."""
    idx = torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(1))
    pre = block_jacobian_norms(_model("pre", 4), idx, probes=64)
    post = block_jacobian_norms(_model("post", 4), idx, probes=64)
    assert min(pre) > 0.95  # the identity path: ‖I + J_F J_N‖ ≥ ~1 at init
    assert all(p != q for p, q in zip(pre, post))
    print("pre", [round(v, 3) for v in pre], "post", [round(v, 3) for v in post])


def test_compare_draws_each_runs_jacobian_profile_at_init_and_at_the_end(tmp_path) -> None:
    import json

    from lmlab import names
    from lmlab.analysis.compare import compare
    from lmlab.record.plots import layer_profile, read_metrics

    sweep = tmp_path / "sweep"
    gains = {"pre": ([1.2, 1.1, 1.05], [1.5, 1.3, 1.2]), "post": ([0.6, 0.5, 0.45], [0.9, 0.8, 0.7])}
    for placement, (init, end) in gains.items():
        run = sweep / f"placement={placement}"
        run.mkdir(parents=True)
        run.joinpath("summary.json").write_text(json.dumps({
            "status": "completed", "steps": 20, "overrides": [f"placement={placement}"], "final_val_loss": 2.0}))
        cols = [f"{names.JAC_NORM}/{names.layer(i)}" for i in range(3)]
        rows = [f"{step},{','.join(map(str, values))},{loss}" for step, values, loss in
                ((0, init, 3.0), (5, [9.0] * 3, 2.5), (10, end, 2.0))]
        run.joinpath("metrics.csv").write_text(",".join(["step", *cols, names.TRAIN_LOSS]) + "\n" + "\n".join(rows))
        series = read_metrics(run / "metrics.csv")
        assert layer_profile(series, names.JAC_NORM, "first") == dict(zip(("layer_00", "layer_01", "layer_02"), init))
        assert layer_profile(series, names.JAC_NORM, "last") == dict(zip(("layer_00", "layer_01", "layer_02"), end))
        assert layer_profile(series, names.PARAM_NORM, "last") == {}  # not measured: no profile
    compare(sweep)
    for png in ("jacobian_norms.png", "jacobian_norms_end.png"):
        assert (sweep / "plots" / png).stat().st_size > 5000
    plain = tmp_path / "plain"  # runs that measured no Jacobian: no such figure
    (plain / "run").mkdir(parents=True)
    (plain / "run" / "summary.json").write_text(json.dumps({"status": "completed", "steps": 2, "overrides": []}))
    (plain / "run" / "metrics.csv").write_text(f"step,{names.TRAIN_LOSS}\n0,3.0\n1,2.9\n")
    compare(plain)
    assert not (plain / "plots" / "jacobian_norms.png").exists()
