"""Layers without a sublayer (the GPT-2 speedrun's records 17 and 35: no attention in layers 7 and 0; record 30: no MLP
in layer 0): `none` in mixer.pattern, `ffn.skip_layers`. The sublayer is absent (its weights, its norm, its FLOPs, its
KV cache), the layer is the other sublayer alone, causality and cached generation hold, and what cannot be built is
refused by key before anything is."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.flops import flops_per_token, matmul_params
from lmlab.model.gpt import GPT, validate
from lmlab.model.resolve import n_params_estimate, resolve
from tests.unit.model.options import assert_cached_equals_full, assert_refused

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)  # rms, pre, rope, mha, mlp (hidden 128)
NO_ATTN_0 = {"mixer": {"name": "attention", "pattern": ["none", "attention"]}}
NO_MLP_0 = {"ffn": {"name": "mlp", "hidden_mult": 4, "multiple_of": 64, "skip_layers": [0]}}
D, HIDDEN = 32, 128
ATTN_W, MLP_W = 4 * D * D, 2 * D * HIDDEN  # c_attn 32·96 + c_proj 32·32; c_fc 32·128 + c_proj 128·32 (no biases)


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


@pytest.mark.parametrize(("drop", "gone", "kept", "weights"), [(NO_ATTN_0, "attn", "mlp", ATTN_W),
                                                                (NO_MLP_0, "mlp", "attn", MLP_W)],
                         ids=["attention", "mlp"])
def test_a_dropped_sublayer_is_absent_with_its_weights_and_norm(drop, gone, kept, weights) -> None:
    full, model = _model(), _model(**drop)
    # the full tiny model by hand (tests/unit/model/test_model.py): wte 50·32 + 2·(attn + mlp + 2 rms 32) + ln_f 32
    assert full.num_params() == 50 * 32 + 2 * (ATTN_W + MLP_W + 2 * D) + D == 26336
    assert model.num_params() == 26336 - weights - D  # the sublayer's matrices and its norm
    assert model.h[0].sublayer_names == (kept,) and not hasattr(model.h[0], gone) and not hasattr(model.h[0], "ln_2")
    assert model.h[1].sublayer_names == ("attn", "mlp")
    assert n_params_estimate(model.cfg) == n_params_estimate(full.cfg) - weights  # the size bound (norms aside)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_layer_is_its_other_sublayer_alone(placement: str) -> None:
    """Pre-norm: x + F(N(x)); post-norm: N(x + F(x)), F the sublayer the layer kept and N its only norm, ln_1."""
    x = torch.randn(2, 7, D)
    for drop, kept in ((NO_ATTN_0, "mlp"), (NO_MLP_0, "attn")):
        model = _model(**drop, placement={"name": placement}).eval()
        block = model.h[0]
        f = getattr(block, kept)
        sub = (lambda h, f=f: f(h, pos=model.pos, cache=None, doc=None)) if kept == "attn" else f
        want = x + sub(block.ln_1(x)) if placement == "pre" else block.ln_1(x + sub(x))
        torch.testing.assert_close(block(x, model.pos), want)


def test_causal_and_cached_generation_equals_the_full_forward_without_layer_0s_attention() -> None:
    model = _model(**NO_ATTN_0, n_layer=4, max_seq_len=32, ffn={"name": "mlp", "skip_layers": [3]}).double().eval()
    idx = torch.randint(0, 50, (2, 20))
    later = idx.clone()
    later[:, 12:] = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(later)[:, :12], model(idx)[:, :12])  # the future leaves the past unchanged
    assert_cached_equals_full(model, idx)
    cache = KVCache(len(model.h))
    with torch.no_grad():
        model(idx, cache=cache)
    held = [layer.bytes for layer in cache.layers]  # a layer without attention keeps no keys or values
    assert held[0] == held[2] == 0 and held[1] == held[3] == 2 * (2 * 4 * 20 * 8) * 8  # k, v (B, nkv, T, hs) fp64


def test_the_flops_and_matmul_weights_lose_the_sublayers_share() -> None:
    """The run plan's figures (lmlab.run.budget: flops_per_token, matmul_params): the 6·N term loses the sublayer's
    weights, the 6·L·T·w term a layer's scores when its attention is gone."""
    T, full = 16, _model()
    w = full.cfg.attn_width  # 2·n_head·head_dim = 2·d
    for drop, weights, scores in ((NO_ATTN_0, ATTN_W, T * w), (NO_MLP_0, MLP_W, 0)):
        model = _model(**drop)
        assert matmul_params(model) == matmul_params(full) - weights
        want = {"train": 6 * (weights + scores), "eval": 2 * (weights + scores)}
        got, base = flops_per_token(model, T), flops_per_token(full, T)
        assert {k: base[k] - got[k] for k in base} == want


def test_the_speedrun_layouts_count_each_layer_as_built() -> None:
    """Record 30 (2025-09-05): 12 layers, no attention in layer 7, no MLP in layer 0; record 35 (2025-09-21): no
    attention in layers 0 and 7 either (its layer 0 had no MLP, so the record skipped it: here a layer fewer)."""
    pattern = ["attention"] * 12
    pattern[7] = "none"
    cfg = GPTConfig(vocab_size=64, n_layer=12, d_model=32, n_head=4, mixer={"name": "attention", "pattern": pattern},
                    ffn={"name": "mlp", "skip_layers": [0]}, residual={"value_embed": {"tables": 3}})
    model = GPT(validate(cfg))
    assert [i for i, b in enumerate(model.h) if not hasattr(b, "attn")] == [7]
    assert [i for i, b in enumerate(model.h) if not hasattr(b, "mlp")] == [0]
    assert n_params_estimate(cfg) <= model.num_params() <= 1.01 * n_params_estimate(cfg)
    # record 35's layout keeps value embeddings on the other layers: a dropped layer reads no table
    pattern = ["none"] + ["attention"] * 11
    cfg = GPTConfig(vocab_size=64, n_layer=12, d_model=32, n_head=4, mixer={"name": "attention", "pattern": pattern},
                    residual={"value_embed": {"tables": 3}})
    assert GPT(validate(cfg)).residual.options["value_embed"].layer_tables == {1: 1, 2: 2, 9: 0, 10: 1, 11: 2}


def test_the_monitor_groups_follow_the_sublayers() -> None:
    from lmlab.model.attention import attention_sublayer
    from lmlab.run.monitor import layer_groups

    model = _model(**NO_ATTN_0)
    groups = layer_groups(model)
    assert "layer_00/attn" not in groups and "layer_00/ffn" in groups and "layer_01/attn" in groups
    assert groups["layer_00/norm"] == [model.h[0].ln_1.weight]
    assert attention_sublayer(model.h[0]) is None and attention_sublayer(model.h[1]) is model.h[1].attn


def test_a_record_saved_before_the_key_is_the_same_model() -> None:
    old = resolve(GPTConfig(**TINY, ffn={"name": "mlp", "hidden_mult": 4, "multiple_of": 64}))
    new = resolve(GPTConfig(**TINY, ffn={"name": "mlp", "hidden_mult": 4, "multiple_of": 64, "skip_layers": None}))
    assert old.inputs() == new.inputs() and old.ffn_spec == {"name": "mlp"}


PATTERN_0 = ["none", "attention"]


@pytest.mark.parametrize(("overrides", "match"), [
    ({"ffn": {"name": "mlp", "skip_layers": [2]}}, r"ffn\.skip_layers=\[2\] has \[2\], not layers of the model "
                                                   r"\(0 \.\. model\.n_layer - 1 = 1\)"),
    ({"ffn": {"name": "mlp", "skip_layers": [-1]}}, r"ffn\.skip_layers=\[-1\] must be a list of integers >= 0"),
    ({"mixer": {"name": "attention", "pattern": ["none"]}}, r"mixer\.pattern=\['none'\] gives no layer a token mixer"),
    ({"mixer": {"name": "attention", "pattern": ["nothing", "attention"]}}, r"\['nothing'\].*mixer or none"),
    ({**NO_ATTN_0, "ffn": {"name": "mlp", "skip_layers": [0]}}, r"ffn\.skip_layers=\[0\] with mixer\.pattern=.*"
                                                               r"leaves layer \[0\] with neither a token mixer nor"),
    ({**NO_ATTN_0, "residual": {"value_residual": {}}}, r"residual=value_residual mixes the first layer's attention "
                                                        r"values.*layer 0 is 'none' \(mixer=attention mixer\.pattern"),
    ({**NO_ATTN_0, "residual": {"value_embed": {"layers": [0, 1]}}}, r"residual\.value_embed\.layers=\[0, 1\] has "
                                                                     r"\[0\], layers without attention"),
    ({"n_layer": 4, "mixer": {"name": "attention", "pattern": ["none", "attention", "attention", "none"]},
      "residual": {"value_embed": {"tables": 1}}}, r"residual\.value_embed\.tables=1: table \[0\] would serve only "
                                                   r"layers without attention \(\[0, 3\]"),
    ({**NO_ATTN_0, "block": {"name": "gau"}}, r"mixer\.pattern=.* drops a transformer layer's sublayer; block=gau"),
    ({**NO_MLP_0, "block": {"name": "gau"}}, r"ffn\.skip_layers=\[0\] drops a transformer layer's sublayer"),
], ids=["out_of_range", "negative", "every_layer", "bad_entry", "empty_layer", "value_residual", "value_embed_layers",
        "value_embed_table", "gau_mixer", "gau_ffn"])
def test_what_cannot_be_built_is_refused_by_key(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(GPTConfig(**{**TINY, **overrides}))


def test_a_run_is_refused_before_training() -> None:
    assert_refused(["ffn.skip_layers=[5]"], r"ffn\.skip_layers=\[5\] has \[5\], not layers of the model")
