"""The side channel (lmlab.model.side): a forward's auxiliary losses and figures as typed terms. The objective adds
Σ weight·value of the terms the loss lacks, the loggers read one dict per split, the summary what a run has; a new
source (a sublayer that records a term) reaches all three with no reader changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmlab import names
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.head import MTP_LOSS
from lmlab.model.loss import Z_LOSS
from lmlab.model.moe import BALANCE, ROUTER_Z
from lmlab.model.side import Term, figures, objective_part
from lmlab.record.summary import side

BASE = dict(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def test_the_objective_adds_the_weighted_terms_the_loss_lacks_and_the_loggers_sum_by_metric() -> None:
    a, b, c, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 4.0, 8.0))
    terms = [Term("x", a, 0.5), Term("x", b, 0.25), Term("y", c, 0.0, ("train", "val")),
             Term("z", z, 3.0, in_loss=True)]
    assert objective_part(terms).item() == pytest.approx(0.5 * 1 + 0.25 * 2)  # y: a figure only; z: in the loss
    assert {k: v.item() for k, v in figures(terms, "train").items()} == {"x": 3.0, "y": 4.0, "z": 8.0}
    assert list(figures(terms, "val")) == ["y"] and not figures(terms, "train")["x"].requires_grad
    assert objective_part([Term("y", c, 0.0)]) is None


class Probe(nn.Module):
    """A sublayer of a kind lmlab does not have, with a side-channel term: mean x² at weight 0.5, logged in training
    and validation."""

    declared = {"probe_loss": ("train", "val")}
    figure_groups = ()

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.terms = inner, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.terms = [Term("probe_loss", x.square().mean(), 0.5, ("train", "val"))]
        return self.inner(x)


def test_a_new_source_reaches_the_objective_the_loggers_and_the_summary() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE)).train()
    idx = torch.randint(0, 40, (2, 16))
    plain = model(idx, idx)
    model.h[1].mlp = Probe(model.h[1].mlp)
    objective = model(idx, idx)
    probe = model.h[1].mlp.terms[0].value
    torch.testing.assert_close(objective, plain + 0.5 * probe)
    assert list(model.figures("train")) == list(model.figures("val")) == ["probe_loss"]
    assert model.side() == {"train": ["probe_loss"], "val": ["probe_loss"], "figures": []}
    model.eval()
    torch.testing.assert_close(model(idx, idx), plain)  # validation: the LM loss alone


@pytest.mark.parametrize(("arch", "z_loss", "expected"), [
    ({}, 0.0, {"train": [], "val": [], "figures": []}),
    ({}, 1e-4, {"train": ["z_loss"], "val": [], "figures": []}),
    ({"head": {"name": "mtp", "depth": 2}}, 0.0,
     {"train": ["mtp_loss_1", "mtp_loss_2"], "val": ["mtp_loss_1", "mtp_loss_2"], "figures": []}),
    ({"ffn": {"name": "moe", "n_experts": 4, "top_k": 2}}, 0.0,
     {"train": ["moe_balance_loss", "router_z_loss"], "val": [], "figures": ["moe"]}),
])
def test_what_a_model_records_is_what_its_forward_logs(arch: dict, z_loss: float, expected: dict) -> None:
    model = GPT(GPTConfig(**BASE, **arch)).train()
    assert model.side(z_loss) == expected
    idx = torch.randint(0, 40, (2, 16))
    model(idx, idx, z_loss=z_loss, parts=True)
    assert sorted(model.figures("train")) == expected["train"]
    model.eval()
    with torch.no_grad():
        model(idx, idx)
    assert sorted(model.figures("val")) == expected["val"]


def test_the_metric_names_are_the_sources_own() -> None:
    assert names.TRAIN_AUX == {"balance": f"train/{BALANCE}", "router_z": f"train/{ROUTER_Z}"}
    assert names.TRAIN_Z_LOSS == f"train/{Z_LOSS}"
    assert names.mtp_loss("val", 2) == f"val/{MTP_LOSS}2"


def test_a_summary_says_what_its_run_had_and_an_older_one_is_read_from_its_metrics() -> None:
    recorded = {"side": {"train": ["z_loss"], "val": [], "figures": []}}
    assert side(recorded, {"moe/load_cv/layer_00": []}) == recorded["side"]
    assert side({}, {"moe/load_cv/layer_00": [], "train/loss": []})["figures"] == ["moe"]
    assert side({}, {"train/loss": []})["figures"] == []


@pytest.mark.parametrize("bad", ["moe", 5, {"figures": "moe"}, {"train": [], "val": [], "figures": None}])
def test_a_malformed_side_record_is_read_from_the_metrics_instead(bad) -> None:
    """A hand-edited or hostile summary.json's `side` never breaks `eval.py compare=`: it is read as an older run's."""
    assert side({"side": bad}, {"moe/load_cv/layer_00": []}) == {"train": [], "val": [], "figures": ["moe"]}
    assert side({"side": bad}, {})["figures"] == []
