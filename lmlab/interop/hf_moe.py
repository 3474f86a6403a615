"""The MoE half of the transformers interop (lmlab.interop.hf, hf_config): which `ffn=moe` configurations transformers
represents exactly, and their configs and weights both ways.

- Mixtral (`MixtralForCausalLM`): softmax routing, the top-k weights normalised, no shared experts;
- Qwen2-MoE (`Qwen2MoeForCausalLM`): softmax routing, normalised or not (`norm_topk_prob`), one shared FFN of
  `shared_expert_intermediate_size` = n_shared · expert hidden gated by sigmoid(w·x) (`ffn.shared_gate=true`), every
  layer sparse, no biases (q/k/v biases off: `qkv_bias=false`);
- Qwen3-MoE (`Qwen3MoeForCausalLM`): softmax routing, normalised or not, no shared expert, every layer sparse, no
  biases, and q/k RMS norms per head (attention.qk_norm=true) whose epsilon is the model's rms_norm_eps
  (attention.qk_norm_eps = norm.eps).
All three: Llama's attention and norms (lmlab.interop.hf_config's Llama checks), GLU experts whose gate transformers has
(`hidden_act`), dropless (no capacity), no loss-free bias (transformers routes without one), routed_scale 1.
- DeepSeek-V3 (`DeepseekV3ForCausalLM`, attention=mla: lmlab.interop.hf_config's DeepSeek checks): sigmoid scores,
  chosen by s + b with b lmlab's loss-free balancing bias (`expert_bias` = its `e_score_correction_bias`; the update
  rate is training, not the forward: not exported, 0 on import), normalised or not (`norm_topk_prob`), times
  `routed_scale` (`routed_scaling_factor`), n_shared ungated shared experts (`n_shared_experts`), every layer sparse
  (`first_k_dense_replace` 0; lmlab's layers are all one FFN kind, so dense first layers are refused on import), no
  expert groups (`n_group` = `topk_group` = 1 on export; on import a grouping that keeps every group is the same
  routing, any other is refused).
Anything else is refused naming the key.
"""

from __future__ import annotations

from typing import Any

import torch

from lmlab.config import GPTConfig
from lmlab.interop.refusal import NotRepresentable, refuse

MOE_TYPES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE"}


def moe_family(cfg: GPTConfig, gate_act: str | None) -> str:
    """'mixtral', 'qwen2_moe' or 'qwen3_moe' (q/k norms) for an ffn=moe config that passed the Llama checks, or
    NotRepresentable by key. `gate_act`: transformers' name of the experts' gate activation (None: they are not a GLU
    it has)."""
    f = cfg.ffn
    fam = "Mixtral, Qwen2-MoE or Qwen3-MoE"
    if gate_act is None:
        raise refuse("ffn.expert", f.get("expert", "mlp"), fam, "GLU experts with a silu/gelu/gelu_tanh/relu gate")
    if cfg.bias:
        raise refuse("model.bias", cfg.bias, fam, "model.bias=false")
    for key, plain in (("score", "softmax"), ("capacity_factor", None), ("bias_update_rate", 0.0),
                       ("routed_scale", 1.0)):
        if f.get(key, plain) != plain:
            raise refuse(f"ffn.{key}", f[key], fam, f"ffn.{key}={'null' if plain is None else plain}")
    if cfg.attention.get("qk_norm", False):  # Qwen3-MoE: its q/k norms share the layers' rms_norm_eps
        eps = float(cfg.norm.get("eps", 1e-6))
        if cfg.attention.get("qk_norm_eps") != eps:
            raise refuse("attention.qk_norm_eps", cfg.attention.get("qk_norm_eps"), "Qwen3-MoE",
                         f"attention.qk_norm_eps=norm.eps ({eps}): its q/k norms use rms_norm_eps")
        if f.get("n_shared", 0):
            raise refuse("ffn.n_shared", f["n_shared"], "Qwen3-MoE", "ffn.n_shared=0 (it has no shared expert), or "
                         "attention.qk_norm=false (Qwen2-MoE)")
        return "qwen3_moe"
    if not f.get("n_shared", 0):
        if not f.get("norm_topk", True):
            raise refuse("ffn.norm_topk", False, "Mixtral", "ffn.norm_topk=true (or shared experts: Qwen2-MoE)")
        return "mixtral"
    if not f.get("shared_gate", False):
        raise refuse("ffn.n_shared", f["n_shared"], "Qwen2-MoE", "ffn.shared_gate=true with shared experts "
                      "(ungated shared experts are DeepSeek's, whose transformers model needs MLA attention), or "
                      "ffn.n_shared=0 (Mixtral)")
    return "qwen2_moe"


def check_deepseek_moe(cfg: GPTConfig, gate_act: str | None) -> None:
    """An ffn=moe config that DeepSeek-V3's MoE layers represent (after the DeepSeek checks), or NotRepresentable."""
    f, fam = cfg.ffn, "DeepSeek-V3"
    if gate_act is None:
        raise refuse("ffn.expert", f.get("expert", "mlp"), fam, "GLU experts with a silu/gelu/gelu_tanh/relu gate")
    if f.get("score", "softmax") != "sigmoid":
        raise refuse("ffn.score", f.get("score", "softmax"), fam, "ffn.score=sigmoid (softmax routing with Llama's "
                     "attention: Mixtral or Qwen2-MoE)")
    if f.get("capacity_factor") is not None:
        raise refuse("ffn.capacity_factor", f["capacity_factor"], fam, "ffn.capacity_factor=null (dropless)")
    if f.get("shared_gate", False):
        raise refuse("ffn.shared_gate", True, fam, "ffn.shared_gate=false (its shared experts are ungated)")
    if f.get("n_experts", 8) < 2:  # its router sums each group's top two scores
        raise refuse("ffn.n_experts", f["n_experts"], fam, "ffn.n_experts >= 2")


def deepseek_fields(cfg: GPTConfig) -> dict[str, Any]:
    """DeepseekV3Config's FFN fields: every layer dense for a dense FFN, every layer routed for ffn=moe."""
    f = cfg.ffn
    if f["name"] != "moe":
        return {"first_k_dense_replace": cfg.n_layer}  # every layer dense: no experts
    return {"first_k_dense_replace": 0, "n_routed_experts": f.get("n_experts", 8),
            "num_experts_per_tok": f.get("top_k", 2), "moe_intermediate_size": cfg.ffn_hidden,
            "n_shared_experts": f.get("n_shared", 0), "norm_topk_prob": bool(f.get("norm_topk", True)),
            "routed_scaling_factor": float(f.get("routed_scale", 1.0)), "n_group": 1, "topk_group": 1}


def deepseek_ffn(hf: Any, expert: str) -> dict[str, Any]:
    """The ffn group of a DeepseekV3Config whose layers are all sparse (`expert`: the lmlab GLU kind of hidden_act)."""
    groups, kept = hf.n_group or 1, hf.topk_group or 1
    if kept != groups:  # every group kept: each token's top k over all experts, lmlab's routing
        raise NotRepresentable(f"n_group={groups} topk_group={kept}: lmlab's router chooses among all experts, "
                               f"without expert groups (n_group = topk_group, e.g. 1, is the same routing)")
    return {"name": "moe", "expert": expert, "hidden": hf.moe_intermediate_size, "n_experts": hf.n_routed_experts,
            "top_k": hf.num_experts_per_tok, "n_shared": hf.n_shared_experts, "shared_gate": False,
            "score": "sigmoid", "norm_topk": bool(hf.norm_topk_prob),
            "routed_scale": float(hf.routed_scaling_factor)}


def hf_moe_config(cfg: GPTConfig, fam: str, common: dict[str, Any]) -> Any:
    import transformers

    f = cfg.ffn
    routed = dict(num_experts_per_tok=f.get("top_k", 2), router_aux_loss_coef=float(f.get("balance_loss", 0.0)),
                  bos_token_id=None, eos_token_id=None)
    if fam == "mixtral":
        return transformers.MixtralConfig(**common, **routed, num_local_experts=f.get("n_experts", 8),
                                          sliding_window=None, router_jitter_noise=0.0)
    sparse = dict(num_experts=f.get("n_experts", 8), moe_intermediate_size=cfg.ffn_hidden,
                  norm_topk_prob=bool(f.get("norm_topk", True)), decoder_sparse_step=1, mlp_only_layers=[],
                  use_sliding_window=False)
    if fam == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **routed, **sparse, attention_bias=False)
    common = {k: v for k, v in common.items() if k != "head_dim"}  # Qwen2-MoE's heads split hidden_size
    return transformers.Qwen2MoeConfig(**common, **routed, **sparse, qkv_bias=False,
                                       shared_expert_intermediate_size=f["n_shared"] * cfg.ffn_hidden)


def moe_attention(hf: Any) -> dict[str, Any]:
    """The attention keys a MoE family adds to Llama's: Qwen3-MoE's q/k norms, with its rms_norm_eps."""
    return {"qk_norm": True, "qk_norm_eps": float(hf.rms_norm_eps)} if hf.model_type == "qwen3_moe" else {}


def lmlab_ffn(hf: Any, expert: str) -> dict[str, Any]:
    """The ffn group of a MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig (`expert`: the lmlab GLU kind of its
    hidden_act)."""
    kind = hf.model_type
    if kind == "mixtral":
        if getattr(hf, "sliding_window", None) is not None:
            raise NotRepresentable(f"sliding_window={hf.sliding_window}: lmlab's MoE export and import use full "
                                   f"attention")
        return {"name": "moe", "expert": expert, "hidden": hf.intermediate_size, "n_experts": hf.num_local_experts,
                "top_k": hf.num_experts_per_tok, "n_shared": 0, "norm_topk": True}
    if getattr(hf, "qkv_bias", False) or getattr(hf, "attention_bias", False):
        key = "qkv_bias" if kind == "qwen2_moe" else "attention_bias"
        raise NotRepresentable(f"{key}=True: lmlab has one model.bias for every Linear (the experts of "
                               f"{MOE_TYPES[kind]} have none)")
    if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
        raise NotRepresentable(f"mlp_only_layers={hf.mlp_only_layers} decoder_sparse_step={hf.decoder_sparse_step}: "
                               f"lmlab's layers are all the same FFN kind")
    if getattr(hf, "use_sliding_window", False):
        raise NotRepresentable(f"use_sliding_window=True: not read for {MOE_TYPES[kind]}")
    if kind == "qwen3_moe":
        return {"name": "moe", "expert": expert, "hidden": hf.moe_intermediate_size, "n_experts": hf.num_experts,
                "top_k": hf.num_experts_per_tok, "n_shared": 0, "norm_topk": bool(hf.norm_topk_prob)}
    shared, h = hf.shared_expert_intermediate_size, hf.moe_intermediate_size
    if shared % h or not shared:
        raise NotRepresentable(f"shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size="
                               f"{h}: lmlab's shared experts are n_shared experts' size")
    return {"name": "moe", "expert": expert, "hidden": h, "n_experts": hf.num_experts, "top_k": hf.num_experts_per_tok,
            "n_shared": shared // h, "shared_gate": True, "norm_topk": bool(hf.norm_topk_prob)}


def state(sd: dict[str, torch.Tensor], p: str, q: str, block: Any, fam: str) -> dict[str, torch.Tensor]:
    """One layer's MoE weights in transformers' names (p: lmlab's prefix h.<i>., q: model.layers.<i>.)."""
    moe, out = block.mlp, {}
    E = moe.n_experts
    out[q + "mlp.gate.weight"] = sd[p + "mlp.router.weight"]
    out[q + "mlp.experts.gate_up_proj"] = sd[p + "mlp.c_fc.weight"].view(E, -1, moe.c_fc.in_features)
    out[q + "mlp.experts.down_proj"] = sd[p + "mlp.c_proj.weight"].view(E, -1, moe.c_proj.in_features)
    if fam == "deepseek_v3":  # the balancing bias steers its choice too; shared experts ungated (zero-size if none)
        out[q + "mlp.gate.e_score_correction_bias"] = sd[p + "mlp.expert_bias"]
        d = moe.c_fc.in_features
        gate, up = (sd[p + "mlp.shared.c_fc.weight"].chunk(2, dim=0) if moe.shared is not None
                    else (sd[p + "mlp.router.weight"].new_zeros(0, d),) * 2)
        out[q + "mlp.shared_experts.gate_proj.weight"], out[q + "mlp.shared_experts.up_proj.weight"] = gate, up
        out[q + "mlp.shared_experts.down_proj.weight"] = (sd[p + "mlp.shared.c_proj.weight"] if moe.shared is not None
                                                          else gate.new_zeros(d, 0))
    if fam == "qwen2_moe":
        gate, up = sd[p + "mlp.shared.c_fc.weight"].chunk(2, dim=0)
        out[q + "mlp.shared_expert.gate_proj.weight"], out[q + "mlp.shared_expert.up_proj.weight"] = gate, up
        out[q + "mlp.shared_expert.down_proj.weight"] = sd[p + "mlp.shared.c_proj.weight"]
        out[q + "mlp.shared_expert_gate.weight"] = sd[p + "mlp.shared_gate.weight"]
    return out


def invert(state: dict[str, torch.Tensor], p: str, q: str, cfg: GPTConfig, fam: str) -> dict[str, torch.Tensor]:
    """`state` inverted: transformers' MoE weights of one layer in lmlab's names (the balancing bias DeepSeek-V3's
    e_score_correction_bias, else zero)."""
    sd = {p + "mlp.router.weight": state[q + "mlp.gate.weight"]}
    gate_up, down = state[q + "mlp.experts.gate_up_proj"], state[q + "mlp.experts.down_proj"]
    sd[p + "mlp.c_fc.weight"] = gate_up.reshape(-1, gate_up.size(-1))
    sd[p + "mlp.c_proj.weight"] = down.reshape(-1, down.size(-1))
    sd[p + "mlp.expert_bias"] = state.get(q + "mlp.gate.e_score_correction_bias", torch.zeros(gate_up.size(0)))
    if fam == "deepseek_v3" and cfg.ffn.get("n_shared", 0):
        sd[p + "mlp.shared.c_fc.weight"] = torch.cat([state[q + f"mlp.shared_experts.{x}_proj.weight"]
                                                      for x in ("gate", "up")], dim=0)
        sd[p + "mlp.shared.c_proj.weight"] = state[q + "mlp.shared_experts.down_proj.weight"]
    if fam == "qwen2_moe":
        sd[p + "mlp.shared.c_fc.weight"] = torch.cat([state[q + f"mlp.shared_expert.{x}_proj.weight"]
                                                      for x in ("gate", "up")], dim=0)
        sd[p + "mlp.shared.c_proj.weight"] = state[q + "mlp.shared_expert.down_proj.weight"]
        sd[p + "mlp.shared_gate.weight"] = state[q + "mlp.shared_expert_gate.weight"]
    return sd
