"""position.layout: RoPE on adjacent pairs (the source note's, RoFormer's, GPT-J's: dims 2j and 2j + 1 rotate at θ_j)
or on the two halves (GPT-NeoX's, Llama's, transformers' rotate_half: dims j and j + d/2). The pairs layout against the
note's formula by hand; the two layouts the same function up to a fixed permutation of each head's dims, for every
RoPE scaling and partial rotation; relative positions only; refused by key by the exports that rotate the halves."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.position import POSITIONS
from lmlab.model.rope_scaling import ROPE_SCALINGS
from lmlab.registry import build

D = 8  # head dim


def _rope(layout: str, scaling: str = "none", rotary_pct: float = 1.0, max_len: int = 32, train_len: int = 8):
    return build("position", POSITIONS, {"name": "rope", "layout": layout, "rotary_pct": rotary_pct}, 32, D, 4,
                 max_len, train_len, {"name": scaling})


def test_the_pairs_layout_is_the_notes_formula() -> None:
    """(x_2j, x_2j+1) at position t ↦ (x_2j cos tθ_j − x_2j+1 sin tθ_j, x_2j+1 cos tθ_j + x_2j sin tθ_j), θ_j =
    10000^(−2j/d): the complex product (x_2j + i·x_2j+1)·e^(i·tθ_j)."""
    pos = _rope("pairs")
    q = torch.randn(1, 1, 5, D, dtype=torch.float64)
    got, _ = pos.rotate(q, q.clone())
    for t in range(5):
        for j in range(D // 2):
            z = complex(q[0, 0, t, 2 * j], q[0, 0, t, 2 * j + 1]) * complex(math.cos(t * 10000 ** (-2 * j / D)),
                                                                             math.sin(t * 10000 ** (-2 * j / D)))
            assert (got[0, 0, t, 2 * j].item(), got[0, 0, t, 2 * j + 1].item()) == pytest.approx((z.real, z.imag))


def test_dimension_zero_moves_into_dimension_one_with_pairs_and_into_d_over_2_with_halves() -> None:
    q = torch.zeros(1, 1, 2, D)
    q[..., 0] = 1.0  # only dimension 0 set; position 1 rotates it by θ_0 = 1 radian
    pairs, _ = _rope("pairs").rotate(q, q.clone())
    half, _ = _rope("half").rotate(q, q.clone())
    assert pairs[0, 0, 1].nonzero().flatten().tolist() == [0, 1]
    assert half[0, 0, 1].nonzero().flatten().tolist() == [0, D // 2]
    assert pairs[0, 0, 1, 1].item() == pytest.approx(math.sin(1.0)) == half[0, 0, 1, D // 2].item()


def _perm(rot: int) -> torch.Tensor:
    """The half layout's dim index of each pairs-layout dim, on the first `rot` dims: 2j ← j, 2j + 1 ← j + rot/2."""
    idx = torch.arange(D)
    idx[:rot] = torch.stack([torch.arange(rot // 2), torch.arange(rot // 2) + rot // 2], dim=1).flatten()
    return idx


@pytest.mark.parametrize("rotary_pct", [1.0, 0.5])
@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_the_layouts_are_one_function_up_to_a_permutation(scaling: str, rotary_pct: float) -> None:
    """rotate_pairs(P·x) = P·rotate_half(x) at every position, inside and past the trained length (dynamic scalings
    at their longest length too)."""
    pairs, half = _rope("pairs", scaling, rotary_pct), _rope("half", scaling, rotary_pct)
    assert pairs.rot_dim == half.rot_dim
    perm = _perm(half.rot_dim)
    q, k = torch.randn(2, 4, 24, D), torch.randn(2, 4, 24, D)
    hq, hk = half.rotate(q, k)
    pq, pk = pairs.rotate(q[..., perm], k[..., perm])
    torch.testing.assert_close(pq, hq[..., perm], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pk, hk[..., perm], rtol=1e-6, atol=1e-6)


def test_the_logits_depend_on_the_offset_only() -> None:
    pos = _rope("pairs")
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)
    seq = lambda x, t: torch.cat([torch.zeros(1, 1, t, D), x], dim=2)  # noqa: E731  (x at position t)
    dots = []
    for t in (0, 3, 7):
        rq, _ = pos.rotate(seq(q, t + 2), seq(q, t + 2))
        _, rk = pos.rotate(seq(k, t), seq(k, t))
        dots.append((rq[0, 0, t + 2] @ rk[0, 0, t]).item())  # query 2 positions after the key
    assert dots == pytest.approx([dots[0]] * 3, rel=1e-5)


def test_a_model_with_pairs_trains_and_the_exports_that_rotate_halves_refuse_it() -> None:
    from lmlab.interop.hf_config import hf_config

    cfg = GPTConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=16, position={"name": "rope",
                    "layout": "pairs"}, norm={"name": "rms"}, ffn={"name": "swiglu"}, tie_embeddings=False)
    model = GPT(cfg)
    idx = torch.randint(0, 40, (2, 16))
    model(idx, idx).backward()
    with pytest.raises(ValueError, match=r"position\.layout"):
        hf_config(model.cfg)
    with pytest.raises(ValueError, match=r"position\.layout"):
        build("position", POSITIONS, {"name": "rope", "layout": "interleaved"}, 32, D, 4, 16, 16, {"name": "none"})


def test_yarns_temperature_under_partial_rotation_scales_the_rotated_dims_as_transformers_does() -> None:
    """The rule chosen for YaRN's attention factor with rotary_pct < 1: it multiplies cos and sin, so the rotated dims
    only (the unrotated ones stay as they are, and q·k is not scaled by t as a whole). That is transformers' rule
    (its rotary embedding scales cos and sin, GPT-NeoX's apply_rotary_pos_emb passes the rest through), which lmlab's
    exports and parity tests follow; the note's q·k·t would need the factor outside the rotation."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox as neox

    config = transformers.GPTNeoXConfig(hidden_size=4 * D, num_attention_heads=4, max_position_embeddings=32,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 8,
                                                         "partial_rotary_factor": 0.5})
    hf = neox.GPTNeoXRotaryEmbedding(config)
    q, k = torch.randn(1, 4, 24, D), torch.randn(1, 4, 24, D)
    cos, sin = hf(q, torch.arange(24)[None])
    hq, hk = neox.apply_rotary_pos_emb(q, k, cos, sin)
    ours = build("position", POSITIONS, {"name": "rope", "rotary_pct": 0.5}, 4 * D, D, 4, 32, 8,
                 {"name": "yarn", "factor": 4.0, "original_max_len": 8})
    lq, lk = ours.rotate(q, k)
    assert ours.attention_factor == pytest.approx(hf.attention_scaling) and ours.attention_factor > 1.1
    torch.testing.assert_close(lq, hq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lk, hk, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lq[..., D // 2:], q[..., D // 2:], rtol=0, atol=0)  # the unrotated dims: unscaled
