"""Generation: the KV cache gives, token by token, the logits of a full forward over the growing text (greedy, every
position scheme and RoPE scaling, dynamic ones past the trained length included); sampling rules; the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab.analysis.generate import generate, sample
from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.attention.cache import KVCache
from lmlab.model.attention.score import SCORES
from lmlab.model.block import BLOCKS
from lmlab.model.ffn import FFNS
from lmlab.model.gpt import GPT, validate
from lmlab.model.head import HEADS
from lmlab.model.placement import PLACEMENTS
from lmlab.model.position import POSITIONS
from lmlab.model.residual import RESIDUALS
from lmlab.model.rope_scaling import ROPE_SCALINGS

V, PROMPT, NEW = 40, 5, 19  # the text grows from 5 to 24 tokens


def _model(**kw) -> GPT:
    base = dict(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=24, norm={"name": "rms"})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # sharp, position-dependent attention: at init it is nearly uniform and hides mistakes
        for name, p in model.named_parameters():  # attention's q, k, v; GAU's scales of Q and K
            if name.endswith(("attn.c_attn.weight", "attn.q_proj.weight", "attn.q_b.weight", "attn.kv_b.weight")):
                p.mul_(10)
            elif name.endswith(("q_gamma", "k_gamma")):
                p.mul_(4)
    return model


def _greedy_logits(model: GPT, use_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, V, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    seen: list[torch.Tensor] = []
    out = generate(model, idx, NEW, temperature=0, on_token=lambda t, logits: seen.append(logits),
                   use_cache=use_cache)
    return out, torch.stack(seen, dim=1)  # (B, NEW, V)


# Every option of the axes that reach the cache, from their registries (a new option is covered without an edit here),
# each at its defaults on RoPE (sizes only where a default does not fit this 2-layer model), then the combinations.
SMALL = {"residual": {"value_embed": {"tables": 1}}, "attention": {"gqa": {"n_kv_head": 2}}}
CASES = {f"position={p}": {"position": {"name": p}} for p in POSITIONS}
CASES |= {f"attention={a}": {"position": {"name": "rope"}, "attention": {"name": a},
                             "n_kv_head": SMALL["attention"].get(a, {}).get("n_kv_head")} for a in ATTENTIONS}
CASES |= {f"residual={r}": {"position": {"name": "rope"}, "residual": {r: SMALL["residual"].get(r, {})}}
          for r in RESIDUALS}
CASES |= {f"{group}={name}": {"position": {"name": "rope"}, group: {"name": name}}
          for group, registry in (("ffn", FFNS), ("placement", PLACEMENTS), ("block", BLOCKS), ("head", HEADS))
          for name in registry if getattr(registry[name], "predicts_next", True)}  # mlm, classify: refused (encoder)
CASES |= {f"rope_scaling={s}": {"position": {"name": "rope"}, "train_len": 8, "rope_scaling": {"name": s}}
          for s in ROPE_SCALINGS if s != "none"}  # trained at 8: the text runs 3x past it
CASES |= {
    "gqa+qk_norm": {"position": {"name": "rope"}, "attention": {"name": "gqa", "qk_norm": True}, "n_kv_head": 2},
    "mqa+logn_scaling": {"position": {"name": "rope"}, "train_len": 8,
                         "attention": {"name": "mqa", "logn_scaling": True}},
    "alibi+post": {"position": {"name": "alibi"}, "placement": {"name": "post"}},
    "ffn=moe": {"position": {"name": "rope"}, "ffn": {"name": "moe", "n_experts": 4, "top_k": 2, "n_shared": 1,
                                                      "capacity_factor": 1.0, "bias_update_rate": 0.01}},
    **{f"score={s}": {"position": {"name": "rope"}, "train_len": 8, "attention": {"name": "mha", "score": s}}
       for s in SCORES},
    **{f"block=gau+score={s}": {"position": {"name": "rope"}, "train_len": 8, "activation": {"name": "silu"},
                                "block": {"name": "gau", "s": 16, "expansion": 2, "score": s}} for s in SCORES},
    "gqa+alibi+relu2": {"position": {"name": "alibi"}, "attention": {"name": "gqa", "score": "relu2"},
                        "n_kv_head": 2},
    "gau+alibi+post": {"position": {"name": "alibi"}, "placement": {"name": "post"},
                       "block": {"name": "gau", "s": 16, "score": "relu2"}},
    "sinusoidal+deepnorm+swiglu": {"position": {"name": "sinusoidal"}, "placement": {"name": "deepnorm"},
                                   "ffn": {"name": "swiglu"}},
    # windows: the cache keeps each local layer's last W - 1 keys, and the text outgrows the window
    "window+rope": {"position": {"name": "rope"}, "attention": {"name": "mha", "window": 4}},
    "pattern+gqa+alibi": {"position": {"name": "alibi"}, "n_kv_head": 2,
                          "attention": {"name": "gqa", "window": 3, "pattern": ["local", "global"]}},
    "window+relu2+learned": {"attention": {"name": "mha", "window": 5, "score": "relu2"}},
    "window+softmax_plus": {"position": {"name": "rope"}, "train_len": 8,
                            "attention": {"name": "mha", "window": 6, "score": "softmax_plus"}},
    "window+logn_scaling": {"position": {"name": "rope"}, "train_len": 8,
                            "attention": {"name": "mqa", "window": 6, "logn_scaling": True}},
    "softcap+window": {"position": {"name": "rope"}, "attention": {"name": "mha", "softcap": 2.0, "window": 4}},
    "softcap": {"attention": {"name": "mha", "softcap": 1.5}},
    "gate+gqa+window": {"position": {"name": "rope"}, "n_kv_head": 2,
                        "attention": {"name": "gqa", "gate": "elementwise", "window": 4}},
    "headwise_gate": {"attention": {"name": "mha", "gate": "headwise"}},
    "rope+nope_layers": {"position": {"name": "rope", "nope_layers": [1]}, "attention": {"name": "mha", "window": 6}},
    "rope_pairs+yarn+partial": {"position": {"name": "rope", "layout": "pairs", "rotary_pct": 0.5}, "train_len": 8,
                                "rope_scaling": {"name": "yarn"}},
    "diff+rope": {"position": {"name": "rope"}, "attention": {"name": "diff"}},
    "diff+window+softcap": {"position": {"name": "rope"}, "attention": {"name": "diff", "window": 5, "softcap": 3.0}},
    "sinks+window+alibi": {"position": {"name": "alibi"}, "attention": {"name": "mha", "sinks": True, "window": 5}},
    # the forget gate: the cache keeps each key's cumulative log gate; memory keys: parameters, never cached
    "forget_gate+nope": {"position": {"name": "none"}, "attention": {"name": "mha", "forget_gate": True}},
    "forget_gate+gqa+window+alibi": {"position": {"name": "alibi"}, "n_kv_head": 2,
                                     "attention": {"name": "gqa", "forget_gate": True, "window": 4}},
    "mem_kv+rope+pattern": {"position": {"name": "rope"},
                            "attention": {"name": "mha", "mem_kv": 2, "window": 3, "pattern": ["local", "global"]}},
    "mem_kv+forget_gate+alibi": {"position": {"name": "alibi"},
                                 "attention": {"name": "mqa", "mem_kv": 3, "forget_gate": True}},
    "forget_gate+sinks+softcap": {"attention": {"name": "mha", "forget_gate": True, "sinks": True, "softcap": 2.0}},
    "mem_kv+forget_gate+cosine": {"position": {"name": "rope"},
                                  "attention": {"name": "cosine", "mem_kv": 2, "forget_gate": True, "window": 5}},
    # residual connections: the first layer's values mixed in before caching, skips and re-injections per step
    "value_residual+window+gqa": {"position": {"name": "rope"}, "n_kv_head": 2, "residual": {"value_residual": {}},
                                  "attention": {"name": "gqa", "window": 5}},
    "value_embed+mqa": {"position": {"name": "rope"}, "attention": {"name": "mqa"},
                        "residual": {"value_embed": {"tables": 1}, "value_residual": {}}},
    "unet+x0+scaled": {"position": {"name": "rope"}, "n_layer": 4,
                       "residual": {"scaled": {"stream": True}, "unet": {"gate_init": 0.7}, "x0": {"init": 0.3}}},
    "parallel+alibi": {"position": {"name": "alibi"}, "residual": {"parallel": {}}},
    "hyper+window": {"position": {"name": "rope"}, "attention": {"name": "mha", "window": 4},
                     "residual": {"hyper": {"streams": 3}}},
    # head=mtp and a model.untie_at_step head: generation reads the next-token head only
    "mtp+untie+rope": {"position": {"name": "rope"}, "head": {"name": "mtp", "depth": 2}, "untie_at_step": 3},
    # MLA: the cache holds the latents, up-projected at every step
    "mla+rope": {"position": {"name": "rope"}, "attention": {"name": "mla", "kv_lora_rank": 16}},
    "mla+q_lora+window+yarn": {"position": {"name": "rope"}, "train_len": 8, "rope_scaling": {"name": "yarn"},
                               "attention": {"name": "mla", "kv_lora_rank": 12, "q_lora_rank": 16, "window": 5}},
    "mla+alibi+sinks+gate": {"position": {"name": "alibi"},
                             "attention": {"name": "mla", "sinks": True, "gate": "headwise", "v_head_dim": 4}},
    "mla+logn+learned": {"train_len": 8, "position": {"name": "learned"},
                         "attention": {"name": "mla", "logn_scaling": True, "qk_rope_head_dim": 2}},
    "mla+forget_gate+mem_kv+window": {"position": {"name": "rope"},
                                      "attention": {"name": "mla", "forget_gate": True, "mem_kv": 2, "window": 6}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kv_cache_gives_the_full_forward_logits(case: str) -> None:
    model = _model(**CASES[case])
    full_tokens, full = _greedy_logits(model, use_cache=False)
    cached_tokens, cached = _greedy_logits(model, use_cache=True)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached_tokens, full_tokens)


def test_the_reference_is_a_full_forward() -> None:
    """use_cache=False really is the full forward: its logits at each step are the last row of model(text)."""
    model = _model(position={"name": "rope"}, train_len=8, rope_scaling={"name": "dynamic_ntk"})
    tokens, logits = _greedy_logits(model, use_cache=False)
    for step in (0, 7, NEW - 1):
        with torch.no_grad():
            last = model(tokens[:, : PROMPT + step])[:, -1]
        torch.testing.assert_close(logits[:, step], last, rtol=0, atol=0)


def test_a_dynamic_scaling_rebuilds_the_cache_only_past_the_trained_length() -> None:
    model = _model(position={"name": "rope"}, train_len=8, rope_scaling={"name": "dynamic_ntk"})
    keys = [model.pos.cache_key(n) for n in range(1, 13)]
    assert len(set(keys[:8])) == 1 and len(set(keys[7:])) == 5  # lengths 1..8 share the trained frequencies
    assert _model(position={"name": "rope"}).pos.cache_key(100) is None  # static: never stale


def test_cached_keys_continue_where_the_prompt_ends() -> None:
    model = _model(position={"name": "alibi"})
    idx = torch.randint(0, V, (1, 10))
    cache = KVCache(2)
    with torch.no_grad():
        a = model(idx[:, :6], cache=cache)
        b = model(idx[:, 6:], cache=cache)  # 4 tokens at once after 6 cached: the causal mask must be offset
        full = model(idx)
    assert cache.length == 10 and cache.layers[0].k.shape[-2] == 10
    torch.testing.assert_close(torch.cat((a, b), dim=1), full, rtol=1e-5, atol=1e-5)


def test_sampling_rules() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.9, 1.0]])
    assert sample(logits, temperature=0).tolist() == [0, 1]
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, top_k=1, generator=g).tolist() == [0, 1] for _ in range(20))
    assert all(sample(logits, top_p=1e-6, generator=g).tolist() == [0, 1] for _ in range(20))
    draws = torch.stack([sample(logits, top_k=2, generator=g) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {1, 2}
    p = logits[1].softmax(-1)  # top_p=0.7 on row 1: 1 (0.47) then 2 (0.43) reach it; 3 and 0 are cut
    assert p[1] < 0.7 < p[1] + p[2]
    draws = torch.stack([sample(logits, top_p=0.7, generator=g) for _ in range(300)])
    assert set(draws[:, 1].tolist()) == {1, 2}
    a = sample(logits, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, sample(logits, generator=torch.Generator().manual_seed(5)))  # seeded: reproducible


def test_greedy_decoding_with_several_samples_is_refused_before_loading(tmp_path: Path) -> None:
    from lmlab.analysis.generate import generate_text

    with pytest.raises(ValueError, match=r"temperature=0 is greedy: n=3 would print the same text 3 times"):
        generate_text(str(tmp_path / "no_run"), "The", temperature=0, n=3)  # refused before the run is looked for
