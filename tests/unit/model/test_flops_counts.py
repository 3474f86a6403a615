"""FLOPs per token (lmlab.model.flops.flops_per_token) of every option that changes them, against counts written here
from the formula with numbers: train = 6·N + 3·F, eval = 2·N + F, where N is the matmul weights one token uses
(counted by hand from the sizes below, the tied head once) and F the forward FLOPs per token of the token mixing
(attention: 2·T·(QKᵀ width + A·V width) per layer, the usual 12·L·T·d in training; a recurrent mixer: its chunked
recurrence's matmuls, counted term by term from the formula in its module). Nothing is read off the code's own
counts: a term counted twice, or left out, fails."""

from __future__ import annotations

import pytest
import torch

from lmlab import build_model, compose
from lmlab.model.flops import flops_per_token

V, D, H, T = 64, 32, 4, 16  # vocabulary, d_model, heads (head size 8), sequence length
HD = D // H
BASE = [f"model.vocab_size={V}", f"model.d_model={D}", f"model.n_head={H}", f"model.max_seq_len={T}",
        "model.bias=false", "model.tie_embeddings=true", "ffn=mlp"]

ATTN = 4 * D * D  # q, k, v, o: d -> d each
MLP = 2 * D * 4 * D  # c_fc d -> 4d, c_proj 4d -> d
HEAD = V * D  # the tied head, once
SCORES = 2 * T * (H * HD + H * HD)  # QKᵀ (n_head·head_dim wide) and A·V (as wide), 2 FLOPs a multiply-add


def _flops(*overrides: str, n_layer: int = 2, seq_len: int = T) -> dict[str, int]:
    torch.manual_seed(0)
    model = build_model(compose([*BASE, f"model.n_layer={n_layer}", *overrides]))
    return flops_per_token(model, seq_len)


def _count(n: int, forward_mixing: int) -> dict[str, int]:
    """train = 6·N + the mixing term (3 x its forward: forward + backward), eval = 2·N + its forward."""
    return {"train": 6 * n + 3 * forward_mixing, "eval": 2 * n + forward_mixing}


def _gdn_forward(Hk: int, dk: int, Hv: int, dv: int, c: int, k: int) -> int:
    """Gated DeltaNet's chunked form (lmlab.model.mixer.gdn.gated_delta_rule), per token, per value head: β·k·kᵀ and
    q·kᵀ over the chunk's c keys (2·c·dk each), the unit-triangular solve for the pseudo-values and the decayed keys
    (c·(dv + dk): half of a full c x c product), the scores times U (2·c·dv), then three products with the dk x dv
    state: U's correction W_k·S, the read-out q·S, the update kᵀ·U (2·dk·dv each); plus the short conv over q, k, v
    (2·k per channel)."""
    per_head = 2 * c * dk + 2 * c * dk + c * (dv + dk) + 2 * c * dv + 3 * (2 * dk * dv)
    conv_channels = 2 * Hk * dk + Hv * dv
    return Hv * per_head + 2 * k * conv_channels


def _mamba2_forward(H_: int, p: int, N: int, conv_channels: int, c: int, k: int) -> int:
    """Mamba-2's chunked SSD (lmlab.model.mixer.mamba2.ssd), per token, per head: the c x c scores C·Bᵀ (2·c·N), their
    product with x (2·c·p), the chunk state B·xᵀ (2·p·N) and the state's read-out h·C (2·p·N); plus the conv."""
    per_head = 2 * c * N + 2 * c * p + 2 * p * N + 2 * p * N
    return H_ * per_head + 2 * k * conv_channels


def _linear_forward(h: int, d: int, c: int) -> int:
    """Linear attention's chunked form, per token, per head: the masked c x c q·kᵀ (2·c·d) and A·v (2·c·d), the
    read-out φ(q)ᵀ·S and the update φ(k)·vᵀ of the d x d state (2·d·d each)."""
    return h * (2 * c * d + 2 * c * d + 2 * d * d + 2 * d * d)


CASES = {
    # the plain transformer: 12·L·T·d in training
    "dense": ((), 2, 2 * (ATTN + MLP) + HEAD, 2 * SCORES),
    # 2 key/value heads of 8: k and v are d -> 16; the scores still run over the 4 query heads
    "gqa": (("attention=gqa", "model.n_kv_head=2"), 2, 2 * (2 * D * D + 2 * D * 2 * HD + MLP) + HEAD, 2 * SCORES),
    # each query reads its last 4 keys: W in place of T
    "window": (("attention.window=4",), 2, 2 * (ATTN + MLP) + HEAD, 2 * (2 * 4 * 2 * D)),
    # layer 0 a window of 4, layer 1 the whole context
    "window_pattern": (("attention.window=4", "attention.pattern=[local,global]"), 2, 2 * (ATTN + MLP) + HEAD,
                       2 * 4 * 2 * D + SCORES),
    # MLA: q d -> 4·(6 + 2), kv_a d -> 16 + 2, kv_b 16 -> 4·(6 + 4), o 4·4 -> d; scores over 4·(6 + 2), values 4·4
    "mla": (("attention=mla", "attention.kv_lora_rank=16", "attention.qk_rope_head_dim=2",
             "attention.qk_nope_head_dim=6", "attention.v_head_dim=4"), 2,
            2 * (D * 32 + D * 18 + 16 * 40 + 16 * D + MLP) + HEAD, 2 * (2 * T * (4 * 8 + 4 * 4))),
    # with a compressed query: q_a d -> 8, q_b 8 -> 4·(6 + 2)
    "mla_q_lora": (("attention=mla", "attention.kv_lora_rank=16", "attention.q_lora_rank=8",
                    "attention.qk_rope_head_dim=2", "attention.qk_nope_head_dim=6", "attention.v_head_dim=4"), 2,
                   2 * (D * 8 + 8 * 32 + D * 18 + 16 * 40 + 16 * D + MLP) + HEAD, 2 * (2 * T * (4 * 8 + 4 * 4))),
    # MoE, 4 MLP experts of hidden 48, top 2: the router (d -> 4) and 2 of the 4 experts (d -> 48 -> d) per token
    "moe": (("ffn=moe", "ffn.expert=mlp", "+ffn.hidden=48", "ffn.n_experts=4", "ffn.top_k=2"), 2,
            2 * (ATTN + D * 4 + 2 * (2 * D * 48)) + HEAD, 2 * SCORES),
    # top 1 of 4 SwiGLU experts (gate, up, down: 3·d·48) and a shared SwiGLU of hidden 48, always on
    "moe_shared": (("ffn=moe", "ffn.expert=swiglu", "+ffn.hidden=48", "ffn.n_experts=4", "ffn.top_k=1",
                    "ffn.n_shared=1"), 2, 2 * (ATTN + D * 4 + 1 * (3 * D * 48) + 3 * D * 48) + HEAD, 2 * SCORES),
    # layer 0 without its MLP
    "skip_ffn": (("ffn.skip_layers=[0]",), 2, ATTN + (ATTN + MLP) + HEAD, 2 * SCORES),
    # GDN, 4 key heads of 8, 8 value heads of 4, chunks of 8: in_proj_qkvz d -> 2·32 + 2·32, in_proj_ba d -> 2·8,
    # out_proj 32 -> d (the conv is no nn.Linear: its FLOPs are the mixer's)
    "gdn": (("mixer=gdn", "mixer.n_v_heads=8", "mixer.v_head_dim=4", "mixer.chunk_size=8"), 2,
            2 * (D * 128 + D * 16 + 32 * D + MLP) + HEAD, 2 * _gdn_forward(4, 8, 8, 4, c=8, k=4)),
    # Mamba-2, d_inner 2·32 = 64 in 4 heads of 16, d_state 16, one group, chunks of 8: in_proj d -> 2·64 + 2·16 + 4,
    # out_proj 64 -> d; the conv over x, B, C (64 + 2·16 channels)
    "mamba2": (("mixer=mamba2", "mixer.d_state=16", "mixer.head_dim=16", "mixer.chunk_size=8"), 2,
               2 * (D * 164 + 64 * D + MLP) + HEAD, 2 * _mamba2_forward(4, 16, 16, 64 + 2 * 16, c=8, k=4)),
    # linear attention, 4 heads of 8, chunks of 8: q, k, v and o as MHA's
    "linear": (("mixer=linear", "mixer.chunk_size=8"), 2, 2 * (ATTN + MLP) + HEAD, 2 * _linear_forward(4, 8, c=8)),
    # 3 layers, a GDN layer, an attention layer, a layer without a mixer (its MLP alone)
    "hybrid": (("mixer=gdn", "mixer.pattern=[gdn,attention,none]", "mixer.chunk_size=8"), 3,
               (D * 128 + D * 8 + 32 * D + MLP) + (ATTN + MLP) + MLP + HEAD,
               _gdn_forward(4, 8, 4, 8, c=8, k=4) + SCORES),
    # MTP, 2 extra depths: each a transformer block, a 2d -> d projection, and the output head once more
    "mtp": (("head=mtp", "head.depth=2"), 2, 2 * (ATTN + MLP) + HEAD + 2 * (ATTN + MLP + 2 * D * D + V * D),
            4 * SCORES),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flops_per_token_equal_the_count_by_hand(case: str) -> None:
    overrides, n_layer, n, mixing = CASES[case]
    got = _flops(*overrides, n_layer=n_layer)
    assert got == _count(n, mixing)
    assert all(type(v) is int for v in got.values()), got  # whole FLOPs, as the docstring has them


def test_the_dense_count_is_the_textbook_one() -> None:
    """Kaplan et al.'s 6·N + 12·L·T·d per trained token, 2·N + 4·L·T·d per evaluated one, with numbers."""
    n = 2 * 12 * 32 * 32 + 64 * 32  # 12·d² a layer, the tied head once: 26,624
    assert _flops() == {"train": 6 * 26_624 + 12 * 2 * 16 * 32, "eval": 2 * 26_624 + 4 * 2 * 16 * 32} \
        == {"train": 6 * n + 12_288, "eval": 2 * n + 4_096}


@pytest.mark.parametrize("seq_len", [2, 4, 8, 16])
def test_a_window_costs_the_smaller_of_its_width_and_the_length(seq_len: int) -> None:
    dense, windowed = _flops(seq_len=seq_len), _flops("attention.window=4", seq_len=seq_len)
    span = min(seq_len, 4)
    assert windowed["train"] == 6 * (2 * (ATTN + MLP) + HEAD) + 12 * 2 * span * D
    assert dense["train"] - windowed["train"] == 12 * 2 * (seq_len - span) * D


@pytest.mark.parametrize("mixer", ["gdn", "mamba2", "linear"])
def test_a_recurrent_mixer_costs_the_same_at_any_length(mixer: str) -> None:
    """Its recurrence's FLOPs per token are a function of its geometry (the chunk), not of T; the weights' 6·N too."""
    counts = {t: _flops(f"mixer={mixer}", "mixer.chunk_size=8", seq_len=t) for t in (8, 16)}
    assert counts[8] == counts[16]
