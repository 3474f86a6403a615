"""The configurations the bench compares and their Hugging Face peers at exactly lmlab's sizes."""

from __future__ import annotations

from torch import nn

SIZES = ["model.n_layer=6", "model.d_model=384", "model.n_head=6", "model.max_seq_len=256", "model.vocab_size=4096",
         "model.tie_embeddings=true", "model.dropout=0.0", "attention=mha", "placement=pre"]
LLAMA = ["norm=rms", "ffn=swiglu", "position=rope", "model.bias=false"]
GPT2 = ["norm=layer", "ffn=mlp", "activation=gelu_tanh", "position=learned", "model.bias=true"]
SMALL = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.max_seq_len=64"]
CONFIGS = {"llama": ("llama", SIZES + LLAMA), "gpt2": ("gpt2", SIZES + GPT2), "small": ("gpt2", SIZES + GPT2 + SMALL)}


# What each peer can express: overrides that leave these would compare two different architectures.
PEER_ARCH = {"llama": {"placement": "pre", "norm": "rms", "ffn": "swiglu", "position": "rope", "rope_scaling": "none"},
             "gpt2": {"placement": "pre", "norm": "layer", "ffn": "mlp", "activation": "gelu_tanh",
                      "position": "learned"}}


def hf_peer(kind: str, gcfg) -> nn.Module:
    """The transformers model with lmlab's sizes (same FFN width, eps, bias, tying), SDPA attention, no dropout."""
    import transformers

    specs = {**{g: getattr(gcfg, g) for g in PEER_ARCH[kind]}, "ffn": gcfg.ffn_spec}
    if wrong := {g: specs[g]["name"] for g, name in PEER_ARCH[kind].items() if specs[g]["name"] != name}:
        raise ValueError(f"the {kind} peer needs {PEER_ARCH[kind]}; the overrides set {wrong}")
    if any(gcfg.attention.get(k, d) != d for k, d in (("qk_norm", False), ("logn_scaling", False), ("temperature", 1))):
        raise ValueError(f"the {kind} peer has plain attention; drop attention flags {gcfg.attention}")
    common = dict(vocab_size=gcfg.vocab_size, tie_word_embeddings=gcfg.tie_embeddings, use_cache=False)
    if kind == "llama":
        hf = transformers.LlamaConfig(hidden_size=gcfg.d_model, intermediate_size=gcfg.ffn_hidden,
                                      num_hidden_layers=gcfg.n_layer, num_attention_heads=gcfg.n_head,
                                      num_key_value_heads=gcfg.kv_heads, max_position_embeddings=gcfg.max_seq_len,
                                      rms_norm_eps=gcfg.norm.get("eps", 1e-6), attention_bias=gcfg.bias,
                                      mlp_bias=gcfg.bias, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": gcfg.position["theta"]},
                                      **common)
        model = transformers.LlamaForCausalLM._from_config(hf, attn_implementation="sdpa")
    else:
        hf = transformers.GPT2Config(n_embd=gcfg.d_model, n_inner=gcfg.ffn_hidden, n_layer=gcfg.n_layer,
                                     n_head=gcfg.n_head, n_positions=gcfg.max_seq_len, activation_function="gelu_new",
                                     layer_norm_epsilon=gcfg.norm.get("eps", 1e-5), resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, **common)
        model = transformers.GPT2LMHeadModel._from_config(hf, attn_implementation="sdpa")
    return model.train()


def describe(gcfg) -> str:
    ffn = gcfg.ffn_spec["name"] + (f"({gcfg.activation['name']})" if gcfg.ffn_spec["name"] in ("mlp", "glu") else "")
    return (f"{gcfg.placement['name']}/{gcfg.norm['name']}/{ffn}/{gcfg.position['name']}, {gcfg.n_layer} layers x "
            f"d {gcfg.d_model} x {gcfg.n_head} heads ({gcfg.kv_heads} kv), ffn {gcfg.ffn_hidden}, bias "
            f"{str(gcfg.bias).lower()}, tied {str(gcfg.tie_embeddings).lower()}")

