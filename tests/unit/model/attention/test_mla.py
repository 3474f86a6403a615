"""Multi-head latent attention (DeepSeek-V2): the module against the paper's equations computed token by token and head
by head (with and without the compressed query), RoPE on the decoupled key part only, the cache holding the latents
alone, the sizes the record keeps, the weights and cache widths the size checks read, and the refusals by key."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS, MLA
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import n_params_estimate, resolve
from lmlab.registry import build

B, T, C, NH = 2, 6, 32, 4
THETA = 10000.0


def _cfg(**attention) -> GPTConfig:
    return resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=C, n_head=NH, max_seq_len=16, bias=True,
                             attention={"name": "mla", **attention}))


def _rms(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean() + 1e-6) * gain


def _rope_at(x: torch.Tensor, t: int) -> torch.Tensor:
    """RoPE of one vector at position t, half-split pairs (j, j + d/2) rotated by t·θ^(-2j/d), written out."""
    d = x.numel()
    out = x.clone()
    for j in range(d // 2):
        angle = t * THETA ** (-2 * j / d)
        a, b = x[j], x[j + d // 2]
        out[j], out[j + d // 2] = a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle)
    return out


def _by_the_paper(attn: MLA, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's equations (9)-(19), one token and one head at a time: c_t = RMSNorm(W_DKV h_t), k^C_{t,i} =
    W_UK_i c_t, v^C_{t,i} = W_UV_i c_t, k^R_t = RoPE(W_KR h_t) shared by the heads; q^C_{t,i}, q^R_{t,i} from h_t (or
    from c^Q_t = RMSNorm(W_DQ h_t)); o_{t,i} = Σ_{j<=t} softmax_j(q_{t,i}·k_{j,i} / sqrt(d_h + d_R)) v^C_{j,i}; u_t =
    W_O [o_{t,1}; ...; o_{t,nh}]."""
    rank, rope, nope, dv = attn.rank, attn.rope, attn.nope, attn.v
    Wa, ba = attn.kv_a.weight, attn.kv_a.bias
    Wkv = attn.kv_b.weight.view(NH, nope + dv, rank)
    out = torch.zeros(B, T, C)
    for b in range(B):
        keys, values = [], []
        for t in range(T):
            h = x[b, t]
            down = Wa @ h + ba
            c = _rms(down[:rank], attn.kv_a_norm)
            k_rope = _rope_at(down[rank:], t)
            if attn.q_a is None:
                q_all = (attn.q_proj.weight @ h).view(NH, nope + rope)
            else:
                cq = _rms(attn.q_a.weight @ h + attn.q_a.bias, attn.q_a_norm)
                q_all = (attn.q_b.weight @ cq).view(NH, nope + rope)
            keys.append([torch.cat((Wkv[i, :nope] @ c, k_rope)) for i in range(NH)])
            values.append([Wkv[i, nope:] @ c for i in range(NH)])
            heads = []
            for i in range(NH):
                q = torch.cat((q_all[i, :nope], _rope_at(q_all[i, nope:], t)))
                logits = torch.stack([q @ keys[j][i] for j in range(t + 1)]) / math.sqrt(nope + rope)
                weights = logits.softmax(0)
                heads.append(sum(weights[j] * values[j][i] for j in range(t + 1)))
            out[b, t] = attn.c_proj.weight @ torch.cat(heads) + attn.c_proj.bias
    return out


def _rope(cfg: GPTConfig):
    return build("position", POSITIONS, {"name": "rope", "theta": THETA}, cfg.d_model, cfg.attn_head_dim,
                 cfg.attn_heads, cfg.max_seq_len, cfg.train_len, {"name": "none"})


@pytest.mark.parametrize("sizes", [{}, {"kv_lora_rank": 12, "q_lora_rank": 20, "qk_rope_head_dim": 6,
                                        "qk_nope_head_dim": 5, "v_head_dim": 7}])
def test_mla_is_the_papers_equations(sizes: dict) -> None:
    torch.manual_seed(0)
    cfg = _cfg(**sizes)
    attn = build("attention", ATTENTIONS, cfg.attention, cfg)
    with torch.no_grad():
        for p in attn.parameters():  # sharp, varied weights and non-trivial gains and biases
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 1.0))
    x = torch.randn(B, T, C)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, _rope(cfg)), _by_the_paper(attn, x), rtol=1e-4, atol=1e-4)


def test_unset_sizes_follow_deepseek_v2s_proportions_and_are_recorded() -> None:
    cfg = _cfg()  # head size 8
    assert {k: cfg.attention[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                          "v_head_dim")} == {"kv_lora_rank": 32, "q_lora_rank": None,
                                                             "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
                                                             "v_head_dim": 8}
    # RoPE is built for the decoupled part; the cache holds the latent and that part
    assert (cfg.attn_heads, cfg.attn_head_dim, cfg.cache_width) == (NH, 4, 32 + 4)
    assert cfg.attn_width == NH * (8 + 4 + 8)
    assert resolve(GPTConfig(**cfg.to_dict())).to_dict() == cfg.to_dict()  # resolving the record changes nothing
    wide = resolve(GPTConfig(vocab_size=50, d_model=32, n_head=2, attention={"name": "mla"}))
    assert wide.attention["kv_lora_rank"] == 32  # 4 x 16 capped at d_model


def test_the_cache_holds_the_latents_only_and_generation_matches() -> None:
    cfg = validate(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16,
                             attention={"name": "mla", "kv_lora_rank": 10, "qk_rope_head_dim": 6}))
    torch.manual_seed(0)
    model, cache = GPT(cfg).eval(), KVCache(cfg.n_layer)
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    layer = cache.layers[0]
    assert layer.k.shape == (2, 1, 9, 10) and layer.v.shape == (2, 1, 9, 6)  # c_kv and k_rope: no per-head keys
    assert sum(t.numel() for t in (layer.k, layer.v)) / (2 * 9) == cfg.cache_width == 16


@pytest.mark.parametrize("sizes", [{}, {"q_lora_rank": 16, "gate": "elementwise", "sinks": True}])
@pytest.mark.parametrize("bias", [False, True])
def test_the_weights_counted_from_the_sizes_are_the_built_ones(sizes: dict, bias: bool) -> None:
    cfg = GPTConfig(vocab_size=100, n_layer=3, d_model=64, n_head=4, bias=bias, attention={"name": "mla", **sizes})
    with torch.device("meta"):
        model = GPT(cfg)
    gains = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("_norm", "ln_1.weight", "ln_2.weight",
                                                                               "ln_f.weight")))
    assert model.num_params() - gains == n_params_estimate(cfg)


def test_mla_caches_fewer_numbers_per_token_than_mha_and_gqa_at_the_same_width() -> None:
    """DeepSeek-V2's Table 1 at lmlab's sizes: MHA 2·nh·d, GQA 2·g·d, MLA (4 + 1/2)·d per token and layer (the
    paper's default ranks), as much as GQA with 2.25 groups."""
    def width(**kw) -> int:
        return resolve(GPTConfig(vocab_size=50, d_model=512, n_head=8, **kw)).cache_width

    assert width() == 2 * 8 * 64
    assert width(attention={"name": "gqa"}, n_kv_head=2) == 2 * 2 * 64
    mla = width(attention={"name": "mla"})
    assert mla == 4 * 64 + 32 == 2.25 * 2 * 64
    assert width(attention={"name": "gqa"}, n_kv_head=2) < mla < width(attention={"name": "gqa"}, n_kv_head=4)


@pytest.mark.parametrize("override,message", [
    ("attention.kv_lora_rank=200", r"attention.kv_lora_rank=200 is larger than model.d_model=128"),
    ("attention.q_lora_rank=129", r"attention.q_lora_rank=129 is larger than model.d_model=128"),
    ("attention.qk_rope_head_dim=5", r"attention.qk_rope_head_dim=5 must be even"),
    ("attention.qk_norm=true", r"attention=mla normalises its latents"),
    ("attention.kv_lora_rank=0", r"attention.kv_lora_rank"),
])
def test_bad_mla_sizes_are_named_before_training(override: str, message: str) -> None:
    from lmlab.run.checks import check_config

    cfg = compose(["attention=mla", override])
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_the_benchs_cache_table_is_what_the_caches_hold() -> None:
    from lmlab.bench.attention import cache_rows

    rows = {r["attention"]: r for r in cache_rows(tokens=8)}
    assert all(r["bytes_per_token"] == 4 * r["cache_width"] for r in rows.values())  # fp32
    assert rows["mla (kv_lora_rank 64)"]["bytes_per_token"] < rows["mqa"]["bytes_per_token"] < rows["mha"][
        "bytes_per_token"]
