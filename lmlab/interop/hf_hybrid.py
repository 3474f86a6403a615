"""The hybrid half of the transformers interop (lmlab.interop.hf, hf_config): lmlab's `mixer` axis, some layers a
recurrent mixer and the others softmax attention, as the transformers families that have one, configs and weights
both ways. Both have Llama's layers around the mixer (pre RMSNorm, a SwiGLU MLP, MHA/GQA/MQA with RoPE on the first
`partial_rotary_factor` of each head: position.rotary_pct), rope_scaling none, tied or untied embeddings.

- Bamba (`BambaForCausalLM`): mixer=mamba2 (lmlab.model.mixer.mamba2, whose weights are BambaMixer's by name), the
  attention layers at `attn_layer_indices`. Its keys: mamba_d_state = d_state, mamba_expand = expand, mamba_d_head =
  head_dim (mamba_n_heads = expand·d_model / head_dim), mamba_n_groups = n_groups, mamba_d_conv = conv_size,
  mamba_chunk_size = chunk_size, time_step_limit = dt_limit (null: inf). Its gated norm's epsilon is rms_norm_eps
  (mixer.norm_eps = norm.eps), the norm after the gate (norm_before_gate=false), its conv's activation the MLP's
  hidden_act (silu: the conv's SiLU, ffn=swiglu). One model.bias for attention_bias, mlp_bias and mamba_proj_bias
  (the mixer's in/out projections); lmlab's conv always has a bias: exported with mamba_conv_bias=true, imported as
  zeros from a checkpoint without one (the same function).
- Qwen3-Next (`Qwen3NextForCausalLM`): mixer=gdn (lmlab.model.mixer.gdn), the layers by `layer_types`
  (linear_attention / full_attention), every FFN dense (exported with mlp_only_layers = every layer; imported where
  HF's rule makes every layer an MLP; routed layers are refused). Its RMSNorms are zero-centred, x̂·(1 + w): lmlab's
  gains are 1 + w, both ways (the layers', the final one, the attention's q/k norms). Its attention has per-head q/k
  norms of rms_norm_eps (attention.qk_norm=true, qk_norm_eps = norm.eps) and a sigmoid output gate per head dimension
  that its q_proj emits beside each head's query ([q_h; g_h] for head h): lmlab's attention.gate=elementwise, a Linear
  of its own, its rows merged into q_proj's per head and split out again. No biases (attention_bias=false; its MLP and
  GDN have none). GDN keys: linear_num_key_heads = n_heads, linear_num_value_heads = n_v_heads, linear_key_head_dim =
  head_dim, linear_value_head_dim = v_head_dim, linear_conv_kernel_dim = conv_size; its gated norm's epsilon is
  rms_norm_eps (mixer.norm_eps = norm.eps), its conv's activation hidden_act (silu).
The layer types are written per layer; on import mixer.pattern is their shortest cycle. Not in these configs, so
imported as lmlab's defaults: what only initialises (Mamba-2's dt_min, dt_max, dt_init_floor) and GDN's chunk_size
(the chunked form's result does not depend on it). Anything else is refused naming the key: another mixer (linear), an
attention option or a layer kind the family lacks (lmlab.interop.hf_config's common checks), a stack without an
attention layer (transformers' hybrids run none: their caches count the tokens by one), a routed Qwen3-Next.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmlab.config import GPTConfig
from lmlab.interop.refusal import NotRepresentable, refuse
from lmlab.model.layers import layer_plan
from lmlab.model.mixer import ATTENTION, gdn, mamba2

HYBRID_TYPES = {"bamba": "Bamba", "qwen3_next": "Qwen3-Next"}
_FAMILIES = {"mamba2": "bamba", "gdn": "qwen3_next"}  # lmlab's mixer -> the family that has it
_LINEAR, _FULL = "linear_attention", "full_attention"  # both families' layer types
# per family: the mixer's module in a HF layer, the norm before the FFN, the FFN, the final norm
_NAMES = {"bamba": ("mamba", "pre_ff_layernorm", "feed_forward", "final_layernorm"),
          "qwen3_next": ("linear_attn", "post_attention_layernorm", "mlp", "norm")}


def hybrid_family(cfg: GPTConfig) -> str:
    """'bamba' or 'qwen3_next' by the mixer (a config whose mixer is not attention), or NotRepresentable."""
    mixer = cfg.mixer["name"]
    if mixer not in _FAMILIES:
        raise refuse("mixer", mixer, "hybrid", "mixer=mamba2 (Bamba) or mixer=gdn (Qwen3-Next)")
    return _FAMILIES[mixer]


def check_hybrid(cfg: GPTConfig, fam: str, gate_act: str | None) -> None:
    """What a hybrid family adds to the checks lmlab.interop.hf_config makes of every family (after them):
    `gate_act`, transformers' name of the FFN's GLU gate (None: no GLU it has)."""
    name, m, a = HYBRID_TYPES[fam], cfg.mixer, cfg.attention
    eps = float(cfg.norm.get("eps", 1e-6))
    if cfg.ffn["name"] == "moe":  # Qwen3-Next's routed layers are not mapped (yet): every layer dense
        raise refuse("ffn", "moe", name, "a dense ffn=swiglu in every layer")
    if gate_act != "silu":  # hidden_act is the MLP's gate and the mixer conv's activation
        raise refuse("ffn", cfg.ffn["name"], name, "ffn=swiglu (its MLP's gate and its mixer's conv share hidden_act, "
                     "and the conv's is SiLU)")
    if cfg.rope_scaling["name"] != "none":
        raise refuse("rope_scaling", cfg.rope_scaling["name"], name, "rope_scaling=none")
    if not any(layer.attention for layer in layer_plan(cfg)):  # its cache counts the tokens by an attention layer
        raise refuse("mixer.pattern", m.get("pattern"), name, "an attention layer in mixer.pattern (transformers' "
                     f"{name} runs no stack without one)")
    if float(m["norm_eps"]) != eps:
        raise refuse("mixer.norm_eps", m["norm_eps"], name, f"mixer.norm_eps=norm.eps ({eps}): its mixer's gated norm "
                     f"uses rms_norm_eps")
    if fam == "bamba":
        if m.get("norm_before_gate"):
            raise refuse("mixer.norm_before_gate", True, name, "mixer.norm_before_gate=false (it gates, then norms)")
        return
    if cfg.bias:
        raise refuse("model.bias", cfg.bias, name, "model.bias=false (its MLP and GDN have no biases)")
    if not a.get("qk_norm"):
        raise refuse("attention.qk_norm", a.get("qk_norm", False), name, "attention.qk_norm=true (its q/k norms)")
    if a.get("qk_norm_eps") is None or float(a["qk_norm_eps"]) != eps:
        raise refuse("attention.qk_norm_eps", a.get("qk_norm_eps"), name, f"attention.qk_norm_eps=norm.eps ({eps}): "
                     f"its q/k norms use rms_norm_eps")
    if a.get("gate") != "elementwise":
        raise refuse("attention.gate", a.get("gate"), name, "attention.gate=elementwise (the gate its q_proj emits "
                     "beside each head's query)")


def _gdn_sizes(cfg: GPTConfig) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head size, value head size) of cfg's GDN layers, its nulls resolved."""
    m = cfg.mixer
    return gdn.head_sizes(cfg, m.get("n_heads"), m.get("n_v_heads"), m.get("head_dim"), m.get("v_head_dim"))


# --- config ------------------------------------------------------------------------------------------------

def hybrid_hf_config(cfg: GPTConfig, fam: str, common: dict[str, Any]) -> Any:
    """BambaConfig / Qwen3NextConfig from the Llama-like fields `common` (lmlab.interop.hf_config) and the mixer's."""
    import transformers

    m, n = cfg.mixer, cfg.n_layer
    types = [_FULL if layer.attention else _LINEAR for layer in layer_plan(cfg)]
    rope = {**common["rope_parameters"], "partial_rotary_factor": float(cfg.position.get("rotary_pct", 1.0))}
    common = {**common, "rope_parameters": rope, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if fam == "bamba":
        common.pop("head_dim")  # Bamba's heads split hidden_size
        low, high = m["dt_limit"]
        return transformers.BambaConfig(
            **common, attn_layer_indices=[i for i, t in enumerate(types) if t == _FULL],
            mamba_n_heads=m["expand"] * cfg.d_model // m["head_dim"], mamba_d_head=m["head_dim"],
            mamba_n_groups=m["n_groups"], mamba_d_state=m["d_state"], mamba_d_conv=m["conv_size"],
            mamba_expand=m["expand"], mamba_chunk_size=m["chunk_size"], mamba_conv_bias=True,
            mamba_proj_bias=cfg.bias, time_step_limit=(float(low), math.inf if high is None else float(high)),
            attention_bias=cfg.bias, mlp_bias=cfg.bias)
    Hk, Hv, dk, dv = _gdn_sizes(cfg)
    return transformers.Qwen3NextConfig(
        **common, layer_types=types, mlp_only_layers=list(range(n)), linear_num_key_heads=Hk,
        linear_num_value_heads=Hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_conv_kernel_dim=m["conv_size"], attention_bias=False)


def lmlab_hybrid(hf: Any, attention: str) -> GPTConfig:
    """The GPTConfig of a BambaConfig / Qwen3NextConfig (`attention`: mha, gqa or mqa by its heads), or
    NotRepresentable naming the field."""
    kind = hf.model_type
    name, qwen = HYBRID_TYPES[kind], kind == "qwen3_next"
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # as their attention reads it
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise NotRepresentable(f"head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} != hidden_size="
                               f"{hf.hidden_size}: lmlab's heads split d_model")
    if hf.hidden_act != "silu":
        raise NotRepresentable(f"hidden_act={hf.hidden_act!r}: lmlab's {name} mixer's conv is SiLU, and {name}'s "
                               f"conv and MLP share hidden_act")
    p = dict(hf.rope_parameters or {})
    if p.get("rope_type", "default") != "default":
        raise NotRepresentable(f"rope_type={p['rope_type']!r}: lmlab imports {name} with its default RoPE")
    eps = float(hf.rms_norm_eps)
    types = list(hf.layer_types)  # Bamba's: from attn_layer_indices
    if _FULL not in types:
        raise NotRepresentable(f"layer_types={types}: no full_attention layer; transformers' {name} runs no stack "
                               f"without one (its cache counts the tokens by an attention layer), nor does lmlab "
                               f"export one")
    if qwen:
        _check_qwen3_next(hf)
        bias = False
        Hk, Hv = hf.linear_num_key_heads, hf.linear_num_value_heads
        mixer = {"name": "gdn", "n_heads": Hk, "n_v_heads": Hv, "head_dim": hf.linear_key_head_dim,
                 "v_head_dim": hf.linear_value_head_dim, "conv_size": hf.linear_conv_kernel_dim, "norm_eps": eps}
        attn = {"qk_norm": True, "qk_norm_eps": eps, "gate": "elementwise"}
    else:
        bias = _bamba_bias(hf)
        low, high = hf.time_step_limit or (0.0, math.inf)
        mixer = {"name": "mamba2", "d_state": hf.mamba_d_state, "expand": hf.mamba_expand,
                 "head_dim": hf.mamba_d_head, "n_groups": hf.mamba_n_groups, "conv_size": hf.mamba_d_conv,
                 "chunk_size": hf.mamba_chunk_size, "norm_eps": eps, "norm_before_gate": False,
                 "dt_limit": (float(low), None if math.isinf(high) else float(high))}
        attn = {}
    return GPTConfig(
        vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, d_model=hf.hidden_size,
        n_head=hf.num_attention_heads, n_kv_head=hf.num_key_value_heads, max_seq_len=hf.max_position_embeddings,
        bias=bias, tie_embeddings=bool(hf.tie_word_embeddings), norm={"name": "rms", "eps": eps, "affine": True},
        placement={"name": "pre"}, activation={"name": "silu"}, ffn={"name": "swiglu", "hidden": hf.intermediate_size},
        position={"name": "rope", "theta": float(p.get("rope_theta", 10000.0)),
                  "rotary_pct": float(p.get("partial_rotary_factor", 1.0))},
        rope_scaling={"name": "none"}, attention={"name": attention, **attn},
        mixer={**mixer, "pattern": _pattern(types, mixer["name"])}, init={"name": "gpt2"})


def _bamba_bias(hf: Any) -> bool:
    """model.bias of a Bamba: its attention's, MLP's and mixer projections' biases, all or none."""
    biases = {"attention_bias": hf.attention_bias, "mlp_bias": hf.mlp_bias, "mamba_proj_bias": hf.mamba_proj_bias}
    if len(set(map(bool, biases.values()))) > 1:
        raise NotRepresentable(f"{' '.join(f'{k}={v}' for k, v in biases.items())}: lmlab has one model.bias for every "
                               f"Linear")
    return bool(hf.attention_bias)


def _check_qwen3_next(hf: Any) -> None:
    """A Qwen3-Next without biases whose every layer is dense, as HF decides: a layer is routed unless it is in
    mlp_only_layers, num_experts is 0 or the layer falls between decoder_sparse_step's."""
    if hf.attention_bias:
        raise NotRepresentable("attention_bias=True: lmlab has one model.bias for every Linear, and Qwen3-Next's MLP "
                               "and GDN have none")
    step, only = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
    routed = [i for i in range(hf.num_hidden_layers)
              if i not in only and hf.num_experts > 0 and (i + 1) % step == 0]
    if routed:
        raise NotRepresentable(f"num_experts={hf.num_experts} mlp_only_layers={hf.mlp_only_layers} "
                               f"decoder_sparse_step={step}: layers {routed} are mixtures of experts; lmlab imports a "
                               f"Qwen3-Next whose every layer is dense (mlp_only_layers = every layer)")


def _pattern(types: list[str], mixer: str) -> list[str]:
    """mixer.pattern of HF's per-layer types: their shortest cycle."""
    if unknown := sorted(set(types) - {_LINEAR, _FULL}):
        raise NotRepresentable(f"layer_types {unknown}: lmlab's hybrid layers are {_LINEAR} or {_FULL}")
    pattern = [mixer if t == _LINEAR else ATTENTION for t in types]
    cycle = next(n for n in range(1, len(pattern) + 1) if len(pattern) % n == 0 and pattern == pattern[:n] * (
        len(pattern) // n))
    return pattern[:cycle]


# --- weights -----------------------------------------------------------------------------------------------

def state(model: Any) -> dict[str, torch.Tensor]:
    """An lmlab GPT's weights in transformers' names (Bamba's or Qwen3-Next's, by its mixer)."""
    cfg, sd = model.cfg, model.state_dict()
    fam = _FAMILIES[cfg.mixer["name"]]
    mix, ln_2, ffn, ln_f = _NAMES[fam]
    shift = 1.0 if fam == "qwen3_next" else 0.0  # Qwen3-Next's norms multiply by 1 + w
    out = {"model.embed_tokens.weight": sd["wte.weight"], f"model.{ln_f}.weight": sd["ln_f.weight"] - shift,
           "lm_head.weight": sd["lm_head.weight"]}
    for i, layer in enumerate(layer_plan(cfg)):
        p, q = f"h.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "ln_1.weight"] - shift
        out[q + f"{ln_2}.weight"] = sd[p + "ln_2.weight"] - shift
        for suffix in ("weight", "bias") if cfg.bias else ("weight",):
            out[q + f"{ffn}.gate_proj.{suffix}"], out[q + f"{ffn}.up_proj.{suffix}"] = sd[
                p + f"mlp.c_fc.{suffix}"].chunk(2, dim=0)  # swiglu's fused rows: [gate; up]
            out[q + f"{ffn}.down_proj.{suffix}"] = sd[p + f"mlp.c_proj.{suffix}"]
        if layer.attention:
            out.update(_attention(sd, p, q, cfg, fam))
            continue
        ours = {k[len(p + "mix."):]: v for k, v in sd.items() if k.startswith(p + "mix.")}
        out.update(mamba2.hf_state(ours, q + f"{mix}.") if fam == "bamba"
                   else gdn.hf_state(ours, q + f"{mix}.", n_heads=_gdn_sizes(cfg)[0]))
    return out


def _attention(sd: dict[str, torch.Tensor], p: str, q: str, cfg: GPTConfig, fam: str) -> dict[str, torch.Tensor]:
    """One attention layer: Llama's q/k/v/o; Qwen3-Next's q_proj holds each head's query rows, then its gate's."""
    nh, hd, kv = cfg.n_head, cfg.head_dim, cfg.kv_heads
    out = {}
    for suffix in ("weight", "bias") if cfg.bias else ("weight",):
        qw, kw, vw = sd[p + f"attn.c_attn.{suffix}"].split((nh * hd, kv * hd, kv * hd), dim=0)
        if fam == "qwen3_next":
            gw, rest = sd[p + f"attn.gate.{suffix}"], qw.shape[1:]
            qw = torch.cat((qw.view(nh, hd, *rest), gw.view(nh, hd, *rest)), dim=1).reshape(2 * nh * hd, *rest)
        out |= {q + f"self_attn.q_proj.{suffix}": qw, q + f"self_attn.k_proj.{suffix}": kw,
                q + f"self_attn.v_proj.{suffix}": vw, q + f"self_attn.o_proj.{suffix}": sd[p + f"attn.c_proj.{suffix}"]}
    if fam == "qwen3_next":
        out[q + "self_attn.q_norm.weight"] = sd[p + "attn.q_norm"] - 1
        out[q + "self_attn.k_norm.weight"] = sd[p + "attn.k_norm"] - 1
    return out


def invert(state: dict[str, torch.Tensor], model: Any, fam: str) -> dict[str, torch.Tensor]:
    """`state` inverted: a Bamba / Qwen3-Next state dict in lmlab's names (a Bamba conv without a bias: zeros)."""
    cfg = model.cfg
    mix, ln_2, ffn, ln_f = _NAMES[fam]
    shift = 1.0 if fam == "qwen3_next" else 0.0
    nh, hd = cfg.n_head, cfg.head_dim
    sd = {"wte.weight": state["model.embed_tokens.weight"], "ln_f.weight": state[f"model.{ln_f}.weight"] + shift,
          "lm_head.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])}
    for i, layer in enumerate(layer_plan(cfg)):
        p, q = f"h.{i}.", f"model.layers.{i}."
        sd[p + "ln_1.weight"] = state[q + "input_layernorm.weight"] + shift
        sd[p + "ln_2.weight"] = state[q + f"{ln_2}.weight"] + shift
        for suffix in ("weight", "bias") if cfg.bias else ("weight",):
            sd[p + f"mlp.c_fc.{suffix}"] = torch.cat([state[q + f"{ffn}.{x}_proj.{suffix}"] for x in ("gate", "up")])
            sd[p + f"mlp.c_proj.{suffix}"] = state[q + f"{ffn}.down_proj.{suffix}"]
        if layer.attention:
            a = q + "self_attn."
            for suffix in ("weight", "bias") if cfg.bias else ("weight",):
                qw = state[a + f"q_proj.{suffix}"]
                if fam == "qwen3_next":
                    qw, gw = qw.view(nh, 2 * hd, *qw.shape[1:]).chunk(2, dim=1)
                    qw, sd[p + f"attn.gate.{suffix}"] = (t.reshape(nh * hd, *t.shape[2:]) for t in (qw, gw))
                sd[p + f"attn.c_attn.{suffix}"] = torch.cat((qw, state[a + f"k_proj.{suffix}"],
                                                             state[a + f"v_proj.{suffix}"]))
                sd[p + f"attn.c_proj.{suffix}"] = state[a + f"o_proj.{suffix}"]
            if fam == "qwen3_next":
                sd[p + "attn.q_norm"] = state[a + "q_norm.weight"] + 1
                sd[p + "attn.k_norm"] = state[a + "k_norm.weight"] + 1
            continue
        ours = (mamba2.from_hf_state(state, q + f"{mix}.") if fam == "bamba"
                else gdn.from_hf_state(state, q + f"{mix}.", n_heads=_gdn_sizes(cfg)[0]))
        if fam == "bamba" and "conv.conv.bias" not in ours:  # mamba_conv_bias=false: lmlab's conv adds zeros
            ours["conv.conv.bias"] = ours["conv.conv.weight"].new_zeros(ours["conv.conv.weight"].size(0))
        sd |= {p + "mix." + k: v for k, v in ours.items()}
    return sd
