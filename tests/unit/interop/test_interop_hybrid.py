"""transformers interop for the hybrid mixers (lmlab.interop.hf_hybrid): Bamba (mixer=mamba2, Llama's attention at
attn_layer_indices) and Qwen3-Next (mixer=gdn, its gated attention with q/k norms, zero-centred norms, every FFN dense)
give the same logits both ways (fp32, tight tolerance) on random weights, every parameter moved off its init (gains,
A_log, dt_bias, D, biases), through transformers' own CPU paths; the lmlab config comes back equal; and what either
side cannot represent is refused naming its key."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from lmlab.config import GPTConfig  # noqa: E402
from lmlab.interop.hf import NotRepresentable, family, from_hf, lmlab_config, to_hf  # noqa: E402
from lmlab.model.gpt import GPT, validate  # noqa: E402
from lmlab.model.mixer import layer_types  # noqa: E402
from tests.unit.interop.test_interop_hf import _logits  # noqa: E402  (lmlab's or a transformers model's logits, fp32)

V = 128
BASE = dict(vocab_size=V, n_layer=4, d_model=64, n_head=4, max_seq_len=32, activation={"name": "silu"},
            ffn={"name": "swiglu", "hidden": 96})
MAMBA = dict(name="mamba2", d_state=16, expand=2, head_dim=16, n_groups=2, conv_size=4, chunk_size=8, norm_eps=1e-5)
GDN = dict(name="gdn", n_heads=2, n_v_heads=4, head_dim=16, v_head_dim=8, conv_size=4, chunk_size=64, norm_eps=1e-6)
BAMBA = dict(**BASE, norm={"name": "rms", "eps": 1e-5, "affine": True}, n_kv_head=2, position={
    "name": "rope", "rotary_pct": 0.5}, attention={"name": "gqa"}, mixer={**MAMBA, "pattern": [
        "mamba2", "mamba2", "attention", "mamba2"]})
QWEN3_NEXT = dict(**BASE, norm={"name": "rms", "eps": 1e-6, "affine": True}, n_kv_head=2, position={
    "name": "rope", "rotary_pct": 0.25}, attention={"name": "gqa", "qk_norm": True, "qk_norm_eps": 1e-6,
                                                    "gate": "elementwise"},
                  mixer={**GDN, "pattern": ["gdn", "gdn", "gdn", "attention"]})


def _with(base: dict, **override) -> dict:
    """`base` with groups changed: a dict without a name updates the group's keys, anything else replaces it."""
    return {**base, **{k: {**base[k], **v} if isinstance(v, dict) and "name" not in v and isinstance(
        base.get(k), dict) else v for k, v in override.items()}}


LMLAB_CASES = {
    # biases everywhere (attention, MLP and the mixer's projections), GQA, one attention layer written per layer
    "bamba_gqa_bias": _with(BAMBA, bias=True, tie_embeddings=False),
    # a cycled pattern, MHA, tied, dt clamped at both ends, one group, a short conv, a quarter of each head rotated
    "bamba_cycle_tied_dt_limit": _with(BAMBA, n_kv_head=4, attention={"name": "mha"}, tie_embeddings=True,
                                       position={"rotary_pct": 0.25, "theta": 5e4},
                                       mixer={"pattern": ["mamba2", "attention"], "n_groups": 1, "d_state": 8,
                                              "conv_size": 3, "dt_limit": (0.05, 0.5)}),
    # the attention layer first, MQA, every dim of a head rotated
    "bamba_mqa_attention_first": _with(BAMBA, n_kv_head=1, attention={"name": "mqa"}, position={"rotary_pct": 1.0},
                                       mixer={"pattern": ["attention", "mamba2", "mamba2", "mamba2"]}),
    # Qwen3-Next's own proportions: three GDN layers to one attention layer, twice the value heads, untied
    "qwen3_next_gqa": _with(QWEN3_NEXT, tie_embeddings=False),
    # a per-layer pattern with no shorter cycle, MHA, tied, GDN heads as many as values, a short conv
    "qwen3_next_layers_tied": _with(QWEN3_NEXT, n_kv_head=4, tie_embeddings=True, position={"rotary_pct": 0.5},
                                    attention={"name": "mha", "qk_norm": True, "qk_norm_eps": 1e-6,
                                               "gate": "elementwise"},
                                    mixer={"pattern": ["gdn", "attention", "attention", "gdn"], "n_heads": 4,
                                           "n_v_heads": 4, "v_head_dim": 16, "conv_size": 3}),
}


def _randomise(model: torch.nn.Module, centred: bool = False, seed: int = 0) -> torch.nn.Module:
    """Every parameter off its init, so that a tensor mapped to the wrong place shows: gains in (0.5, 1.5) (stored as
    w in (-0.5, 0.5) where `centred`: Qwen3-Next's RMSNorms multiply by 1 + w, its GDN's gated norm by w), A_log,
    dt_bias and D of either size, biases and projections small but far from zero."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1 and ("norm" in name or ".ln_" in name or name.startswith("ln_")) and leaf != "bias":
                zero_centred = centred and "linear_attn.norm" not in name
                p.uniform_(-0.5, 0.5) if zero_centred else p.uniform_(0.5, 1.5)
            elif leaf == "A_log":
                p.uniform_(-2.0, 0.5)
            elif leaf in ("dt_bias", "D"):
                p.normal_(0, 1.0)
            elif p.dim() == 3:  # the conv's taps
                p.normal_(0, 0.2)
            else:  # large enough that every weight matters, small enough that fp32's rounding stays ~1e-6
                p.normal_(0, 0.05)
    return model.eval()


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(LMLAB_CASES))
def test_to_hf_gives_the_same_logits_and_the_config_round_trips(case: str) -> None:
    ours = _randomise(GPT(validate(GPTConfig(**LMLAB_CASES[case]))))
    fam = case.split("_")[0] if case.startswith("bamba") else "qwen3_next"
    assert family(ours.cfg) == fam
    hf = to_hf(ours)
    assert type(hf) is {"bamba": transformers.BambaForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM}[fam]
    types = ["full_attention" if t == "attention" else "linear_attention" for t in layer_types(ours.cfg)]
    assert hf.config.layer_types == types  # Bamba's: its attn_layer_indices, per layer
    assert hf.config.rope_parameters["partial_rotary_factor"] == ours.cfg.position["rotary_pct"]
    idx = _tokens(30)  # past a Bamba chunk (8) several times
    expected = _logits(ours, idx)
    torch.testing.assert_close(_logits(hf, idx), expected, rtol=1e-5, atol=1e-5)
    back = from_hf(hf)
    torch.testing.assert_close(_logits(back, idx), expected, rtol=1e-5, atol=1e-5)
    assert back.cfg.to_dict() == ours.cfg.to_dict()  # lmlab -> transformers -> lmlab: the same config


def test_a_gdn_chunk_comes_back_as_the_default_with_the_same_logits() -> None:
    """Qwen3-Next's config has no chunk size (the chunked form's result does not depend on it): mixer.chunk_size
    comes back at lmlab's default, and the model is the same function."""
    ours = _randomise(GPT(validate(GPTConfig(**_with(QWEN3_NEXT, mixer={"chunk_size": 8})))))
    back = from_hf(to_hf(ours))
    assert back.cfg.mixer["chunk_size"] == 64
    idx = _tokens(20)
    torch.testing.assert_close(_logits(back, idx), _logits(ours, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bamba_cycle_tied_dt_limit", "qwen3_next_gqa"])
def test_an_export_reloads_with_auto_classes_every_tensor_in_place(case: str, tmp_path) -> None:
    """save_pretrained, then AutoModelForCausalLM: no tensor missing (transformers would fill it with its init) or
    unexpected, the same logits."""
    ours = _randomise(GPT(validate(GPTConfig(**LMLAB_CASES[case]))))
    to_hf(ours).save_pretrained(tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    idx = _tokens(20)
    torch.testing.assert_close(_logits(hf.eval(), idx), _logits(ours, idx), rtol=1e-5, atol=1e-5)


HF_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=32, attention_dropout=0.0, pad_token_id=None, bos_token_id=None,
                 eos_token_id=None)
BAMBA_HF = dict(**HF_COMMON, rms_norm_eps=1e-5, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=8)
QWEN3_NEXT_HF = dict(**HF_COMMON, rms_norm_eps=1e-6, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
HF_CASES = {
    # transformers' defaults otherwise: half of each head rotated, no biases, a conv bias
    "bamba": lambda: transformers.BambaForCausalLM(transformers.BambaConfig(
        **BAMBA_HF, num_key_value_heads=2, attn_layer_indices=[1], tie_word_embeddings=False)),
    # every projection biased but the conv (imported as a zero bias), dt clamped, tied, MHA, two attention layers
    "bamba_biases_no_conv_bias": lambda: transformers.BambaForCausalLM(transformers.BambaConfig(
        **BAMBA_HF, num_key_value_heads=4, attn_layer_indices=[0, 3], attention_bias=True, mlp_bias=True,
        mamba_proj_bias=True, mamba_conv_bias=False, time_step_limit=(0.01, 1.0), tie_word_embeddings=True)),
    # Qwen3-Next's default layout (full_attention_interval 4), every layer dense by mlp_only_layers
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **QWEN3_NEXT_HF, num_key_value_heads=2, mlp_only_layers=[0, 1, 2, 3], tie_word_embeddings=False)),
    # dense by num_experts=0, explicit layer types, MQA, tied, half of each head rotated
    "qwen3_next_no_experts": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **QWEN3_NEXT_HF, num_key_value_heads=1, num_experts=0, tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_from_hf_gives_the_same_logits_and_back(case: str) -> None:
    hf = _randomise(HF_CASES[case](), centred=case.startswith("qwen3_next"), seed=1)
    ours = from_hf(hf)
    idx = _tokens(30, seed=2)
    expected = _logits(hf, idx)
    torch.testing.assert_close(_logits(ours, idx), expected, rtol=1e-5, atol=1e-5)
    back = to_hf(ours)
    assert type(back) is type(hf)
    torch.testing.assert_close(_logits(back, idx), expected, rtol=1e-5, atol=1e-5)
    c, b = hf.config, back.config
    assert b.layer_types == c.layer_types and b.rope_parameters == c.rope_parameters
    assert b.tie_word_embeddings == c.tie_word_embeddings and b.num_key_value_heads == c.num_key_value_heads


def test_an_imported_pattern_is_the_shortest_cycle_of_the_layer_types() -> None:
    config = transformers.Qwen3NextConfig(**{**QWEN3_NEXT_HF, "num_hidden_layers": 8}, mlp_only_layers=list(range(8)))
    cfg = lmlab_config(config)  # full_attention_interval 4: [gdn, gdn, gdn, attention] twice
    assert cfg.mixer["pattern"] == ["gdn", "gdn", "gdn", "attention"]
    cfg = lmlab_config(transformers.BambaConfig(**BAMBA_HF, attn_layer_indices=[1, 3]))
    assert cfg.mixer["name"] == "mamba2" and cfg.mixer["pattern"] == ["mamba2", "attention"]


@pytest.mark.parametrize(("base", "override", "message"), [
    (BAMBA, {"mixer": {"name": "linear", "pattern": ["linear", "attention"]}}, r"mixer='linear' has no hybrid form"),
    (BAMBA, {"attention": {"window": 4}}, r"attention\.window=4 has no Bamba form"),
    (BAMBA, {"attention": {"sinks": True}}, r"attention\.sinks=True has no Bamba form"),
    (BAMBA, {"attention": {"qk_norm": True}}, r"attention\.qk_norm=True has no Bamba form"),
    (BAMBA, {"attention": {"gate": "elementwise"}}, r"attention\.gate='elementwise' has no Bamba form"),
    (BAMBA, {"attention": {"name": "mla", "kv_lora_rank": 12}}, r"attention='mla' has no Bamba form"),
    (BAMBA, {"placement": {"name": "post"}}, r"placement='post' has no Bamba form"),
    (BAMBA, {"residual": {"parallel": {}}}, r"residual='parallel' has no Bamba form"),
    (BAMBA, {"norm": {"name": "layer"}}, r"norm='layer' has no Bamba form"),
    (BAMBA, {"ffn": {"name": "geglu"}}, r"ffn='geglu' has no Bamba form .*SiLU"),
    (BAMBA, {"ffn": {"name": "mlp"}}, r"ffn='mlp' has no Bamba form"),
    (BAMBA, {"ffn": {"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 16}},
     r"ffn='moe' has no Bamba form"),
    (BAMBA, {"position": {"name": "alibi"}}, r"position='alibi' has no Bamba form"),
    (BAMBA, {"position": {"nope_layers": [2]}}, r"position\.nope_layers=\[2\] has no Bamba form"),
    (BAMBA, {"rope_scaling": {"name": "yarn", "factor": 2.0}, "train_len": 16}, r"rope_scaling='yarn' has no Bamba"),
    (BAMBA, {"mixer": {"norm_eps": 1e-6}}, r"mixer\.norm_eps=1e-06 has no Bamba form .*norm\.eps \(1e-05\)"),
    (BAMBA, {"mixer": {"norm_before_gate": True}}, r"mixer\.norm_before_gate=True has no Bamba form"),
    # no attention layer: transformers' hybrids count the tokens in an attention layer's cache, and fail without one
    (BAMBA, {"mixer": {"pattern": None}, "attention": {"name": "mha"}, "n_kv_head": None},
     r"mixer\.pattern=None has no Bamba form .*an attention layer"),
    (QWEN3_NEXT, {"mixer": {"pattern": ["gdn"]}, "attention": {"name": "mha"}, "n_kv_head": None},
     r"mixer\.pattern=\['gdn'\] has no Qwen3-Next form"),
    (QWEN3_NEXT, {"bias": True}, r"model\.bias=True has no Qwen3-Next form"),
    (QWEN3_NEXT, {"attention": {"qk_norm": False, "qk_norm_eps": None}}, r"attention\.qk_norm=False has no Qwen3-Next"),
    (QWEN3_NEXT, {"attention": {"qk_norm_eps": 1e-5}}, r"attention\.qk_norm_eps=1e-05 has no Qwen3-Next form"),
    (QWEN3_NEXT, {"attention": {"gate": "headwise"}}, r"attention\.gate='headwise' has no Qwen3-Next form"),
    (QWEN3_NEXT, {"attention": {"gate": None}}, r"attention\.gate=None has no Qwen3-Next form"),
    (QWEN3_NEXT, {"attention": {"softcap": 5.0}}, r"attention\.softcap=5\.0 has no Qwen3-Next form"),
    (QWEN3_NEXT, {"attention": {"window": 4}}, r"attention\.window=4 has no Qwen3-Next form"),
    (QWEN3_NEXT, {"mixer": {"norm_eps": 1e-5}}, r"mixer\.norm_eps=1e-05 has no Qwen3-Next form"),
    (QWEN3_NEXT, {"placement": {"name": "double"}}, r"placement='double' has no Qwen3-Next form"),
])
def test_what_a_hybrid_family_cannot_represent_is_refused_by_key(base: dict, override: dict, message: str) -> None:
    model = GPT(validate(GPTConfig(**_with(base, **override))))
    with pytest.raises(NotRepresentable, match=f"^{message}"):
        to_hf(model)


@pytest.mark.parametrize(("config", "message"), [
    (lambda: transformers.BambaConfig(**BAMBA_HF, attn_layer_indices=[1], attention_bias=True),
     r"attention_bias=True mlp_bias=False mamba_proj_bias=False: lmlab has one model\.bias"),
    (lambda: transformers.BambaConfig(**BAMBA_HF, attn_layer_indices=[1], mlp_bias=True, attention_bias=True),
     r"attention_bias=True mlp_bias=True mamba_proj_bias=False"),
    (lambda: transformers.BambaConfig(**BAMBA_HF, attn_layer_indices=[1], hidden_act="gelu"), r"hidden_act='gelu'"),
    (lambda: transformers.BambaConfig(**BAMBA_HF, attn_layer_indices=[1], rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), r"rope_type='linear'"),
    # a routed Qwen3-Next (every layer a mixture of experts by default), or some layers of one
    (lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT_HF, num_experts=4),
     r"num_experts=4 mlp_only_layers=\[\] decoder_sparse_step=1: layers \[0, 1, 2, 3\] are mixtures of experts"),
    (lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT_HF, num_experts=4, mlp_only_layers=[0, 1, 2]),
     r"num_experts=4 mlp_only_layers=\[0, 1, 2\] decoder_sparse_step=1: layers \[3\] are mixtures of experts"),
    (lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT_HF, num_experts=4, decoder_sparse_step=2),
     r"num_experts=4 mlp_only_layers=\[\] decoder_sparse_step=2: layers \[1, 3\]"),
    # BambaConfig's default: no attention layer, which transformers' Bamba cannot run
    (lambda: transformers.BambaConfig(**BAMBA_HF), r"layer_types=\['linear_attention', .*\]: no full_attention"),
    (lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT_HF, num_experts=0, attention_bias=True),
     r"attention_bias=True: lmlab has one model\.bias"),
    (lambda: transformers.Qwen3NextConfig(**{**QWEN3_NEXT_HF, "head_dim": 32}, num_experts=0),
     r"head_dim=32 x num_attention_heads=4 != hidden_size=64"),
])
def test_what_lmlab_cannot_represent_is_refused_on_import(config, message: str) -> None:
    with pytest.raises(NotRepresentable, match=f"^{message}"):
        lmlab_config(config())
