"""Hugging Face interop: from_hf and to_hf give the transformers model's logits (fp32, tight tolerance) for Llama-like
(Mistral/Ministral windows, Gemma 2's softcaps and sandwich norms, DeepSeek-V3's MLA) and GPT-2-like configs — GQA
or not, tied or untied, every rope_scaling transformers represents, positions past the
original context — round-trip, and an exported run reloads with AutoModelForCausalLM / AutoTokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from lmlab import compose  # noqa: E402
from lmlab.config import GPTConfig  # noqa: E402
from lmlab.interop.hf import NotRepresentable, family, from_hf, lmlab_config, to_hf  # noqa: E402
from lmlab.model.gpt import GPT, validate  # noqa: E402
from lmlab.run.training import train  # noqa: E402
from tests.runs import tiny  # noqa: E402

V, ORIGINAL = 61, 16
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, attention_dropout=0.0)
# name -> (kv heads, tied, bias, rope_parameters, max_position_embeddings, tokens evaluated)
LLAMA_CASES = {
    "mha_tied": (4, True, False, {"rope_type": "default", "rope_theta": 10000.0}, ORIGINAL, ORIGINAL),
    "gqa_untied": (2, False, False, {"rope_type": "default", "rope_theta": 500000.0}, ORIGINAL, ORIGINAL),
    "mqa_bias": (1, True, True, {"rope_type": "default", "rope_theta": 10000.0}, ORIGINAL, ORIGINAL),
    "linear": (2, True, False, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 4 * ORIGINAL,
               4 * ORIGINAL),
    "dynamic": (2, False, False, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, ORIGINAL,
                3 * ORIGINAL),
    "yarn": (4, True, False, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL, 4 * ORIGINAL),
    "yarn_tuned": (2, False, False, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0, "beta_fast": 16.0,
                                     "beta_slow": 2.0, "attention_factor": 1.2,
                                     "original_max_position_embeddings": ORIGINAL}, 3 * ORIGINAL, 3 * ORIGINAL),
    "llama3": (2, True, False, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
               4 * ORIGINAL, 4 * ORIGINAL),
}
GPT2 = dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
GPT2_CASES = {"gelu_new_tied": ("gelu_new", True, None), "gelu_untied": ("gelu", False, 80),
              "relu_inner": ("relu", True, 64)}


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return (out.logits if hasattr(out, "logits") else out).float()


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


def _hf_llama(case: str):
    kv, tied, bias, rope, max_pos, _ = LLAMA_CASES[case]
    config = transformers.LlamaConfig(**{**LLAMA, "max_position_embeddings": max_pos}, num_key_value_heads=kv,
                                      tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
                                      rope_parameters=dict(rope))
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms at 1 would hide a gain mapped to the wrong place
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_from_hf_llama_gives_the_same_logits(case: str) -> None:
    hf = _hf_llama(case)
    ours = from_hf(hf)
    idx = _tokens(LLAMA_CASES[case][5])  # past the original context for the scaled variants
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)
    back = to_hf(ours)  # and the round trip
    torch.testing.assert_close(_logits(back, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)
    ours_rope = back.config.rope_parameters  # the original's keys, with transformers' defaults filled in
    assert {k: ours_rope.get(k) for k in hf.config.rope_parameters} == hf.config.rope_parameters


@pytest.mark.parametrize("kind,layer_types", [("mistral", None), ("ministral", ["sliding_attention",
                                                                              "full_attention"])])
def test_from_hf_sliding_window_models_give_the_same_logits(kind: str, layer_types) -> None:
    """A Mistral (every layer slides) and a Ministral (layer_types: local/global layers) with a window shorter than
    the text: lmlab's attention.window / pattern read from their configs, the logits equal."""
    config_cls = {"mistral": transformers.MistralConfig, "ministral": transformers.MinistralConfig}[kind]
    model_cls = {"mistral": transformers.MistralForCausalLM, "ministral": transformers.MinistralForCausalLM}[kind]
    extra = {} if layer_types is None else {"layer_types": layer_types}
    config = config_cls(**{k: v for k, v in LLAMA.items() if k != "max_position_embeddings"},
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=5, **extra)
    torch.manual_seed(4)
    hf = model_cls(config).eval()
    ours = from_hf(hf)
    assert ours.cfg.attention["window"] == 5
    assert ours.cfg.attention.get("pattern") == (None if layer_types is None else ["local", "global"])
    idx = _tokens(24)
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(GPT2_CASES))
def test_from_hf_gpt2_gives_the_same_logits(case: str) -> None:
    act, tied, inner = GPT2_CASES[case]
    torch.manual_seed(2)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, activation_function=act, n_inner=inner,
                                                              tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    ours = from_hf(hf)
    idx = _tokens(32)
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(to_hf(ours), idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)


LMLAB_CASES = {
    "llama_swiglu_gqa": dict(norm={"name": "rms", "eps": 1e-6}, ffn={"name": "swiglu"}, position={"name": "rope"},
                             attention={"name": "gqa"}, n_kv_head=2, tie_embeddings=False),
    "llama_geglu_yarn": dict(norm={"name": "rms"}, ffn={"name": "geglu"}, position={"name": "rope", "theta": 5e5},
                             rope_scaling={"name": "yarn", "factor": 2.0}, max_seq_len=32, train_len=16),
    "llama_ntk_by_parts": dict(norm={"name": "rms"}, ffn={"name": "glu"}, activation={"name": "silu"},
                               position={"name": "rope"}, rope_scaling={"name": "ntk_by_parts", "factor": 2.0},
                               max_seq_len=32, train_len=16),
    "gpt2_no_bias": dict(norm={"name": "layer", "bias": False}, position={"name": "learned"}, bias=False),
    # sliding windows: transformers' Ministral (its layer_types), every layer or a local/global pattern
    "ministral_window": dict(norm={"name": "rms"}, ffn={"name": "swiglu"}, position={"name": "rope"},
                             attention={"name": "gqa", "window": 5}, n_kv_head=2, tie_embeddings=False),
    "ministral_pattern": dict(norm={"name": "rms"}, ffn={"name": "swiglu"}, position={"name": "rope"},
                              attention={"name": "mha", "window": 3, "pattern": ["local", "global"]}),
    "gpt2_bias": dict(norm={"name": "layer"}, position={"name": "learned"}, activation={"name": "gelu_tanh"},
                      bias=True),
    # Gemma 2: the double placement, both softcaps, local/global layers (and a temperature: query_pre_attn_scalar)
    "gemma2_softcaps_pattern": dict(norm={"name": "rms"}, ffn={"name": "geglu"}, activation={"name": "gelu_tanh"},
                                    placement={"name": "double"}, position={"name": "rope"}, logit_softcap=5.0,
                                    attention={"name": "gqa", "softcap": 2.0, "window": 5,
                                               "pattern": ["local", "global"]}, n_kv_head=2),
    "gemma2_tied_temperature": dict(norm={"name": "rms", "eps": 1e-6}, ffn={"name": "swiglu"},
                                    placement={"name": "double"}, position={"name": "rope"},
                                    attention={"name": "mha", "temperature": 1.5}),
    # GPT-NeoX / Pythia: LayerNorm, an MLP, partial RoPE; parallel blocks (its default) or sequential
    "neox_parallel": dict(norm={"name": "layer"}, position={"name": "rope", "rotary_pct": 0.25}, bias=True,
                          residual={"parallel": {}}, tie_embeddings=False),
    "neox_sequential_no_bias": dict(norm={"name": "layer", "bias": False}, position={"name": "rope", "theta": 5e4},
                                    activation={"name": "gelu_tanh"}),
    # multi-head latent attention: transformers' DeepSeek-V3 with every layer dense
    "deepseek_mla": dict(norm={"name": "rms", "eps": 1e-6}, ffn={"name": "swiglu"}, position={"name": "rope"},
                         attention={"name": "mla", "kv_lora_rank": 12}, tie_embeddings=False),
    "deepseek_mla_q_lora": dict(norm={"name": "rms"}, ffn={"name": "geglu"}, position={"name": "rope", "theta": 5e5},
                                attention={"name": "mla", "kv_lora_rank": 16, "q_lora_rank": 24,
                                           "qk_rope_head_dim": 6, "qk_nope_head_dim": 10, "v_head_dim": 12}),
}


@pytest.mark.parametrize("case", sorted(LMLAB_CASES))
def test_to_hf_gives_the_same_logits_and_round_trips(case: str) -> None:
    kw = {"vocab_size": V, "n_layer": 2, "d_model": 32, "n_head": 4, "max_seq_len": 16, **LMLAB_CASES[case]}
    torch.manual_seed(3)
    ours = GPT(validate(GPTConfig(**kw))).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5)
    hf = to_hf(ours)
    idx = _tokens(ours.cfg.max_seq_len)
    torch.testing.assert_close(_logits(hf, idx), _logits(ours, idx), rtol=1e-5, atol=1e-5)
    back = from_hf(hf)
    torch.testing.assert_close(_logits(back, idx), _logits(ours, idx), rtol=1e-5, atol=1e-5)
    assert family(back.cfg) == family(ours.cfg)
    for key in ("n_layer", "d_model", "n_head", "max_seq_len", "train_len", "vocab_size"):
        assert getattr(back.cfg, key) == getattr(ours.cfg, key), key
    # Gemma 2 scales the embeddings on the way in only: a tied model comes back untied (the same function)
    assert back.cfg.tie_embeddings == (ours.cfg.tie_embeddings and family(ours.cfg) != "gemma2")
    assert back.cfg.ffn_hidden == ours.cfg.ffn_hidden and back.cfg.kv_heads == ours.cfg.kv_heads
    assert back.cfg.norm["eps"] == ours.cfg.norm.get("eps", back.cfg.norm["eps"])
    assert back.cfg.logit_softcap == ours.cfg.logit_softcap
    assert ("parallel" in back.cfg.residual) == ("parallel" in ours.cfg.residual)
    for key in ("softcap", "temperature", "window", "pattern", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim"):
        assert back.cfg.attention.get(key) == ours.cfg.attention.get(key), key


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("interleave", [False, True])
def test_from_hf_deepseek_v3_gives_the_same_logits(q_lora_rank, interleave: bool) -> None:
    """A DeepSeek-V3 whose layers are all dense (MLA + SwiGLU), with DeepSeek's interleaved RoPE channels or not."""
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in LLAMA.items() if k != "rms_norm_eps"}, rms_norm_eps=1e-6, num_key_value_heads=4,
        first_k_dense_replace=2, kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=4, qk_nope_head_dim=6,
        v_head_dim=10, rope_interleave=interleave, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(5)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.3)  # sharp attention: transformers' init (0.02) leaves it nearly uniform
    ours = from_hf(hf)
    assert ours.cfg.attention["name"] == "mla" and ours.cfg.cache_width == 12 + 4
    idx = _tokens(ORIGINAL)
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_from_hf_gemma2_gives_the_same_logits(tied: bool) -> None:
    """Gemma 2 as transformers builds it by default (alternating local/global layers, attention softcap 50, final
    softcap 30), softcaps tightened so that they bite, a window shorter than the text."""
    config = transformers.Gemma2Config(
        **{k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=32, sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
        query_pre_attn_scalar=12, tie_word_embeddings=tied, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(6)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)  # Gemma's gains are 1 + w
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.2)
    ours = from_hf(hf)
    assert ours.cfg.placement["name"] == "double" and ours.cfg.attention["pattern"] == ["local", "global"]
    assert not ours.cfg.tie_embeddings  # the embeddings are scaled on the way in only
    idx = _tokens(24)
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallel", [True, False])
def test_from_hf_gpt_neox_gives_the_same_logits(parallel: bool) -> None:
    """A Pythia-like GPT-NeoX: a quarter of each head rotated, parallel attention and MLP (or not), biases."""
    config = transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=ORIGINAL, use_parallel_residual=parallel, rotary_pct=0.5, rotary_emb_base=10000,
        attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(7)
    hf = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.3, 0.3)
            elif name.endswith("bias"):
                p.uniform_(-0.3, 0.3)  # every bias where it belongs: a head's q, k, v rows are interleaved
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.2)
    ours = from_hf(hf)
    assert ("parallel" in ours.cfg.residual) == parallel and ours.cfg.position["rotary_pct"] == 0.5
    idx = _tokens(ORIGINAL)
    torch.testing.assert_close(_logits(ours, idx), _logits(hf, idx), rtol=1e-5, atol=1e-5)


def test_a_deepseek_v3_with_expert_layers_is_refused_by_key() -> None:
    config = transformers.DeepseekV3Config(**LLAMA, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=None)
    with pytest.raises(NotRepresentable, match="first_k_dense_replace=1 < num_hidden_layers=2: dense first layers"):
        lmlab_config(config)


@pytest.mark.parametrize("override,axis", [
    ({"placement": {"name": "post"}}, "placement='post'"),
    ({"placement": {"name": "deepnorm"}}, "placement='deepnorm'"),
    ({"activation": {"name": "squareplus"}}, "activation='squareplus'"),
    ({"position": {"name": "alibi"}}, "position='alibi'"),
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "rope_scaling": {"name": "ntk", "factor": 2.0}}, "rope_scaling='ntk'"),
    ({"attention": {"name": "mha", "qk_norm": True}}, "attention.qk_norm=True"),
    ({"norm": {"name": "scale"}}, "norm='scale'"),
    ({"ffn": {"name": "swiglu"}}, "ffn='swiglu'"),  # learned positions: GPT-2, whose FFN is an MLP
    ({"attention": {"name": "mha", "window": 4}}, "attention.window=4"),  # GPT-2 has no sliding window
    ({"attention": {"name": "mha", "softcap": 5.0}}, "attention.softcap=5.0"),
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "bias": True,
      "attention": {"name": "mha", "window": 4}}, "model.bias=True"),  # Ministral has no biases
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "n_layer": 2,
      "attention": {"name": "mha", "pattern": [4, 6]}}, "attention.pattern="),  # one window size in transformers
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mla", "window": 4}}, "attention.window=4"),  # DeepSeek-V3 has no sliding window
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "bias": True,
      "attention": {"name": "mla"}}, "model.bias=True"),  # DeepSeek-V3's MLP has no biases
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "max_seq_len": 32,
      "train_len": 16, "rope_scaling": {"name": "yarn"}, "attention": {"name": "mla"}}, "rope_scaling='yarn'"),
    ({"attention": {"name": "mla"}}, "position='learned'"),  # MLA's decoupled part is rotated
    ({"residual": {"value_residual": {}}}, "residual='value_residual'"),
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "n_layer": 2, "residual": {"standard": {}, "unet": {}}}, "residual='unet'"),
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "placement": {"name": "double"},
      "attention": {"name": "mha", "temperature": 1.1}}, "attention.temperature=1.1"),  # an integer in Gemma 2
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "placement": {"name": "double"},
      "attention": {"name": "mha", "sinks": True}}, "attention.sinks=True"),  # no sinks in Gemma 2
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "forget_gate": True}}, "attention.forget_gate=True"),  # no Llama has FoX's gate
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "mem_kv": 2}}, "attention.mem_kv=2"),  # nor memory keys: they were left out
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "xsa": "gated"}}, "attention.xsa='gated'"),  # nor exclusive self-attention
    ({"position": {"name": "rope", "rotary_pct": 0.5}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "key_offset": True}}, "attention.key_offset=True"),  # nor shifted key dims
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "paired_heads": True}}, "attention.paired_heads=True"),  # nor paired heads
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "head_temperature": True}}, "attention.head_temperature=True"),  # any new part
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "attention": {"name": "mha", "select_blocks": 2}}, "attention.select_blocks=2"),  # until an export maps it
    ({"position": {"name": "rope", "window_yarn": True}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"},
      "max_seq_len": 16, "attention": {"name": "mha", "window": 8, "window_schedule": [[0, 4], [0.5, 8]]}},
     "position.window_yarn=True"),  # nor frequencies that follow the training's windows
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu", "skip_layers": [0]},
      "n_layer": 2}, r"ffn.skip_layers=\[0\]"),  # every family's layer has its MLP
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "n_layer": 2,
      "mixer": {"name": "attention", "pattern": ["none", "attention"]}}, "mixer.pattern="),  # and its attention
    ({"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}, "placement": {"name": "double"},
      "logit_softcap": 11.5, "logit_softcap_offset": 5.0}, "model.logit_softcap_offset=5.0"),  # Gemma 2's: c·tanh(z/c)
])
def test_what_transformers_cannot_represent_is_refused_by_axis(override: dict, axis: str) -> None:
    kw = {"vocab_size": V, "n_layer": 1, "d_model": 32, "n_head": 4, "max_seq_len": 16,
          "norm": {"name": "layer"}, "position": {"name": "learned"}, **override}
    model = GPT(validate(GPTConfig(**kw)))
    with pytest.raises(NotRepresentable, match=f"^{axis.replace('(', '[(]')}"):
        to_hf(model)


def test_an_unrepresentable_hf_config_is_refused() -> None:
    config = transformers.LlamaConfig(**LLAMA, num_key_value_heads=4, attention_bias=True, mlp_bias=False)
    with pytest.raises(NotRepresentable, match="attention_bias=True with mlp_bias=False"):
        lmlab_config(config)


def _llama_dir(path: Path, **config) -> Path:
    """A small transformers Llama saved with save_pretrained, and a tokenizer.json of its vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                                             max_position_embeddings=32), **config})
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({chr(65 + i): i for i in range(64)}, unk_token="A"))  # one id per character
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_hf_import_refuses_a_config_too_large_for_the_machine_before_building(tmp_path: Path) -> None:
    import json
    import time

    from lmlab.interop.hf import load_hf_dir

    path = _llama_dir(tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    config.pop("head_dim", None)  # hidden_size / num_attention_heads
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 200000, "hidden_size": 4096,
                                                  "intermediate_size": 11008, "num_attention_heads": 32,
                                                  "num_key_value_heads": 32}))
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"{path}/config.json: model.n_layer=200000 model.d_model=4096 .* B "
                                         r"parameters and needs at least ~\d+\.\d GiB to build"):
        load_hf_dir(path)
    assert time.monotonic() - started < 30  # refused from the arithmetic, not after a build


def test_the_plan_adopts_an_init_from_source_into_its_own_copy_of_the_config(corpus: Path, tmp_path: Path) -> None:
    """plan -> accept -> fit -> record: what init_from=<transformers dir> adopts (its architecture, its tokenizer,
    RoPE's reference length) is in the plan's effective config, and the caller's config is left as it was."""
    from omegaconf import OmegaConf

    from lmlab.record.rundir import RunDir
    from lmlab.run.plan import make_plan

    source = _llama_dir(tmp_path / "hf")
    cfg = compose(tiny(corpus, tmp_path / "cache", f"init_from={source}", "rope_scaling=linear",
                       "rope_scaling.factor=2"))
    before = OmegaConf.to_yaml(cfg)
    plan = make_plan(cfg, RunDir(tmp_path / "run"), "auto", "auto")
    assert OmegaConf.to_yaml(cfg) == before  # no helper wrote into the caller's config
    assert plan.cfg.data.tokenizer == str(source / "tokenizer.json") and plan.cfg.norm.name == "rms"
    assert plan.cfg.rope_scaling.original_max_len == 32  # the source's trained length
    assert plan.model.ffn_hidden == 64 and plan.model.n_layer == 2 and plan.source["path"] == str(source)
    assert plan.ckpt is None and not plan.ended and not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_is_readable_as_the_umask_says(corpus: Path, tmp_path: Path, umask: int) -> None:
    """safetensors writes model.safetensors 0600 whatever the umask; the export gives it the mode of every other file
    it writes (0644 under umask 022, 0640 under 027), so colleagues who can read config.json can load the weights."""
    from lmlab.interop.hf import export

    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=2", "trainer.val_check_interval=2")), run)
    old = os.umask(umask)
    try:
        out = export(run, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}, modes
