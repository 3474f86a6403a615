"""transformers interop for ffn=moe: Mixtral (softmax top-k, normalised, no shared experts), Qwen2-MoE (a gated
shared expert, normalised or not) and DeepSeek-V3 (MLA; sigmoid scores chosen with the balancing bias, ungated shared
experts, the routed scaling factor) give the same logits both ways (fp32, tight tolerance), and every configuration
transformers cannot represent is refused naming its key. (Cached generation of ffn=moe: tests/unit/model/test_generate.py.)"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from lmlab.config import GPTConfig  # noqa: E402
from lmlab.interop.hf import NotRepresentable, family, from_hf, to_hf  # noqa: E402
from lmlab.model.gpt import GPT, validate  # noqa: E402

V = 61
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, rms_norm_eps=1e-5, attention_dropout=0.0, tie_word_embeddings=False,
              num_experts_per_tok=2, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
MLA = dict(num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=6,
           v_head_dim=10, first_k_dense_replace=0, bos_token_id=None, eos_token_id=None)
CASES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=24, num_local_experts=4)),
    "mixtral_gelu_top1": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**COMMON, "hidden_act": "gelu", "num_experts_per_tok": 1}, intermediate_size=16, num_local_experts=3)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=24, num_experts=4,
        norm_topk_prob=False, qkv_bias=False)),
    "qwen2_moe_norm": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **{**COMMON, "tie_word_embeddings": True}, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_experts=6, norm_topk_prob=True, qkv_bias=False)),
    # Qwen3-MoE: q/k norms (its rms_norm_eps), no shared expert, head_dim as hidden_size / heads
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**COMMON, "rms_norm_eps": 1e-3}, head_dim=8, intermediate_size=24, moe_intermediate_size=12, num_experts=4,
        norm_topk_prob=True, attention_bias=False)),
    "qwen3_moe_raw_top3": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**COMMON, "num_experts_per_tok": 3, "tie_word_embeddings": True}, head_dim=8, intermediate_size=24,
        moe_intermediate_size=8, num_experts=6, norm_topk_prob=False, attention_bias=False)),
    # DeepSeek-V3's own routing: one ungated shared expert, normalised weights times 2.5, interleaved RoPE channels
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, **MLA}, intermediate_size=48, moe_intermediate_size=12, n_routed_experts=4, n_shared_experts=1,
        routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, rope_interleave=True)),
    # two expert groups of which both are kept (the same routing as none), unnormalised, no shared expert, top 3
    "deepseek_v3_groups_kept": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, **MLA, "hidden_act": "gelu", "num_experts_per_tok": 3}, intermediate_size=48,
        moe_intermediate_size=8, n_routed_experts=6, n_shared_experts=0, routed_scaling_factor=1.0, n_group=2,
        topk_group=2, norm_topk_prob=False, rope_interleave=False)),
}
FAMILIES = {"mixtral": "mixtral", "mixtral_gelu_top1": "mixtral", "qwen2_moe": "qwen2_moe",
            "qwen2_moe_norm": "qwen2_moe", "qwen3_moe": "qwen3_moe", "qwen3_moe_raw_top3": "qwen3_moe",
            "deepseek_v3": "deepseek_v3", "deepseek_v3_groups_kept": "deepseek_v3"}


def _hf(case: str):
    torch.manual_seed(1)
    model = CASES[case]().eval()
    with torch.no_grad():  # sharp routers and norms away from 1: a wrong mapping would show
        for name, p in model.named_parameters():
            if "norm" in name:  # Qwen3's q_norm / k_norm too
                p.uniform_(0.5, 1.5)
            elif name.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's balancing bias: it changes choices
                b.normal_(0, 0.3)
    return model


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_hf_and_back_give_the_same_logits(case: str) -> None:
    hf = _hf(case)
    ours = from_hf(hf)
    assert family(ours.cfg) == FAMILIES[case]
    assert ours.cfg.ffn["name"] == "moe"
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    expected = _logits(hf, idx)
    torch.testing.assert_close(_logits(ours, idx), expected, rtol=1e-5, atol=1e-5)
    back = to_hf(ours)
    assert type(back) is type(hf)
    torch.testing.assert_close(_logits(back, idx), expected, rtol=1e-5, atol=1e-5)


def _moe_cfg(attention: dict | None = None, **ffn) -> GPTConfig:
    return validate(GPTConfig(vocab_size=V, n_layer=2, d_model=32, n_head=4, norm={"name": "rms"},
                              ffn={"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 16,
                                   **ffn}, attention=attention or {"name": "mha"}))


DEEPSEEK = {"score": "sigmoid", "n_shared": 1, "routed_scale": 2.5, "bias_update_rate": 0.001}


@pytest.mark.parametrize("ffn", [DEEPSEEK, {**DEEPSEEK, "n_shared": 0, "norm_topk": False, "routed_scale": 1.0,
                                            "expert": "geglu"}])
def test_an_lmlab_moe_with_mla_exports_as_deepseek_v3(ffn: dict) -> None:
    """Sigmoid routing steered by a trained balancing bias, which transformers holds as e_score_correction_bias."""
    torch.manual_seed(0)
    model = GPT(_moe_cfg({"name": "mla", "kv_lora_rank": 12}, **ffn)).eval()
    with torch.no_grad():
        for blk in model.h:
            blk.mlp.router.weight.normal_(0, 0.5)
            blk.mlp.expert_bias.normal_(0, 0.3)
    hf = to_hf(model)
    assert family(model.cfg) == "deepseek_v3" and type(hf) is transformers.DeepseekV3ForCausalLM
    c = hf.config
    assert (c.first_k_dense_replace, c.n_group, c.topk_group, c.n_routed_experts) == (0, 1, 1, 4)
    assert c.routed_scaling_factor == ffn["routed_scale"] and c.n_shared_experts == ffn["n_shared"]
    torch.testing.assert_close(hf.model.layers[1].mlp.gate.e_score_correction_bias, model.h[1].mlp.expert_bias)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(hf, idx), _logits(model, idx), rtol=1e-5, atol=1e-5)
    back = from_hf(hf)
    torch.testing.assert_close(_logits(back, idx), _logits(model, idx), rtol=1e-5, atol=1e-5)
    for key in ("score", "n_shared", "routed_scale", "norm_topk", "expert"):
        assert back.cfg.ffn[key] == model.cfg.ffn.get(key, True), key


def test_an_lmlab_moe_exports_with_its_family() -> None:
    for ffn, fam in (({}, "mixtral"), ({"n_shared": 2, "shared_gate": True}, "qwen2_moe"),
                     ({"n_shared": 1, "shared_gate": True, "norm_topk": False}, "qwen2_moe")):
        torch.manual_seed(0)
        model = GPT(_moe_cfg(**ffn)).eval()
        hf = to_hf(model)
        assert family(model.cfg) == fam
        idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(_logits(hf, idx), _logits(model, idx), rtol=1e-5, atol=1e-5)
    assert hf.config.shared_expert_intermediate_size == 16 and hf.config.norm_topk_prob is False


@pytest.mark.parametrize("norm_topk", [True, False])
def test_an_lmlab_moe_with_qk_norm_exports_as_qwen3_moe(norm_topk: bool) -> None:
    """GQA with q/k norms whose epsilon is the model's norm's (Qwen3 uses rms_norm_eps for both), no shared expert."""
    torch.manual_seed(0)
    cfg = validate(GPTConfig(vocab_size=V, n_layer=2, d_model=32, n_head=4, n_kv_head=2, norm={"name": "rms",
                             "eps": 1e-3}, ffn={"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2,
                                                "hidden": 16, "norm_topk": norm_topk},
                             attention={"name": "gqa", "qk_norm": True, "qk_norm_eps": 1e-3}))
    model = GPT(cfg).eval()
    with torch.no_grad():
        for blk in model.h:
            blk.attn.q_norm.uniform_(0.5, 1.5)
            blk.attn.k_norm.uniform_(0.5, 1.5)
            blk.mlp.router.weight.normal_(0, 0.5)
    hf = to_hf(model)
    assert family(model.cfg) == "qwen3_moe" and type(hf) is transformers.Qwen3MoeForCausalLM
    assert hf.config.norm_topk_prob is norm_topk and hf.config.rms_norm_eps == 1e-3
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(hf, idx), _logits(model, idx), rtol=1e-5, atol=1e-5)
    back = from_hf(hf)
    assert back.cfg.attention["qk_norm"] and back.cfg.attention["qk_norm_eps"] == 1e-3
    torch.testing.assert_close(_logits(back, idx), _logits(model, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("attention", "ffn", "message"), [
    ({"qk_norm": True}, {}, r"attention\.qk_norm_eps=None has no Qwen3-MoE form .*1e-06"),
    ({"qk_norm": True, "qk_norm_eps": 1e-5}, {}, r"attention\.qk_norm_eps=1e-05 has no Qwen3-MoE form"),
    ({"qk_norm": True, "qk_norm_eps": 1e-6}, {"n_shared": 1, "shared_gate": True},
     r"ffn\.n_shared=1 has no Qwen3-MoE form"),
])
def test_what_qwen3_moe_cannot_represent_is_refused_by_key(attention: dict, ffn: dict, message: str) -> None:
    with pytest.raises(NotRepresentable, match=message):
        to_hf(GPT(_moe_cfg({"name": "mha", **attention}, **ffn)))


@pytest.mark.parametrize(("ffn", "message"), [
    ({"n_shared": 1}, r"ffn\.n_shared=1 has no Qwen2-MoE form .*ffn\.shared_gate=true"),
    ({"score": "sigmoid"}, r"ffn\.score='sigmoid' has no Mixtral, Qwen2-MoE or Qwen3-MoE form"),
    ({"capacity_factor": 1.25}, r"ffn\.capacity_factor=1\.25 has no"),
    ({"bias_update_rate": 0.001}, r"ffn\.bias_update_rate=0\.001 has no"),
    ({"norm_topk": False}, r"ffn\.norm_topk=False has no Mixtral form"),
    ({"routed_scale": 2.5}, r"ffn\.routed_scale=2\.5 has no Mixtral, Qwen2-MoE or Qwen3-MoE form"),
    ({"expert": "mlp"}, r"ffn\.expert='mlp' has no Mixtral, Qwen2-MoE or Qwen3-MoE form"),
])
def test_what_transformers_cannot_represent_is_refused_by_key(ffn: dict, message: str) -> None:
    with pytest.raises(NotRepresentable, match=message):
        to_hf(GPT(_moe_cfg(**ffn)))


@pytest.mark.parametrize(("ffn", "message"), [
    ({"score": "softmax"}, r"ffn\.score='softmax' has no DeepSeek-V3 form"),
    ({"shared_gate": True}, r"ffn\.shared_gate=True has no DeepSeek-V3 form .*ungated"),
    ({"capacity_factor": 1.5}, r"ffn\.capacity_factor=1\.5 has no DeepSeek-V3 form"),
    ({"expert": "mlp"}, r"ffn\.expert='mlp' has no DeepSeek-V3 form"),
])
def test_what_deepseek_v3_cannot_represent_is_refused_by_key(ffn: dict, message: str) -> None:
    with pytest.raises(NotRepresentable, match=message):
        to_hf(GPT(_moe_cfg({"name": "mla", "kv_lora_rank": 12}, **{**DEEPSEEK, **ffn})))


@pytest.mark.parametrize(("fields", "message"), [
    ({"n_group": 2, "topk_group": 1}, r"n_group=2 topk_group=1: lmlab's router chooses among all experts"),
    ({"first_k_dense_replace": 1}, r"first_k_dense_replace=1 < num_hidden_layers=2: dense first layers"),
])
def test_deepseek_v3_routing_lmlab_cannot_represent_is_refused_on_import(fields: dict, message: str) -> None:
    from lmlab.interop.hf import lmlab_config

    config = transformers.DeepseekV3Config(**{**COMMON, **MLA, **fields}, intermediate_size=48,
                                           moe_intermediate_size=12, n_routed_experts=4)
    with pytest.raises(NotRepresentable, match=message):
        lmlab_config(config)


def test_imports_lmlab_cannot_represent_are_refused() -> None:
    from lmlab.interop.hf import lmlab_config

    qwen = dict(**COMMON, intermediate_size=24, moe_intermediate_size=12, num_experts=4)
    for cfg, message in ((transformers.Qwen2MoeConfig(**qwen, shared_expert_intermediate_size=24), r"qkv_bias=True"),
                         (transformers.Qwen2MoeConfig(**qwen, shared_expert_intermediate_size=18, qkv_bias=False),
                          r"shared_expert_intermediate_size=18 is not a multiple"),
                         (transformers.MixtralConfig(**COMMON, intermediate_size=24, sliding_window=8),
                          r"sliding_window=8"),
                         (transformers.Qwen3MoeConfig(**qwen, attention_bias=True), r"attention_bias=True"),
                         (transformers.Qwen3MoeConfig(**qwen, mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
                         (transformers.Qwen3MoeConfig(**qwen, decoder_sparse_step=2), r"decoder_sparse_step=2"),
                         (transformers.Qwen3MoeConfig(**qwen, use_sliding_window=True, sliding_window=8),
                          r"use_sliding_window=True")):
        with pytest.raises(NotRepresentable, match=message):
            lmlab_config(cfg)
