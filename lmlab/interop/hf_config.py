"""The config half of the transformers interop (lmlab.interop.hf): which lmlab architectures transformers represents
exactly (`family`), and the config fields both ways (`hf_config`, `lmlab_config`). Anything else is refused naming
the axis and value (`NotRepresentable`)."""

from __future__ import annotations

from typing import Any

from lmlab.config import GPTConfig
from lmlab.model.attention import MHA
from lmlab.registry import option_defaults
from lmlab.interop.hf_hybrid import HYBRID_TYPES, check_hybrid, hybrid_family, hybrid_hf_config, lmlab_hybrid
from lmlab.interop.hf_moe import (
    MOE_TYPES,
    check_deepseek_moe,
    deepseek_ffn,
    deepseek_fields,
    hf_moe_config,
    lmlab_ffn,
    moe_attention,
    moe_family,
)
from lmlab.interop.refusal import NotRepresentable
from lmlab.interop.refusal import refuse as _refuse

# lmlab activation -> transformers ACT2FN name (exact same function), and back.
_ACTS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
_ACTS_BACK = {**{v: k for k, v in _ACTS.items()}, "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "swish": "silu"}
_GLU_GATES = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}
# lmlab rope_scaling -> transformers rope_type; the rest (static ntk, dynamic_linear, dynamic_yarn) has no
# transformers form.
_ROPE_TYPES = {"none": "default", "linear": "linear", "dynamic_ntk": "dynamic", "yarn": "yarn",
               "ntk_by_parts": "yarn", "llama3": "llama3"}


def family(cfg: GPTConfig) -> str:
    """'llama', 'ministral' (Llama-like with sliding-window layers: transformers' Ministral, whose `layer_types`
    say which layers slide), 'deepseek_v3' (Llama-like with attention=mla: DeepSeek-V3's dense or routed layers),
    'mixtral' / 'qwen2_moe' / 'qwen3_moe' (Llama-like with ffn=moe: lmlab.interop.hf_moe), 'gemma2' (the
    double placement with softcaps and local/global layers), 'gpt_neox' (LayerNorm, an MLP and partial RoPE, the
    blocks parallel or not), 'gpt2', or 'bamba' / 'qwen3_next' (a recurrent mixer in some layers:
    lmlab.interop.hf_hybrid), or NotRepresentable naming the first axis that fits none."""
    pos = cfg.position["name"]
    if (head := cfg.head.get("name", "next")) not in ("next", "mtp"):  # mtp: its extra modules are left out
        raise _refuse("head", head, "causal language model", "head=next (or head=mtp, whose extra modules are "
                      "training's); a bidirectional encoder's head has none")
    if cfg.mixer.get("name", "attention") != "attention":
        return _check_hybrid(cfg)
    if cfg.attention.get("name") == "mla":
        return _check_deepseek(cfg)
    if cfg.placement["name"] == "double":
        return _check_gemma2(cfg)
    if "parallel" in cfg.residual or (pos == "rope" and cfg.norm["name"] == "layer" and cfg.ffn["name"] == "mlp"):
        return _check_neox(cfg)
    if pos == "rope":
        return _check_llama(cfg)
    if pos == "learned":
        return _check_gpt2(cfg)
    raise _refuse("position", pos, "Llama or GPT-2", "position=rope (Llama) or position=learned (GPT-2)")


def _check_common(cfg: GPTConfig, fam: str, windows: bool = False, attentions: tuple[str, ...] = ("mha", "gqa", "mqa"),
                  placement: str = "pre", softcaps: bool = False, residual: tuple[str, ...] = (),
                  qk_norm: bool = False, mixer: str = "attention", gate: bool = False) -> None:
    if cfg.block.get("name", "transformer") != "transformer":
        raise _refuse("block", cfg.block["name"], fam, "block=transformer")
    if cfg.mixer.get("name", "attention") != mixer:  # every layer softmax attention, but in the hybrid families
        raise _refuse("mixer", cfg.mixer["name"], fam, f"mixer={mixer}")
    if "none" in (cfg.mixer.get("pattern") or []):  # a layer without a token mixer: no family has one
        raise _refuse("mixer.pattern", list(cfg.mixer["pattern"]), fam, "a token mixer in every layer")
    if cfg.ffn.get("skip_layers"):
        raise _refuse("ffn.skip_layers", list(cfg.ffn["skip_layers"]), fam, "ffn.skip_layers=null")
    if extra := [name for name in cfg.residual if name not in (*residual, "standard")]:
        raise _refuse("residual", extra[0], fam, f"residual={'|'.join(('standard', *residual))}")
    if cfg.placement["name"] != placement:
        raise _refuse("placement", cfg.placement["name"], fam, f"placement={placement}")
    if cfg.param.get("name", "sp") != "sp":  # µP's attention scale and logit multiplier have no config field
        raise _refuse("param", cfg.param["name"], fam, "param=sp")
    if cfg.position.get("layout", "half") != "half":  # these families rotate the halves (transformers' rotate_half)
        raise _refuse("position.layout", cfg.position["layout"], fam, "position.layout=half")
    attn = cfg.attention
    if cfg.attention["name"] not in attentions:
        raise _refuse("attention", cfg.attention["name"], fam, f"attention={'|'.join(attentions)}")
    if cfg.embed_norm:
        raise _refuse("model.embed_norm", True, fam, "model.embed_norm=false")
    if cfg.embed_scale is not None:
        raise _refuse("model.embed_scale", cfg.embed_scale, fam, "model.embed_scale=null")
    if cfg.logit_softcap is not None and not softcaps:
        raise _refuse("model.logit_softcap", cfg.logit_softcap, fam, "model.logit_softcap=null")
    if cfg.logit_softcap_width is not None:  # transformers' final softcap is c·tanh(z / c) (Gemma 2's)
        raise _refuse("model.logit_softcap_width", cfg.logit_softcap_width, fam, "model.logit_softcap_width=null")
    if cfg.logit_softcap_offset:
        raise _refuse("model.logit_softcap_offset", cfg.logit_softcap_offset, fam, "model.logit_softcap_offset=0")
    if cfg.position.get("per_document"):
        raise _refuse("position.per_document", True, fam, "position.per_document=false")
    if cfg.position.get("window_yarn"):  # frequencies that follow the training's windows: not a rope_parameters form
        raise _refuse("position.window_yarn", True, fam, "position.window_yarn=false")
    # An allow-list: every attention key (MHA's own and every part's, lmlab.model.attention.parts) at its default
    # but those the family has a form for, so a new attention-wide key is refused until an export maps it.
    # qk_norm_eps: each family checks it against its norm's eps; window_schedule: training only, it ends at the
    # model's windows (transformers' windows are tokens, one for every use: window_block and eval_window refused)
    exported = {"qk_norm_eps", "window_schedule", *(("qk_norm",) if qk_norm else ()),
                *(("temperature", "softcap") if softcaps else ()), *(("gate",) if gate else ()),
                *(("window", "pattern") if windows else ())}
    for key, plain in option_defaults(MHA).items():
        if key not in exported and attn.get(key, plain) != plain:
            raise _refuse(f"attention.{key}", attn[key], fam, f"attention.{key}={'null' if plain is None else plain}")


def layer_windows(cfg: GPTConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as lmlab's attention builds it: the layer plan's."""
    from lmlab.model.layers import layer_plan

    return [layer.window for layer in layer_plan(cfg)]


def _check_llama(cfg: GPTConfig) -> str:
    windows = [w for w in layer_windows(cfg) if w is not None]
    routed = cfg.ffn["name"] == "moe"  # Qwen3-MoE has q/k norms (lmlab.interop.hf_moe decides)
    _check_common(cfg, "Llama", windows=True, qk_norm=routed)
    if windows:  # transformers' Ministral: Llama's layers, some sliding over one window, no biases
        if len(set(windows)) > 1:
            raise _refuse("attention.pattern", cfg.attention.get("pattern"), "Ministral",
                          "one window size for every local layer")
        if cfg.bias:
            raise _refuse("model.bias", cfg.bias, "Ministral", "model.bias=false (its Linear layers have none)")
    if routed:  # Llama's attention with routed experts: Mixtral, Qwen2-MoE or Qwen3-MoE (lmlab.interop.hf_moe)
        fam = "Mixtral, Qwen2-MoE or Qwen3-MoE"
        _check_llama_layers(cfg, fam, glu=False)
        if windows:
            raise _refuse("attention.window", cfg.attention.get("window"), fam, "attention.window=null")
        _check_rope_scaling(cfg)
        return moe_family(cfg, _glu_act(cfg))
    _check_llama_layers(cfg, "Llama")
    _check_rope_scaling(cfg)
    return "ministral" if windows else "llama"


def _check_rope_scaling(cfg: GPTConfig) -> None:
    if cfg.rope_scaling["name"] not in _ROPE_TYPES:
        raise _refuse("rope_scaling", cfg.rope_scaling["name"], "Llama", f"one of {sorted(_ROPE_TYPES)}")
    if cfg.rope_scaling.get("ramp", "index") != "index":  # transformers' YaRN ramps in the pair index
        raise _refuse("rope_scaling.ramp", cfg.rope_scaling["ramp"], "Llama", "rope_scaling.ramp=index")


def _check_llama_layers(cfg: GPTConfig, fam: str, glu: bool = True, partial_rotary: bool = False) -> None:
    """What Llama-like families share: RMSNorm with a gain, a GLU FFN (`glu`: the MoE families check their experts
    themselves), RoPE on every layer's whole rotated part (`partial_rotary`: or on its first rotary_pct)."""
    if cfg.norm["name"] != "rms" or not cfg.norm.get("affine", True):
        raise _refuse("norm", cfg.norm["name"], fam, "norm=rms with a gain")
    if glu and _glu_act(cfg) is None:
        raise _refuse("ffn", cfg.ffn["name"], fam, "a GLU FFN with a silu/gelu/gelu_tanh/relu gate")
    if cfg.position.get("nope_layers"):
        raise _refuse("position.nope_layers", cfg.position["nope_layers"], fam, "position.nope_layers=null")
    if cfg.position.get("rotary_pct", 1.0) != 1.0 and not partial_rotary:
        raise _refuse("position.rotary_pct", cfg.position["rotary_pct"], fam, "rotary_pct=1")


def _check_hybrid(cfg: GPTConfig) -> str:
    """Bamba (mixer=mamba2) or Qwen3-Next (mixer=gdn; its attention's q/k norms and output gate): Llama's layers with
    the mixer in some, RoPE on the first rotary_pct of each head (lmlab.interop.hf_hybrid checks the rest)."""
    fam = hybrid_family(cfg)
    name, qwen = HYBRID_TYPES[fam], fam == "qwen3_next"
    if cfg.position["name"] != "rope":
        raise _refuse("position", cfg.position["name"], name, "position=rope")
    _check_common(cfg, name, mixer=cfg.mixer["name"], qk_norm=qwen, gate=qwen)
    _check_llama_layers(cfg, name, partial_rotary=True)
    check_hybrid(cfg, fam, _glu_act(cfg))
    return fam


def _check_deepseek(cfg: GPTConfig) -> str:
    """DeepSeek-V3's architecture with every layer dense (first_k_dense_replace = n_layer: MLA and a SwiGLU-like
    FFN) or every layer routed (ffn=moe with sigmoid scores: lmlab.interop.hf_moe). Its YaRN scales the softmax by
    mscale rather than the rotation, and its MLP has no biases: refused."""
    fam = "DeepSeek-V3"
    if cfg.position["name"] != "rope":
        raise _refuse("position", cfg.position["name"], fam, "position=rope")
    _check_common(cfg, fam, attentions=("mla",))
    routed = cfg.ffn["name"] == "moe"
    _check_llama_layers(cfg, fam, glu=not routed)
    if routed:
        check_deepseek_moe(cfg, _glu_act(cfg))
    if cfg.rope_scaling["name"] != "none":
        raise _refuse("rope_scaling", cfg.rope_scaling["name"], fam, "rope_scaling=none")
    if cfg.bias:
        raise _refuse("model.bias", cfg.bias, fam, "model.bias=false (its MLP has no biases)")
    return "deepseek_v3"


def _check_gemma2(cfg: GPTConfig) -> str:
    """Gemma 2: Llama's layers with the double (sandwich) placement, the attention-logit and final-logit softcaps,
    local/global layers of one window, no biases. Its RMSNorm gains are stored as w − 1, its embeddings multiplied by
    sqrt(d_model) (exported untied, divided by it), its attention scale 1/sqrt(query_pre_attn_scalar) (lmlab's
    temperature t: query_pre_attn_scalar = head_dim·t²)."""
    fam = "Gemma 2"
    if cfg.position["name"] != "rope":
        raise _refuse("position", cfg.position["name"], fam, "position=rope")
    _check_common(cfg, fam, windows=True, placement="double", softcaps=True)
    _check_llama_layers(cfg, fam)
    if len({w for w in layer_windows(cfg) if w is not None}) > 1:
        raise _refuse("attention.pattern", cfg.attention.get("pattern"), fam, "one window size for every local layer")
    if cfg.bias:
        raise _refuse("model.bias", cfg.bias, fam, "model.bias=false (its MLP has no biases)")
    if cfg.rope_scaling["name"] != "none":
        raise _refuse("rope_scaling", cfg.rope_scaling["name"], fam, "rope_scaling=none")
    scalar = cfg.head_dim * float(cfg.attention.get("temperature", 1.0)) ** 2
    if abs(scalar - round(scalar)) > 1e-9 * scalar:
        raise _refuse("attention.temperature", cfg.attention["temperature"], fam,
                      f"head_dim·temperature² an integer (its query_pre_attn_scalar; here {scalar:g})")
    return "gemma2"


def _query_pre_attn_scalar(cfg: GPTConfig) -> int:
    """Gemma 2 scales logits by query_pre_attn_scalar^-½ = 1 / (sqrt(head_dim)·temperature)."""
    return round(cfg.head_dim * float(cfg.attention.get("temperature", 1.0)) ** 2)


def _check_neox(cfg: GPTConfig) -> str:
    """GPT-NeoX (and Pythia): pre-LayerNorm blocks, parallel (`use_parallel_residual`, its default) or sequential, an
    MLP, RoPE on the first `rotary_pct` of each head, MHA. Its MLP and norms always have biases: a model without them
    is written with zero biases (the same function)."""
    fam = "GPT-NeoX"
    if cfg.position["name"] != "rope":
        raise _refuse("position", cfg.position["name"], fam, "position=rope")
    _check_common(cfg, fam, residual=("parallel",))
    if cfg.norm["name"] != "layer" or not cfg.norm.get("affine", True):
        raise _refuse("norm", cfg.norm["name"], fam, "norm=layer with a gain")
    if cfg.ffn["name"] != "mlp":
        raise _refuse("ffn", cfg.ffn["name"], fam, "ffn=mlp")
    if cfg.activation["name"] not in _ACTS:
        raise _refuse("activation", cfg.activation["name"], fam, f"one of {sorted(_ACTS)}")
    if cfg.kv_heads != cfg.n_head:
        raise _refuse("attention", cfg.attention["name"], fam, "attention=mha")
    if cfg.position.get("nope_layers"):
        raise _refuse("position.nope_layers", cfg.position["nope_layers"], fam, "position.nope_layers=null")
    if cfg.rope_scaling["name"] != "none":
        raise _refuse("rope_scaling", cfg.rope_scaling["name"], fam, "rope_scaling=none")
    return "gpt_neox"


def _check_gpt2(cfg: GPTConfig) -> str:
    _check_common(cfg, "GPT-2")
    if cfg.norm["name"] != "layer" or not cfg.norm.get("affine", True):
        raise _refuse("norm", cfg.norm["name"], "GPT-2", "norm=layer with a gain")
    if cfg.ffn["name"] != "mlp":
        raise _refuse("ffn", cfg.ffn["name"], "GPT-2", "ffn=mlp")
    if cfg.activation["name"] not in _ACTS:
        raise _refuse("activation", cfg.activation["name"], "GPT-2", f"one of {sorted(_ACTS)}")
    if cfg.kv_heads != cfg.n_head:
        raise _refuse("attention", cfg.attention["name"], "GPT-2", "attention=mha")
    return "gpt2"


def _glu_act(cfg: GPTConfig) -> str | None:
    """transformers' name of the GLU gate (an MoE's experts' gate), or None for an FFN that is no GLU it has."""
    name = cfg.ffn.get("expert", "mlp") if cfg.ffn["name"] == "moe" else cfg.ffn["name"]
    gate = _GLU_GATES.get(name) or (cfg.activation["name"] if name == "glu" else None)
    return _ACTS.get(gate) if gate else None


# --- config ------------------------------------------------------------------------------------------------

def _rope_parameters(cfg: GPTConfig) -> tuple[dict[str, Any], int]:
    """transformers' rope_parameters and max_position_embeddings for an lmlab RoPE config."""
    s = dict(cfg.rope_scaling)
    name = s.pop("name")
    theta = float(cfg.position.get("theta", 10000.0))
    original = s.get("original_max_len") or cfg.train_len
    params: dict[str, Any] = {"rope_type": _ROPE_TYPES[name], "rope_theta": theta}
    if name == "none":
        return params, cfg.max_seq_len
    factor = s.get("factor") or cfg.max_seq_len / original
    if name == "linear":
        return {**params, "factor": float(factor)}, cfg.max_seq_len
    if name == "dynamic_ntk":  # transformers takes the trained length from max_position_embeddings
        return {**params, "factor": float(s.get("factor", 1.0))}, original
    if name == "llama3":
        return {**params, "factor": float(factor), "original_max_position_embeddings": original,
                "low_freq_factor": float(s.get("low_freq_factor", 1.0)),
                "high_freq_factor": float(s.get("high_freq_factor", 4.0))}, cfg.max_seq_len
    params |= {"factor": float(factor), "original_max_position_embeddings": original,
               "beta_fast": float(s.get("beta_fast", 32.0)), "beta_slow": float(s.get("beta_slow", 1.0)),
               "truncate": bool(s.get("truncate", True))}
    if name == "ntk_by_parts":  # YaRN's frequencies with attention factor 1
        return {**params, "attention_factor": 1.0}, cfg.max_seq_len
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if s.get(key) is not None:
            params[key] = float(s[key])
    return params, cfg.max_seq_len


def hf_config(cfg: GPTConfig) -> Any:
    """The transformers config of the same architecture (LlamaConfig or GPT2Config)."""
    import transformers

    fam = family(cfg)
    if fam == "deepseek_v3":
        rope, max_pos = _rope_parameters(cfg)
        a = cfg.attention
        return transformers.DeepseekV3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, **deepseek_fields(cfg), num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_head, kv_lora_rank=a["kv_lora_rank"],
            q_lora_rank=a["q_lora_rank"], qk_rope_head_dim=a["qk_rope_head_dim"],
            qk_nope_head_dim=a["qk_nope_head_dim"], v_head_dim=a["v_head_dim"], hidden_act=_glu_act(cfg),
            max_position_embeddings=max_pos, rms_norm_eps=float(cfg.norm.get("eps", 1e-6)),
            tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope, rope_interleave=False,
            attention_bias=False, attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
    if fam == "gpt_neox":
        rope, max_pos = _rope_parameters(cfg)
        return transformers.GPTNeoXConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, hidden_act=_ACTS[cfg.activation["name"]],
            max_position_embeddings=max_pos, layer_norm_eps=float(cfg.norm.get("eps", 1e-5)),
            tie_word_embeddings=cfg.tie_embeddings, use_parallel_residual="parallel" in cfg.residual,
            rope_parameters={**rope, "partial_rotary_factor": float(cfg.position.get("rotary_pct", 1.0))},
            attention_bias=True, attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=None, eos_token_id=None)
    if fam == "gemma2":
        rope, max_pos = _rope_parameters(cfg)
        windows = layer_windows(cfg)
        return transformers.Gemma2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, hidden_activation=_glu_act(cfg), max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.norm.get("eps", 1e-6)), tie_word_embeddings=False, rope_parameters=rope,
            query_pre_attn_scalar=_query_pre_attn_scalar(cfg),
            attn_logit_softcapping=cfg.attention.get("softcap"), final_logit_softcapping=cfg.logit_softcap,
            sliding_window=next((w for w in windows if w is not None), cfg.max_seq_len),
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
            attention_bias=False, attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if fam in ("llama", "ministral", *MOE_TYPES, *HYBRID_TYPES):
        rope, max_pos = _rope_parameters(cfg)
        common = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, hidden_act=_glu_act(cfg), max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.norm.get("eps", 1e-6)), tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters=rope, attention_dropout=0.0)
        if fam in MOE_TYPES:
            return hf_moe_config(cfg, fam, common)
        if fam in HYBRID_TYPES:
            return hybrid_hf_config(cfg, fam, common)
        if fam == "llama":
            return transformers.LlamaConfig(**common, attention_bias=cfg.bias, mlp_bias=cfg.bias)
        windows = layer_windows(cfg)
        return transformers.MinistralConfig(
            **common, sliding_window=next(w for w in windows if w is not None), bos_token_id=None, eos_token_id=None,
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])
    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=cfg.ffn_hidden, activation_function=_ACTS[cfg.activation["name"]],
        layer_norm_epsilon=float(cfg.norm.get("eps", 1e-5)), tie_word_embeddings=cfg.tie_embeddings,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )


def _exact_ffn(hidden: int) -> dict[str, Any]:
    """The ffn sizes that make GPTConfig take exactly `hidden` (not the parameter-matched size it derives)."""
    return {"hidden": hidden}


def lmlab_config(hf: Any) -> GPTConfig:
    """The GPTConfig of a transformers LlamaConfig, MistralConfig, MinistralConfig or GPT2Config (and of the
    relatives `family` names: lmlab.interop.hf_moe's, lmlab.interop.hf_hybrid's, ...)."""
    kind = hf.model_type
    if kind in ("llama", "mistral", "ministral", *MOE_TYPES):
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            raise NotRepresentable(f"head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} != "
                                   f"hidden_size={hf.hidden_size}: lmlab's heads split d_model")
        # Mistral's and Ministral's Linear layers have no biases
        attention_bias, mlp_bias = (hf.attention_bias, hf.mlp_bias) if kind == "llama" else (False, False)
        if attention_bias != mlp_bias:
            raise NotRepresentable(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: lmlab has one "
                                   f"model.bias for every Linear")
        act = _ACTS_BACK.get(hf.hidden_act)
        if act is None:
            raise NotRepresentable(f"hidden_act={hf.hidden_act!r}: lmlab's gates are {sorted(_ACTS_BACK)}")
        named = {gate: name for name, gate in _GLU_GATES.items()}
        ffn = {"name": named.get(act, "glu"), **_exact_ffn(hf.intermediate_size)}
        if kind in MOE_TYPES:  # routed experts of that GLU kind (lmlab.interop.hf_moe)
            ffn = lmlab_ffn(hf, named.get(act, "glu"))
        rope, max_len, train_len = _rope_scaling_back(hf)
        return GPTConfig(
            vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, d_model=hf.hidden_size,
            n_head=hf.num_attention_heads, n_kv_head=hf.num_key_value_heads, max_seq_len=max_len,
            train_len=train_len, bias=bool(attention_bias), tie_embeddings=bool(hf.tie_word_embeddings),
            norm={"name": "rms", "eps": float(hf.rms_norm_eps), "affine": True}, placement={"name": "pre"},
            activation={"name": act}, ffn=ffn, position={"name": "rope", "theta": rope.pop("theta")},
            rope_scaling=rope, attention={"name": _attention_name(hf.num_attention_heads, hf.num_key_value_heads),
                                          **(_windows_back(hf, kind) if kind not in MOE_TYPES else moe_attention(hf))},
            init={"name": "gpt2"},
        )
    if kind in HYBRID_TYPES:
        return lmlab_hybrid(hf, _attention_name(hf.num_attention_heads, hf.num_key_value_heads))
    if kind == "deepseek_v3":
        return _deepseek_back(hf)
    if kind == "gemma2":
        return _gemma2_back(hf)
    if kind == "gpt_neox":
        return _neox_back(hf)
    if kind == "gpt2":
        act = _ACTS_BACK.get(hf.activation_function)
        if act is None:
            raise NotRepresentable(f"activation_function={hf.activation_function!r}: lmlab's are {sorted(_ACTS_BACK)}")
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf, "scale_attn_weights", True):
            raise NotRepresentable("GPT-2 attention scaled otherwise than 1/sqrt(head_dim) has no lmlab form")
        hidden = hf.n_inner or 4 * hf.n_embd
        return GPTConfig(
            vocab_size=hf.vocab_size, n_layer=hf.n_layer, d_model=hf.n_embd, n_head=hf.n_head,
            max_seq_len=hf.n_positions, bias=True, tie_embeddings=bool(hf.tie_word_embeddings),
            norm={"name": "layer", "eps": float(hf.layer_norm_epsilon), "affine": True, "bias": True},
            placement={"name": "pre"}, activation={"name": act},
            ffn={"name": "mlp", **_exact_ffn(hidden)},
            position={"name": "learned"}, rope_scaling={"name": "none"}, attention={"name": "mha"},
            init={"name": "gpt2"},
        )
    raise NotRepresentable(f"model_type={kind!r}: lmlab imports Llama-like (Mistral, Ministral, Mixtral, Qwen2-MoE, "
                           f"Qwen3-MoE), "
                           f"Gemma 2, DeepSeek-V3-like (all layers dense or all routed), GPT-NeoX, GPT-2-like, "
                           f"Bamba and Qwen3-Next (every layer dense) models")


def _neox_back(hf: Any) -> GPTConfig:
    """A GPT-NeoX / Pythia config: LayerNorm with biases, the MLP, partial RoPE, parallel blocks when
    use_parallel_residual."""
    act = _ACTS_BACK.get(hf.hidden_act)
    if act is None:
        raise NotRepresentable(f"hidden_act={hf.hidden_act!r}: lmlab's are {sorted(_ACTS_BACK)}")
    p = dict(hf.rope_parameters or {})
    if p.get("rope_type", "default") != "default":
        raise NotRepresentable(f"rope_type={p['rope_type']!r}: lmlab imports GPT-NeoX with its default RoPE")
    return GPTConfig(
        vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, d_model=hf.hidden_size,
        n_head=hf.num_attention_heads, max_seq_len=hf.max_position_embeddings, bias=True,
        tie_embeddings=bool(hf.tie_word_embeddings),
        norm={"name": "layer", "eps": float(hf.layer_norm_eps), "affine": True, "bias": True},
        placement={"name": "pre"}, activation={"name": act}, ffn={"name": "mlp", **_exact_ffn(hf.intermediate_size)},
        position={"name": "rope", "theta": float(p.get("rope_theta", 10000.0)),
                  "rotary_pct": float(p.get("partial_rotary_factor", 1.0))},
        rope_scaling={"name": "none"}, attention={"name": "mha"},
        residual={"parallel": {}} if hf.use_parallel_residual else {"standard": {}}, init={"name": "gpt2"})


def _unbiased_glu_back(hf: Any, fam: str, act_key: str) -> tuple[str, dict[str, Any], float]:
    """(activation, ffn spec, RoPE theta) of a Llama-like family whose MLP has no biases and whose RoPE is the default
    one (Gemma 2, DeepSeek-V3), or NotRepresentable naming the field."""
    if hf.attention_bias:
        raise NotRepresentable(f"attention_bias=true: lmlab has one model.bias for every Linear, and {fam}'s MLP has "
                               f"none")
    act = _ACTS_BACK.get(getattr(hf, act_key))
    if act is None:
        raise NotRepresentable(f"{act_key}={getattr(hf, act_key)!r}: lmlab's gates are {sorted(_ACTS_BACK)}")
    p = dict(hf.rope_parameters or {})
    if p.get("rope_type", "default") != "default":
        raise NotRepresentable(f"rope_type={p['rope_type']!r}: lmlab imports {fam} with its default RoPE (its "
                               f"scalings are not mapped)")
    named = {gate: name for name, gate in _GLU_GATES.items()}
    return act, {"name": named.get(act, "glu"), **_exact_ffn(hf.intermediate_size)}, float(p.get("rope_theta",
                                                                                                10000.0))


def _gemma2_back(hf: Any) -> GPTConfig:
    """A Gemma 2 config: the double placement, its softcaps and windows; untied in lmlab (its embeddings are scaled
    by sqrt(d_model) on the way in, not on the way out)."""
    act, ffn, theta = _unbiased_glu_back(hf, "Gemma 2", "hidden_activation")
    if hf.head_dim * hf.num_attention_heads != hf.hidden_size:
        raise NotRepresentable(f"head_dim={hf.head_dim} x num_attention_heads={hf.num_attention_heads} != "
                               f"hidden_size={hf.hidden_size}: lmlab's heads split d_model")
    temperature = (hf.query_pre_attn_scalar / hf.head_dim) ** 0.5
    return GPTConfig(
        vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, d_model=hf.hidden_size,
        n_head=hf.num_attention_heads, n_kv_head=hf.num_key_value_heads, max_seq_len=hf.max_position_embeddings,
        bias=False, tie_embeddings=False, logit_softcap=hf.final_logit_softcapping,
        norm={"name": "rms", "eps": float(hf.rms_norm_eps), "affine": True}, placement={"name": "double"},
        activation={"name": act}, ffn=ffn, position={"name": "rope", "theta": theta}, rope_scaling={"name": "none"},
        attention={"name": _attention_name(hf.num_attention_heads, hf.num_key_value_heads),
                   "softcap": hf.attn_logit_softcapping, "temperature": temperature, **_windows_back(hf, "gemma2")},
        init={"name": "gpt2"})


def _deepseek_back(hf: Any) -> GPTConfig:
    """A DeepSeek-V3 config whose layers are all dense (first_k_dense_replace >= num_hidden_layers) or all mixtures of
    experts (first_k_dense_replace = 0, lmlab.interop.hf_moe): MLA and GLUs."""
    dense = (hf.first_k_dense_replace or 0) >= hf.num_hidden_layers
    if not dense and hf.first_k_dense_replace:
        raise NotRepresentable(f"first_k_dense_replace={hf.first_k_dense_replace} < num_hidden_layers="
                               f"{hf.num_hidden_layers}: dense first layers, then mixtures of experts; lmlab's layers "
                               f"are all one FFN kind (0: every layer routed; >= num_hidden_layers: every one dense)")
    act, ffn, theta = _unbiased_glu_back(hf, "DeepSeek-V3", "hidden_act")
    if not dense:
        ffn = deepseek_ffn(hf, ffn["name"])
    return GPTConfig(
        vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, d_model=hf.hidden_size,
        n_head=hf.num_attention_heads, max_seq_len=hf.max_position_embeddings, bias=False,
        tie_embeddings=bool(hf.tie_word_embeddings), norm={"name": "rms", "eps": float(hf.rms_norm_eps),
                                                           "affine": True},
        placement={"name": "pre"}, activation={"name": act}, ffn=ffn, position={"name": "rope", "theta": theta},
        rope_scaling={"name": "none"},
        attention={"name": "mla", "kv_lora_rank": hf.kv_lora_rank, "q_lora_rank": hf.q_lora_rank,
                   "qk_rope_head_dim": hf.qk_rope_head_dim, "qk_nope_head_dim": hf.qk_nope_head_dim,
                   "v_head_dim": hf.v_head_dim},
        init={"name": "gpt2"})


def _windows_back(hf: Any, kind: str) -> dict[str, Any]:
    """attention.window / pattern of a Mistral (every layer slides when sliding_window is set) or Ministral config
    (layer_types): the shortest cycle of local/global layers that repeats over the layers."""
    window = getattr(hf, "sliding_window", None) if kind != "llama" else None
    if window is None:
        return {}
    types = list(getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers)
    if unknown := sorted(set(types) - {"sliding_attention", "full_attention"}):
        raise NotRepresentable(f"layer_types {unknown}: lmlab's layers slide or attend to the whole context")
    pattern = ["local" if t == "sliding_attention" else "global" for t in types]
    if "local" not in pattern:  # the window of no layer (Gemma 2 always names one)
        return {}
    if "global" not in pattern:
        return {"window": int(window)}
    cycle = next(n for n in range(1, len(pattern) + 1) if len(pattern) % n == 0 and pattern == pattern[:n] * (
        len(pattern) // n))
    return {"window": int(window), "pattern": pattern[:cycle]}


def _attention_name(n_head: int, n_kv_head: int) -> str:
    return "mha" if n_kv_head == n_head else "mqa" if n_kv_head == 1 else "gqa"


def _rope_scaling_back(hf: Any) -> tuple[dict[str, Any], int, int]:
    """(lmlab rope_scaling spec with a 'theta' entry, max_seq_len, train_len) from a LlamaConfig."""
    p = dict(hf.rope_parameters or {})
    kind, theta = p.get("rope_type", "default"), float(p.get("rope_theta", 10000.0))
    max_pos = hf.max_position_embeddings
    if kind == "default":
        return {"name": "none", "theta": theta}, max_pos, max_pos
    if kind == "linear":
        factor = float(p["factor"])
        return {"name": "linear", "factor": factor, "theta": theta}, max_pos, max_pos
    if kind == "dynamic":
        return {"name": "dynamic_ntk", "factor": float(p.get("factor", 1.0)), "theta": theta}, max_pos, max_pos
    original = int(p.get("original_max_position_embeddings") or max_pos)
    if kind == "llama3":
        return {"name": "llama3", "factor": float(p["factor"]), "original_max_len": original,
                "low_freq_factor": float(p.get("low_freq_factor", 1.0)),
                "high_freq_factor": float(p.get("high_freq_factor", 4.0)), "theta": theta}, max_pos, original
    if kind == "yarn":
        spec = {"name": "yarn", "factor": p.get("factor"), "original_max_len": original,
                "beta_fast": float(p.get("beta_fast") or 32.0), "beta_slow": float(p.get("beta_slow") or 1.0),
                "truncate": bool(p.get("truncate", True)), "theta": theta}
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if p.get(key) is not None:
                spec[key] = float(p[key])
        if spec["factor"] is not None:
            spec["factor"] = float(spec["factor"])
        return spec, max_pos, original
    raise NotRepresentable(f"rope_type={kind!r}: lmlab's RoPE scalings map from {sorted(set(_ROPE_TYPES.values()))}")
