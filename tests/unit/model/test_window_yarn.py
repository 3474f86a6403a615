"""position.window_yarn (the GPT-2 speedrun's record 31, 2025-09-10_Yarn): the frequencies and the logits' scale
against the record's own `apply_yarn`, written out here and applied in place at each window change as its training
loop does; a function of the step alone (a fresh model at step s equals one that stepped there); the eval window's
stage when not training, every stage's after training; the rotation scales the whole logit; refusals by key."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention.parts.window import windowed
from lmlab.model.gpt import GPT, validate

N = 300
# record 31's (3, 7, 11) blocks of 128 for the long layers, from its stage index ⌊3s/(N + 1)⌋: k(N + 1)/3N on
STAGES = [[k * (N + 1) / (3 * N), ws * 128] for k, ws in enumerate((3, 7, 11))]


def _model(**attention) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, n_layer=2, d_model=64, n_head=2, max_seq_len=2048,
                    position={"name": "rope", "rotary_pct": 0.5, "theta": 1024.0, "window_yarn": True},
                    attention={"name": "mha", "window": 1408, "window_block": 128, "window_schedule": STAGES,
                               **attention})
    return GPT(validate(cfg))


class RecordRotary:
    """The record's `Rotary.apply_yarn(old_window, new_window, alpha=1, beta=32)` and its attention scale, as its
    training loop calls them: in place, on every change of ws (in blocks of 128)."""

    def __init__(self, angular_freq: torch.Tensor) -> None:
        self.angular_freq, self.attn_scale = angular_freq.clone(), 0.1

    def apply_yarn(self, old_window: int, new_window: int, alpha: int = 1, beta: int = 32) -> None:
        rotations = 128 * old_window * self.angular_freq / (2 * torch.pi)
        scaling_factor = old_window / new_window
        interpolation_weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
        self.angular_freq *= scaling_factor + interpolation_weight * (1 - scaling_factor)
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1


def test_the_frequencies_and_scale_are_the_records_at_every_step() -> None:
    model = _model(eval_window=1664)  # the record's ws_validate = 13 blocks
    pos, rec, ws = model.pos, RecordRotary(model.pos._base), 3
    model.train()
    for step in range(N):
        new_ws = (3, 7, 11)[int(3 * step / (1 + N))]  # get_ws: the record's stage index
        if new_ws != ws:
            rec.apply_yarn(ws, new_ws)
            ws = new_ws
        pos.set_step(step, N)
        torch.testing.assert_close(pos.inv_freq, rec.angular_freq, rtol=1e-6, atol=0)
        assert math.isclose(0.1 * pos.logit_scale, rec.attn_scale, rel_tol=1e-12), step
        assert round(0.1 * pos.logit_scale, 4) == {3: 0.1, 7: 0.1169, 11: 0.1275}[ws]  # the record's printed values
    model.eval()  # the final validation's 11 -> 13
    rec.apply_yarn(11, 13)
    torch.testing.assert_close(pos.inv_freq, rec.angular_freq, rtol=1e-6, atol=0)
    assert round(0.1 * pos.logit_scale, 4) == round(rec.attn_scale, 4) == 0.1318  # the record's printed values
    model.train()
    assert pos._yarn == (384, 896, 1408)


def test_a_fresh_model_at_step_s_equals_one_that_stepped_there() -> None:
    walked = _model()
    walked.train()
    for step in range(N):
        walked.pos.set_step(step, N)
        if step in (0, 99, 100, 150, 200, 201, 299):
            fresh = _model()
            fresh.train()
            fresh.pos.set_step(step, N)
            assert torch.equal(fresh.pos.inv_freq, walked.pos.inv_freq)
            assert fresh.pos.logit_scale == walked.pos.logit_scale
    assert model_frequencies_after_training_are_every_stages(_model())


def model_frequencies_after_training_are_every_stages(model: GPT) -> bool:
    """With no step (eval.py, generation, export): every stage passed, the model's own windows."""
    rec = RecordRotary(model.pos._base)
    rec.apply_yarn(3, 7)
    rec.apply_yarn(7, 11)
    return torch.allclose(model.pos.inv_freq, rec.angular_freq, rtol=1e-6, atol=0)


def test_the_rotation_scales_the_whole_logit_and_the_loop_steps_the_position() -> None:
    model = _model()
    model.train()
    pos = model.pos
    pos.set_step(N - 1, N)
    q, k = torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32)
    rq, rk = pos.rotate(q, k)
    plain = _model()
    plain.pos.window_yarn, plain.pos.logit_scale = False, 1.0
    plain.pos.inv_freq.copy_(pos.inv_freq)
    plain.pos._cache = {}
    pq, pk = plain.pos.rotate(q, k)
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), pos.logit_scale * (pq @ pk.transpose(-1, -2)))
    assert pos.logit_scale > 1.2 and pos in windowed(model)  # the training loop's set_step reaches it


@pytest.mark.parametrize("overrides,message", [
    (["position=rope", "position.window_yarn=true", "attention.window=64",
      "attention.window_schedule={start: 16, end: 64}"], "position.window_yarn=true applies YaRN at each stage"),
    (["position=rope", "position.window_yarn=true"], "position.window_yarn=true applies YaRN at each stage"),
    (["position=rope", "position.window_yarn=true", "rope_scaling=yarn", "attention.window=64",
      "attention.window_schedule=[[0,32],[0.5,64]]"], "rope_scaling=yarn rescales them past the trained length"),
    (["position=rope", "position.window_yarn=true", "attention=mla", "attention.window=64",
      "attention.window_schedule=[[0,32],[0.5,64]]"], "attention=mla rotates only a slice of each query"),
])
def test_bad_input_is_refused_by_key_before_training(overrides: list[str], message: str) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose(overrides))
