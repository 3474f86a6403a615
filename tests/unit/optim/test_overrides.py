"""`optim.groups` (lmlab.optim.overrides): settings per tensor by name — a matched tensor's step equals the step its
own optimizer takes with the entry's lr, betas and decay; Muon's and AdamW's halves follow `role`; bad entries are
named before training."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.run.lit import configure_optimization

SCHEDULE = {"name": "constant", "warmup_steps": 0}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, n_layer=2, d_model=32, n_head=4, max_seq_len=16, position={"name": "rope"},
                         norm={"name": "rms"}, attention={"name": "mha", "gate": "headwise"}))


def _step(model: GPT, optim: dict) -> torch.optim.Optimizer:
    opt = configure_optimization(model, optim, SCHEDULE, 10)["optimizer"]
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    model(idx, targets=torch.roll(idx, -1, 1)).backward()
    opt.step()
    return opt


def test_a_matched_tensor_steps_as_adamw_at_its_own_lr_betas_and_decay() -> None:
    """AdamW with `h.0.mlp.c_fc.weight` at 3× the lr, betas (0.5, 0.9) and decay 0.5: that tensor's first step is
    a plain AdamW's at those settings from the same gradient; the other tensors' the base settings'."""
    entry = {"match": "h.0.mlp.c_fc.weight", "lr_mult": 3.0, "betas": [0.5, 0.9], "weight_decay": 0.5}
    base = {"name": "adamw", "lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1}
    model, plain = _model(), _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, {**base, "groups": [entry]})
    _step(plain, base)
    params = dict(model.named_parameters())
    w0, w = before["h.0.mlp.c_fc.weight"], params["h.0.mlp.c_fc.weight"]
    ref = w0.clone().requires_grad_()
    ref.grad = w.grad.clone()
    torch.optim.AdamW([ref], lr=0.03, betas=(0.5, 0.9), weight_decay=0.5).step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(w.detach(), dict(plain.named_parameters())["h.0.mlp.c_fc.weight"].detach())
    for name, p in plain.named_parameters():  # the rest: the run without the entry
        if name != "h.0.mlp.c_fc.weight":
            torch.testing.assert_close(params[name].detach(), p.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_role_moves_a_matrix_between_muon_and_adamw_and_lr_mult_scales_the_scheduled_lr() -> None:
    model = _model()
    opt = configure_optimization(model, {"name": "muon", "lr": 0.02, "adam_lr": 0.003, "groups": [
        {"match": "*.attn.gate.weight", "role": "other"}, {"match": "h.1.attn.c_proj.weight", "lr_mult": 2.0}]},
        SCHEDULE, 10)["optimizer"]
    kind = {id(p): (g["kind"], g["lr"]) for g in opt.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert kind[id(named["h.0.attn.gate.weight"])] == ("adamw", 0.003)  # record 56: gates to Adam
    assert kind[id(named["h.0.attn.c_proj.weight"])] == ("muon", 0.02)
    assert kind[id(named["h.1.attn.c_proj.weight"])] == ("muon", pytest.approx(0.04))


@pytest.mark.parametrize("groups,message", [
    ("[{match: 'nothing.*'}]", r"optim.groups\[0\].match=\['nothing.\*'\] matches no parameter"),
    ("[{match: 'h.*'}, {match: 'h.0.*'}]", r"optim.groups\[1\].match=\['h.0.\*'\] matches no parameter not matched"),
    ("[{match: 'h.*', lr_mult: 0}]", r"optim.groups\[0\].lr_mult"),
    ("[{match: 'h.*', betas: [0.9, 1.5]}]", r"optim.groups\[0\].betas"),
    ("[{lr_mult: 2}]", r"optim.groups\[0\]=.* must be a mapping with a `match`"),
    ("[{match: 'h.*', lr: 2}]", r"optim.groups\[0\] has \['lr'\]; an entry takes"),
    ("[{match: 'h.*', role: other}]", r"optim.groups\[0\].role=other .* optim=adamw"),
])
def test_bad_groups_are_named_before_training(groups: str, message: str) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose([f"optim.groups={groups}"]))


def test_role_hidden_is_refused_for_tensors_that_are_not_matrices() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"role=hidden sends tensors to Muon, .* are not 2-D"):
        check_config(compose(["optim=muon", "optim.groups=[{match: 'h.0.ln_1.*', role: hidden}]"]))
