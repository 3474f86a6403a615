"""The mixer axis (lmlab.model.mixer): a token mixer per layer — softmax attention or a recurrent mixer (linear
attention, Gated DeltaNet, Mamba-2) — in a pattern over the layers. Linear attention against its formula token by
token; for every mixer of the registry, alone and in a hybrid pattern: cached generation equal to the full forward
with a state constant in the length, packed documents equal to each alone under attention.doc_mask, the size
estimate, the FLOPs; bad patterns and keys refused by name before anything is built. (Each recurrent mixer's own
formula and transformers parity: tests/unit/model/mixer/test_mixer_<name>.py.)"""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.block import Transformer
from lmlab.model.flops import flops_per_token
from lmlab.model.gpt import GPT, validate
from lmlab.model.mixer import ATTENTION, MIXERS, THE_MIXER, layer_types
from lmlab.model.mixer.linear import FEATURES, LinearAttention
from lmlab.model.resolve import n_params_estimate, resolve

RECURRENT = sorted(set(MIXERS) - {ATTENTION})
BASE = dict(vocab_size=64, n_layer=4, d_model=32, n_head=4, max_seq_len=64, position={"name": "rope"})
STACKS = [(m, None) for m in RECURRENT] + [(m, [m, ATTENTION]) for m in RECURRENT] + [(m, [m, m, m, ATTENTION])
                                                                                      for m in RECURRENT]
SMALL = {"gdn": {}, "mamba2": {"d_state": 8, "head_dim": 16}, "linear": {}}  # small states for quick tests


def _cfg(name: str, pattern: list | None = None, **extra) -> GPTConfig:
    return GPTConfig(**{**BASE, **extra}, mixer={"name": name, "pattern": pattern, **SMALL.get(name, {})})


def _reference(q, k, v, feature, eps=1e-6):
    """Katharopoulos et al. (2020), eq. 9–10, one token at a time: S_t = S_{t-1} + φ(k_t) v_tᵀ, z_t = z_{t-1} + φ(k_t),
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε)."""
    B, H, T, d = q.shape
    S, z, out = q.new_zeros(B, H, d, v.size(-1)), q.new_zeros(B, H, d), []
    for t in range(T):
        fq, fk = feature(q[:, :, t]), feature(k[:, :, t])
        S = S + fk[..., :, None] * v[:, :, t, None, :]
        z = z + fk
        out.append(torch.einsum("bhd,bhde->bhe", fq, S) / (torch.einsum("bhd,bhd->bh", fq, z)[..., None] + eps))
    return torch.stack(out, dim=2)


@pytest.mark.parametrize("chunk", [4, 5, 16])
@pytest.mark.parametrize("feature", ["elu", "relu"])
def test_linear_attention_is_its_recurrence_in_chunks(chunk, feature) -> None:
    cfg = resolve(_cfg("linear"))
    layer = LinearAttention(cfg, feature=feature, chunk_size=chunk).double()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    q, k, v = (t.view(2, 13, 4, 8).transpose(1, 2) for t in layer.c_attn(x).split(layer.c_attn.fused, dim=-1))
    want = layer.c_proj(_reference(q, k, v, FEATURES[feature]).transpose(1, 2).reshape(2, 13, 32))
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,pattern", STACKS)
def test_cached_generation_equals_the_full_forward_with_a_constant_state(name, pattern) -> None:
    model = GPT(_cfg(name, pattern)).double().eval()
    idx = torch.randint(0, 64, (2, 24))
    full = model(idx)
    cache = KVCache(len(model.h))
    steps = [model(idx[:, :9], cache=cache)]
    held = []
    for t in range(9, 24):
        steps.append(model(idx[:, t:t + 1], cache=cache))
        held.append([layer.bytes for layer in cache.layers])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    types = layer_types(model.cfg)
    for i, kind in enumerate(types):  # a recurrent layer's state does not grow with the text; a KV cache does
        grows = held[-1][i] > held[0][i]
        assert grows == (kind == ATTENTION), (i, kind, held[0][i], held[-1][i])
    assert [b.sublayer_names[0] for b in model.h] == ["attn" if t == ATTENTION else "mix" for t in types]


@pytest.mark.parametrize("name,pattern", STACKS[:len(RECURRENT) * 2])
def test_a_packed_document_reads_as_it_would_alone(name, pattern) -> None:
    eod = 0
    a, b = torch.randint(1, 64, (1, 11)), torch.randint(1, 64, (1, 9))
    packed = torch.cat((a, torch.tensor([[eod]]), b), dim=1)  # document 1 ends with its end-of-document token
    masked = GPT(_cfg(name, pattern, eod_id=eod, attention={"name": "mha", "doc_mask": True})).double().eval()
    plain = GPT(_cfg(name, pattern)).double().eval()
    plain.load_state_dict(masked.state_dict())
    alone = masked(b)
    torch.testing.assert_close(masked(packed)[:, -9:], alone, rtol=1e-9, atol=1e-9)
    assert (plain(packed)[:, -9:] - alone).abs().max() > 1e-3  # without the mask the earlier document is read
    cache = KVCache(len(masked.h))  # a prompt with the start inside it, then a token at a time: the state is cut too
    steps = [masked(packed[:, :14], cache=cache)] + [masked(packed[:, t:t + 1], cache=cache) for t in range(14, 21)]
    torch.testing.assert_close(torch.cat(steps, dim=1)[:, -9:], alone, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,pattern", STACKS)
def test_the_size_estimate_counts_each_layer_type(name, pattern) -> None:
    cfg = _cfg(name, pattern)
    model = GPT(cfg)
    assert n_params_estimate(cfg) == pytest.approx(model.num_params(), rel=0.01)
    kind = Transformer(model.cfg)
    for i, block in enumerate(model.h):  # each layer's count is its own type's (norm gains aside)
        gains = sum(p.numel() for n, p in block.named_parameters() if p.dim() == 1 and "ln_" in n)
        assert kind.n_params(i) == pytest.approx(sum(p.numel() for p in block.parameters()) - gains, rel=0.01)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_recurrent_layer_costs_the_same_flops_per_token_at_any_length(name) -> None:
    hybrid, attention = GPT(_cfg(name, [name, ATTENTION])), GPT(GPTConfig(**BASE))
    grow = {m: flops_per_token(m, 1024)["train"] - flops_per_token(m, 64)["train"] for m in (hybrid, attention)}
    assert grow[hybrid] == pytest.approx(grow[attention] / 2)  # only the two attention layers' scores grow with T
    assert flops_per_token(GPT(_cfg(name)), 1024) == flops_per_token(GPT(_cfg(name)), 64)


def test_a_hybrid_stacks_layers_as_its_pattern_says() -> None:
    model = GPT(_cfg("linear", ["linear", THE_MIXER, ATTENTION, "linear"], n_layer=8))  # `mixer`: mixer.name's
    assert layer_types(model.cfg) == ["linear", "linear", ATTENTION, "linear"] * 2
    assert [i for i, b in enumerate(model.h) if hasattr(b, "attn")] == [2, 6]
    assert all(isinstance(b.mix, LinearAttention) for b in model.h if hasattr(b, "mix"))


@pytest.mark.parametrize("mixer,match", [
    ({"name": "linear", "pattern": ["linear", "attention", "linear"]}, r"mixer\.pattern has 3 entries.*\[1, 2, 4\]"),
    ({"name": "linear", "pattern": ["linear", "gdn"]}, r"mixer\.pattern=.*\['gdn'\].*\['attention', 'linear'\]"),
    ({"name": "linear", "pattern": []}, r"mixer\.pattern=\[\] has no entries"),
    ({"name": "rwkv"}, r"mixer='rwkv' is not an option; choose one of \['attention', "),
    ({"name": "linear", "window": 8}, r"mixer='linear' does not take \['window'\]"),
    ({"name": "linear", "feature": "cos"}, r"mixer\.feature='cos'"),
    ({"name": "linear", "n_heads": 3}, r"mixer\.n_heads=3 does not divide model\.d_model=32"),
])
def test_a_bad_mixer_is_refused_by_key(mixer, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate(GPTConfig(**BASE, mixer=mixer))


def test_attention_keys_without_attention_layers_are_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match=r"attention\.window=8: mixer=linear has no attention layer"):
        validate(GPTConfig(**BASE, mixer={"name": "linear"}, attention={"name": "mha", "window": 8}))
    with pytest.raises(ValueError, match=r"attention=gqa: mixer=linear has no attention layer"):
        validate(GPTConfig(**BASE, n_kv_head=2, mixer={"name": "linear"}, attention={"name": "gqa"}))
    hybrid = validate(GPTConfig(**BASE, mixer={"name": "linear", "pattern": ["linear", ATTENTION]},
                                attention={"name": "mha", "window": 8}))  # the window is the attention layers'
    assert GPT(hybrid).h[1].attn.window == 8
    with pytest.raises(ValueError, match=r"mixer=linear chooses each transformer layer's token mixer; block=gau"):
        validate(GPTConfig(**BASE, mixer={"name": "linear"}, block={"name": "gau"}))


def test_a_record_without_a_mixer_is_the_attention_stack_it_was() -> None:
    old = {k: v for k, v in resolve(GPTConfig(**BASE)).to_dict().items() if k != "mixer"}  # saved before the axis
    cfg = resolve(GPTConfig(**old))
    assert cfg.mixer == {"name": ATTENTION, "pattern": None}
    assert cfg.inputs() == resolve(GPTConfig(**BASE)).inputs()
