"""norm=ngpt through train.py: three optimizer steps from the YAML alone, the run completed, and the weights it saved
after its last step on the unit sphere (the loop renormalises after every step) while its eigen rates have moved."""

from __future__ import annotations

import json
import math

import torch

from tests.runs import ROOT, cli, tiny, write_corpus


def test_three_steps_leave_every_matrix_on_the_sphere(tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    res = cli("train.py", "norm=ngpt", *tiny(corpus, tmp_path / "cache", "trainer.max_steps=3",
                                             "model.tie_embeddings=false"), f"hydra.run.dir={run}", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "optim.weight_decay=0.1 does not apply under norm=ngpt" in res.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"]["norm"]["name"] == "ngpt"
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    d = summary["model"]["d_model"]
    rows = ["model.wte.weight", "model.lm_head.weight", "model.pos.wpe.weight"]  # tiny: learned positions, untied
    for i in range(summary["model"]["n_layer"]):
        rows += [f"model.h.{i}.attn.c_attn.weight", f"model.h.{i}.mlp.c_fc.weight"]
        for name in (f"model.h.{i}.attn.c_proj.weight", f"model.h.{i}.mlp.c_proj.weight"):  # write the stream
            torch.testing.assert_close(state[name].norm(dim=0), torch.ones(state[name].size(1)), rtol=0, atol=1e-5)
    for name in rows:
        torch.testing.assert_close(state[name].norm(dim=1), torch.ones(state[name].size(0)), rtol=0, atol=1e-5)
    alpha = state["model.h.0.ngpt.alpha"] * 0.05 * math.sqrt(d)  # the eigen rates: 0.05 at init, trained since
    assert alpha.shape == (2, d) and (alpha - 0.05).abs().max() > 1e-4
