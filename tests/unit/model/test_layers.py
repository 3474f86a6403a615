"""The layer plan (lmlab.model.layers): one record per layer from the eight per-layer keys, each checked against what
the built model has in that layer (its sublayers, its attention's window, its positions, its residual branches), and
the keys refused by their own messages as before."""

from __future__ import annotations

import re

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.flops import flops_per_token, matmul_params
from lmlab.model.gpt import GPT
from lmlab.model.layers import Layer, layer_plan
from lmlab.model.mixer import layer_types
from lmlab.model.resolve import resolve

TINY = dict(vocab_size=50, n_layer=4, d_model=32, n_head=4, max_seq_len=16)  # rms, pre, rope, mha, mlp


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def _plan(**overrides) -> tuple[Layer, ...]:
    return layer_plan(resolve(GPTConfig(**{**TINY, **overrides})))


def test_the_default_plan_is_attention_and_ffn_in_every_layer() -> None:
    model = _model()
    assert model.plan == tuple(Layer(i, "attention") for i in range(4)) == _plan()
    assert [b.sublayer_names for b in model.h] == [("attn", "mlp")] * 4
    assert [b.attn.window for b in model.h] == [None] * 4


def test_a_hybrid_plan_is_the_mixer_pattern_cycled() -> None:
    model = _model(mixer={"name": "gdn", "pattern": ["gdn", "attention"]})
    plan = model.plan
    assert [layer.mixer for layer in plan] == ["gdn", "attention", "gdn", "attention"] == layer_types(model.cfg)
    assert [layer.recurrent for layer in plan] == [True, False, True, False]
    assert [layer.attention for layer in plan] == [False, True, False, True]
    assert [b.sublayer_names for b in model.h] == [("mix", "mlp"), ("attn", "mlp")] * 2  # what was built
    assert [type(b.mix).__name__ for b in model.h[::2]] == ["GatedDeltaNet"] * 2
    assert [layer.window for layer in plan] == [None] * 4


def test_a_window_pattern_gives_each_attention_layer_its_window() -> None:
    model = _model(attention={"name": "mha", "pattern": [12, "local", "global", 8], "window": 4,
                              "eval_window": [16, 2, "global", 4]})
    assert [layer.window for layer in model.plan] == [12, 4, None, 8]
    assert [b.attn.window for b in model.h] == [12, 4, None, 8]  # the built attention's window
    assert [layer.eval_window for layer in model.plan] == [16, 2, None, 4]
    assert [b.attn.windows.at(None, None, False) for b in model.h] == [16, 2, None, 4]  # its window when not training


def test_a_local_global_pattern_and_its_flops() -> None:
    model = _model(attention={"name": "mha", "pattern": ["local", "global"], "window": 8})
    assert [layer.window for layer in model.plan] == [8, None, 8, None] == [b.attn.window for b in model.h]
    assert [layer.eval_window for layer in model.plan] == [8, None, 8, None]  # no eval_window: the same windows
    # FLOPs read the plan: scores over 8 keys in layers 0 and 2, 16 in 1 and 3; attn_width 2·4·8 = 64
    fwd = 2 * matmul_params(model) + 2 * (8 + 16 + 8 + 16) * 64
    assert flops_per_token(model, 16)["eval"] == fwd == 2 * matmul_params(model) + 6144


def test_flops_read_the_plan_and_what_each_attention_reads() -> None:
    """A hybrid's attention layers score 16 keys, its GDN layers cost their recurrence; a block selection of 2 blocks
    of 4 reads 8 keys a query and adds its gate: 2·n_head·head_dim per block mean (4 of them) + the means (32)."""
    hybrid = _model(mixer={"name": "gdn", "pattern": ["gdn", "attention"]})
    per = hybrid.h[0].mix.geometry(hybrid.cfg).flops_per_token
    assert flops_per_token(hybrid, 16)["eval"] == 2 * matmul_params(hybrid) + 2 * (2 * 16) * 64 + 2 * per
    select = _model(attention={"name": "mha", "select_blocks": 2, "select_block_size": 4})
    assert flops_per_token(select, 16)["eval"] == 2 * matmul_params(select) + 2 * (4 * 8) * 64 + 4 * (2 * 32 * 4 + 32)


def test_skip_layers_leave_a_layer_without_its_ffn() -> None:
    model = _model(ffn={"name": "mlp", "skip_layers": [1]})
    assert [layer.ffn for layer in model.plan] == [True, False, True, True]
    assert [b.sublayer_names for b in model.h] == [("attn", "mlp"), ("attn",), ("attn", "mlp"), ("attn", "mlp")]


def test_nope_layers_are_left_unrotated() -> None:
    model = _model(position={"name": "rope", "nope_layers": [1, 3]})
    assert [layer.nope for layer in model.plan] == [False, True, False, True]
    q = torch.randn(1, 4, 5, 8)
    unrotated = [torch.equal(model.pos.rotate(q, q, layer=i)[0], q) for i in range(4)]  # what the layer's attention
    assert unrotated == [False, True, False, True]  # reads of its queries


def test_value_embed_tables_are_the_layers_whose_values_read_them() -> None:
    model = _model(residual={"value_embed": {"tables": 1}},
                   mixer={"name": "attention", "pattern": ["attention", "attention", "none", "attention"]})
    plan = model.plan
    assert [layer.mixer for layer in plan] == ["attention", "attention", "none", "attention"]
    assert [layer.value_embed for layer in plan] == [0, None, None, 0]  # the first and last layer: table 0
    assert [len(model.h[i].attn.value_mixes) for i in (0, 1, 3)] == [1, 0, 1]


def test_unscaled_mixer_layers_keep_no_scalar_on_their_mixer() -> None:
    model = _model(residual={"scaled": {"unscaled_mixer": [0, 2]}})
    assert [layer.unscaled_mixer for layer in model.plan] == [True, False, True, False]
    assert [sorted(b.branch_scale.rows) for b in model.h] == [[2], [1, 2], [2], [1, 2]]  # the sublayers with an alpha


def test_paired_heads_per_layer() -> None:
    model = _model(attention={"name": "mha", "paired_heads": [0, 2]})
    assert [layer.paired_heads for layer in model.plan] == [True, False, True, False]


def test_a_gau_stack_is_one_unit_per_layer() -> None:
    model = _model(block={"name": "gau", "s": 16})
    assert model.plan == tuple(Layer(i, "attention", ffn=False) for i in range(4))
    assert [b.sublayer_names for b in model.h] == [("gau",)] * 4


@pytest.mark.parametrize(("overrides", "message"), [
    ({"mixer": {"name": "gdn", "pattern": ["gdn", "gdn", "attention"]}},
     "mixer.pattern has 3 entries, which does not divide model.n_layer=4"),
    ({"attention": {"name": "mha", "pattern": ["local", "global", "global"], "window": 4}},
     "attention.pattern=['local', 'global', 'global'] has 3 entries, which must divide model.n_layer=4"),
    ({"attention": {"name": "mha", "pattern": ["local", "global"]}},
     "attention.pattern=['local', 'global'] has local layers but attention.window is null"),
    ({"ffn": {"name": "mlp", "skip_layers": [4]}}, "ffn.skip_layers=[4] has [4], not layers of the model"),
    ({"position": {"name": "rope", "nope_layers": [4]}}, "position.nope_layers has [4], not layers of the model"),
    ({"attention": {"name": "mha", "paired_heads": [5]}}, "attention.paired_heads=[5]: [5] are not layers"),
    ({"residual": {"scaled": {"unscaled_mixer": [4]}}}, "residual.scaled.unscaled_mixer names layers [4], past"),
    ({"residual": {"scaled": {"unscaled_mixer": [0]}},
      "mixer": {"name": "attention", "pattern": ["none", "attention"]}},
     "residual.scaled.unscaled_mixer names layer 0, which has no token mixer"),
    ({"residual": {"value_embed": {"layers": [0]}}, "mixer": {"name": "attention", "pattern": ["none", "attention"]}},
     "residual.value_embed.layers=[0] has [0], layers without attention"),
], ids=["mixer", "pattern", "local", "ffn", "nope", "paired", "unscaled", "unscaled_none", "value_embed"])
def test_each_key_is_refused_by_its_own_message(overrides, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(**overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        _model(**overrides)


def test_the_plan_is_frozen() -> None:
    layer = _plan()[0]
    with pytest.raises(AttributeError):
        layer.ffn = False


# ---- model.layers: each layer's overrides, the general form of the per-layer keys ---------------------------------

LAYERS = [{"mixer": "gdn", "ffn": False}, {"mixer": "attention", "window": 8, "nope": True}]
OLD = dict(mixer={"name": "gdn", "pattern": ["gdn", "attention"]}, attention={"name": "mha", "pattern": ["global", 8]},
           ffn={"name": "mlp", "skip_layers": [0, 2]}, position={"name": "rope", "nope_layers": [1, 3]})


def test_layers_build_the_model_the_groups_keys_build() -> None:
    new = _model(layers=LAYERS, mixer={"name": "gdn"})
    old = _model(**OLD)
    assert new.plan == old.plan
    assert [(layer.mixer, layer.window, layer.ffn, layer.nope) for layer in new.plan] == [
        ("gdn", None, False, False), ("attention", 8, True, True)] * 2
    assert [b.sublayer_names for b in new.h] == [("mix",), ("attn", "mlp")] * 2
    assert [new.h[i].attn.window for i in (1, 3)] == [8, 8]
    assert list(new.state_dict()) == list(old.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), old.state_dict().values()))
    # the record holds the groups' keys (what an old run's record says), `layers` written into them
    assert new.cfg.layers is None and new.cfg.mixer["pattern"] == ["gdn", "attention"]
    assert new.cfg.attention["pattern"] == ["global", 8] and new.cfg.ffn["skip_layers"] == [0, 2]
    assert new.cfg.position["nope_layers"] == [1, 3]


def test_an_entry_without_a_window_takes_attention_window() -> None:
    plan = _plan(layers=[{"window": 4}, {}], attention={"name": "mha", "window": 2})
    assert [layer.window for layer in plan] == [4, 2, 4, 2]


def test_layers_compose_from_the_command_line() -> None:
    from lmlab import build_model, compose

    cfg = compose(["model=tiny", "model.vocab_size=64", "mixer=gdn", "position=rope",
                   "model.layers=[{mixer: gdn, ffn: false}, {mixer: attention, window: 8}]"])
    model = build_model(cfg)
    assert [(layer.mixer, layer.window, layer.ffn) for layer in model.plan] == [
        ("gdn", None, False), ("attention", 8, True)] * 2


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(layers=[{"mixer": "gdn", "heads": 2}]),
     "model.layers[0] has ['heads']: a layer's entry takes mixer: attention, the mixer's name, mixer or none; window: "
     "a window of >= 1 keys, local (attention.window), global or null; ffn: true or false"),
    (dict(layers=[{"ffn": "no"}]), "model.layers[0].ffn='no': ffn is true or false"),
    (dict(layers=[{"window": 0}]), "model.layers[0].window=0: window is a window of >= 1 keys"),
    (dict(layers=[{}, {}, {}]), "model.layers has 3 entries, which does not divide model.n_layer=4"),
    (dict(layers=[{"ffn": False}, {}], ffn={"name": "mlp", "skip_layers": [1]}),
     "model.layers gives each layer's ffn, and ffn.skip_layers=[1] does too: give one of them"),
    (dict(layers=[{"mixer": "none"}, {}], mixer={"name": "attention", "pattern": ["attention"]}),
     "model.layers gives each layer's mixer, and mixer.pattern=['attention'] does too"),
    (dict(layers=[{"window": 4}], attention={"name": "mha", "pattern": ["global"]}),
     "model.layers gives each layer's window, and attention.pattern=['global'] does too"),
    (dict(layers=[{"nope": True}], position={"name": "rope", "nope_layers": [0]}),
     "model.layers gives each layer's nope, and position.nope_layers=[0] does too"),
    (dict(layers=[{"mixer": "gdn"}]), "mixer.pattern=['gdn'] has ['gdn']: with mixer=attention each entry"),
], ids=["unknown", "ffn", "window", "length", "ffn_both", "mixer_both", "window_both", "nope_both", "mixer_value"])
def test_layers_are_refused_by_key(overrides, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _model(**overrides)
