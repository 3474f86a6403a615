"""The block Jacobian estimate (lmlab.run.jacobian) against autograd's full Jacobian on a tiny model, and the note's
Pre/Post-Norm contrast it is for."""

from __future__ import annotations


def test_a_run_logs_the_jacobian_norms(corpus, tmp_path) -> None:
    from lmlab import compose
    from lmlab.run.training import train
    from tests.runs import metric, tiny

    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=6", "jacobian.every_n_steps=3")), run)
    for layer in ("layer_00", "layer_01"):  # tiny(): 2 layers
        logged = metric(run, f"jac/norm/{layer}")
        assert sorted(logged) == [0, 3] and all(0.1 < v < 10 for v in logged.values())
