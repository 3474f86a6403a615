"""model.embed_scale / embed_scale_learned: the token embeddings times a factor (√d_model for sqrt_d, Gemma's; a learned
scalar from it, the DyT paper's LLaMA runs) before positions and blocks; the stream the first block reads is exactly
that factor times the plain model's; the learned factor trains; refusals by key, before training and on HF export."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from tests.unit.model.options import assert_cached_equals_full, assert_refused, assert_trains

V = 40
BASE = dict(vocab_size=V, n_layer=2, d_model=64, n_head=4, max_seq_len=32, norm={"name": "rms"})


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**{**BASE, **kw}))).double().eval()


def _first_block_input(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    seen = []
    handle = model.h[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    model(idx)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize(("scale", "factor"), [("sqrt_d", 8.0), (2.5, 2.5)], ids=["sqrt_d", "a number"])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_the_first_block_reads_the_scaled_token_embeddings(scale, factor: float, position: str) -> None:
    """√64 = 8: block 0 reads 8·wte(idx) (+ the learned table, unscaled, under position=learned)."""
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    plain, scaled = _model(position={"name": position}), _model(position={"name": position}, embed_scale=scale)
    scaled.load_state_dict(plain.state_dict())
    tok = plain.wte(idx)
    extra = _first_block_input(plain, idx) - tok  # the learned positions' rows (zero under rope)
    torch.testing.assert_close(_first_block_input(scaled, idx), factor * tok + extra, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scaled(idx), plain(idx))


def test_learned_factor_starts_at_its_value_and_trains() -> None:
    model = _model(embed_scale="sqrt_d", embed_scale_learned=True).train()
    assert isinstance(model.embed_scale, torch.nn.Parameter)
    assert model.embed_scale.item() == pytest.approx(math.sqrt(64))
    before = model.embed_scale.item()
    assert_trains(model, torch.randint(0, V, (4, 24), generator=torch.Generator().manual_seed(2)), "embed_scale")
    assert model.embed_scale.item() != before
    assert "embed_scale" in model.state_dict()  # saved and resumed with the weights


def test_a_fixed_factor_is_not_a_parameter_and_cached_generation_is_the_full_forward() -> None:
    model = _model(embed_scale=3.0)
    assert model.embed_scale == 3.0 and "embed_scale" not in model.state_dict()
    assert_cached_equals_full(_model(embed_scale="sqrt_d", embed_scale_learned=True),
                              torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3)))


def test_bad_input_is_refused_by_key() -> None:
    assert_refused(["model.embed_scale=-1"], r"model.embed_scale")
    assert_refused(["model.embed_scale=sqrt"], r"model.embed_scale")
    assert_refused(["model.embed_scale_learned=true"], r"model.embed_scale_learned=true .* model.embed_scale")
    from lmlab.interop.hf_config import hf_config

    with pytest.raises(ValueError, match=r"model.embed_scale"):
        hf_config(validate(GPTConfig(**{**BASE, "embed_scale": "sqrt_d"})))
