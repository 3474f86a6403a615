"""Hugging Face `transformers` interop: an lmlab GPT to and from `LlamaForCausalLM` / `GPT2LMHeadModel` (and their
relatives: Ministral for sliding windows, Gemma 2 for the double placement with softcaps, DeepSeek-V3 for
attention=mla; the MoE families built on Llama's layers; Bamba and Qwen3-Next for the hybrid mixers).

These families are represented exactly, weight for weight:
- Llama-like: placement=pre, norm=rms, a GLU FFN (swiglu; geglu/reglu/glu map to `hidden_act`), position=rope
  (full rotary) with rope_scaling none/linear/dynamic_ntk/yarn/ntk_by_parts/llama3, MHA/GQA/MQA, tied or untied;
- DeepSeek-V3-like: Llama's layers with attention=mla, rope_scaling none, no biases, every layer dense or every layer
  ffn=moe with sigmoid routing (lmlab.interop.hf_moe); a checkpoint with interleaved RoPE channels (rope_interleave,
  DeepSeek's own) is imported with the rows reordered;
- Gemma 2-like: Llama's layers under placement=double (its four norms per layer), the attention-logit and final-logit
  softcaps, local/global layers of one window, a temperature as query_pre_attn_scalar; exported untied (Gemma scales
  the embeddings by sqrt(d_model) on the way in only) with its norm gains stored as w − 1;
- GPT-NeoX-like (Pythia): placement=pre, norm=layer, the MLP, position=rope on the first rotary_pct of each head,
  MHA, blocks parallel (residual=parallel: its use_parallel_residual) or sequential; zero biases where lmlab has none;
- Mixtral / Qwen2-MoE / Qwen3-MoE: the Llama-like layers with ffn=moe (lmlab.interop.hf_moe says which routing each
  has; Qwen3-MoE's attention adds q/k norms);
- Bamba / Qwen3-Next: the hybrids, Llama's layers with a recurrent mixer in some (mixer.pattern: the layer types),
  partial RoPE: Bamba's Mamba-2 (mixer=mamba2) with Llama's attention; Qwen3-Next's Gated DeltaNet (mixer=gdn) with
  its gated attention (attention.gate=elementwise, q/k norms) and zero-centred norms, every FFN dense
  (lmlab.interop.hf_hybrid);
- GPT-2-like: placement=pre, norm=layer, the MLP FFN (gelu, gelu_tanh, relu, silu), position=learned, MHA. GPT-2's
  layers always have biases: an lmlab model without them is exported with zero biases (the same function).
head=mtp exports its next-token model (the MTP modules are left out: they train the trunk, and the logits are the
trunk's), and a model.untie_at_step head as it is at the checkpoint.
Anything else (post / deepnorm placements, squareplus, ALiBi, qk_norm, ...) is refused naming the axis and value:
never exported as something it is not. `transformers` is imported lazily (the `dev`/`bench` extras ship it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lmlab import env
from lmlab.config import GPTConfig
from lmlab.interop.hf_config import NotRepresentable, family, hf_config, lmlab_config  # noqa: F401  (public here)
from lmlab.interop.hf_hybrid import HYBRID_TYPES
from lmlab.interop.hf_hybrid import invert as hybrid_invert
from lmlab.interop.hf_hybrid import state as hybrid_state
from lmlab.interop.hf_moe import MOE_TYPES
from lmlab.interop.hf_moe import invert as moe_invert
from lmlab.interop.hf_moe import state as moe_state
from lmlab.model.gpt import GPT, validate
from lmlab.model.memory import check_model_fits
from lmlab.record.rundir import CHECKPOINTS, LAST, RunDir, atomic_write, load_model, load_run

log = logging.getLogger(__name__)

# --- weights -----------------------------------------------------------------------------------------------

def _split_rows(w: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    return list(w.split(list(sizes), dim=0))


def _llama_attention(sd: dict[str, torch.Tensor], p: str, q: str, block: Any, suffix: str) -> dict[str, torch.Tensor]:
    qw, kw, vw = _split_rows(sd[p + f"attn.c_attn.{suffix}"], block.attn.c_attn.fused)
    out = {q + f"self_attn.q_proj.{suffix}": qw, q + f"self_attn.k_proj.{suffix}": kw,
           q + f"self_attn.v_proj.{suffix}": vw, q + f"self_attn.o_proj.{suffix}": sd[p + f"attn.c_proj.{suffix}"]}
    for x in ("q", "k"):  # qk_norm's gains (Qwen3-MoE)
        if suffix == "weight" and p + f"attn.{x}_norm" in sd:
            out[q + f"self_attn.{x}_norm.weight"] = sd[p + f"attn.{x}_norm"]
    return out


# lmlab's MLA weights and DeepSeek-V3's (transformers), one to one; the MLP and the norms are Llama's.
_MLA_NAMES = {"q_proj.weight": "q_proj.weight", "q_a.weight": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight",
              "q_b.weight": "q_b_proj.weight", "kv_a.weight": "kv_a_proj_with_mqa.weight",
              "kv_a_norm": "kv_a_layernorm.weight", "kv_b.weight": "kv_b_proj.weight", "c_proj.weight": "o_proj.weight"}


def _mla_attention(sd: dict[str, torch.Tensor], p: str, q: str, block: Any, suffix: str) -> dict[str, torch.Tensor]:
    return {q + "self_attn." + theirs: sd[p + "attn." + ours] for ours, theirs in _MLA_NAMES.items()
            if p + "attn." + ours in sd}


def _llama_state(model: GPT, attention: Any = _llama_attention) -> dict[str, torch.Tensor]:
    """Llama's names (and its relatives', whose attention differs: `attention` maps one layer's)."""
    sd, out = model.state_dict(), {}
    fam = family(model.cfg)
    routed = model.cfg.ffn["name"] == "moe"  # routed experts (lmlab.interop.hf_moe): Mixtral, Qwen2-MoE, DeepSeek-V3
    out["model.embed_tokens.weight"] = sd["wte.weight"]
    for i, block in enumerate(model.h):
        p, q = f"h.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "ln_1.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ln_2.weight"]
        for suffix in ("weight", "bias") if model.cfg.bias else ("weight",):
            out.update(attention(sd, p, q, block, suffix))
            if routed:
                continue
            gate, up = _split_rows(sd[p + f"mlp.c_fc.{suffix}"], block.mlp.c_fc.fused)
            out[q + f"mlp.gate_proj.{suffix}"], out[q + f"mlp.up_proj.{suffix}"] = gate, up
            out[q + f"mlp.down_proj.{suffix}"] = sd[p + f"mlp.c_proj.{suffix}"]
        if routed:
            out.update(moe_state(sd, p, q, block, fam))
    out["model.norm.weight"] = sd["ln_f.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _deepseek_state(model: GPT) -> dict[str, torch.Tensor]:
    return _llama_state(model, _mla_attention)


# lmlab's double placement and Gemma 2's four norms per layer; Gemma's RMSNorm multiplies by 1 + w.
_GEMMA_NORMS = {"ln_1": "input_layernorm", "ln_1_post": "post_attention_layernorm", "ln_2": "pre_feedforward_layernorm",
                "ln_2_post": "post_feedforward_layernorm"}


def _gemma2_state(model: GPT) -> dict[str, torch.Tensor]:
    """Llama's projections; the norms' gains minus one; the embeddings divided by sqrt(d_model), which Gemma 2
    multiplies them by (untied: the head keeps lmlab's matrix)."""
    out = _llama_state(model)
    sd = model.state_dict()
    out["model.embed_tokens.weight"] = sd["wte.weight"] / model.cfg.d_model ** 0.5
    for i in range(model.cfg.n_layer):
        for ours, theirs in _GEMMA_NORMS.items():
            out.pop(f"model.layers.{i}.{theirs}.weight", None)
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"h.{i}.{ours}.weight"] - 1
    out["model.norm.weight"] = sd["ln_f.weight"] - 1
    return out


def _neox_state(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-NeoX's names; its fused QKV holds each head's [q; k; v] rows together (lmlab's: all q, all k, all v); its
    MLP, attention and norms always have biases (zeros where lmlab has none)."""
    sd, out, cfg = model.state_dict(), {}, model.cfg
    nh, hs, d = cfg.n_head, cfg.head_dim, cfg.d_model

    def bias_of(name: str, n: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(n, dtype=sd["wte.weight"].dtype))

    out["gpt_neox.embed_in.weight"] = sd["wte.weight"]
    for i in range(cfg.n_layer):
        p, q = f"h.{i}.", f"gpt_neox.layers.{i}."
        for ours, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[q + f"{theirs}.weight"], out[q + f"{theirs}.bias"] = sd[p + f"{ours}.weight"], bias_of(
                p + f"{ours}.bias", d)
        w = sd[p + "attn.c_attn.weight"].view(3, nh, hs, d).transpose(0, 1)  # (nh, [q k v], hs, d)
        out[q + "attention.query_key_value.weight"] = w.reshape(3 * d, d)
        out[q + "attention.query_key_value.bias"] = bias_of(p + "attn.c_attn.bias", 3 * d).view(3, nh, hs).transpose(
            0, 1).reshape(3 * d)
        out[q + "attention.dense.weight"] = sd[p + "attn.c_proj.weight"]
        out[q + "attention.dense.bias"] = bias_of(p + "attn.c_proj.bias", d)
        for ours, theirs in (("c_fc", "dense_h_to_4h"), ("c_proj", "dense_4h_to_h")):
            w = sd[p + f"mlp.{ours}.weight"]
            out[q + f"mlp.{theirs}.weight"], out[q + f"mlp.{theirs}.bias"] = w, bias_of(p + f"mlp.{ours}.bias",
                                                                                        w.size(0))
    out["gpt_neox.final_layer_norm.weight"] = sd["ln_f.weight"]
    out["gpt_neox.final_layer_norm.bias"] = bias_of("ln_f.bias", d)
    out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _deinterleave(state: dict[str, torch.Tensor], q: str, hf_config: Any) -> None:
    """transformers' `rope_interleave=True` (DeepSeek's checkpoints) reorders each RoPE part's channels (0, 2, 4, ...,
    1, 3, 5, ...) before a half-split rotation; the same reordering of the rows that make q_rope and k_rope gives
    lmlab's half-split RoPE the same logits."""
    r, nope, nh = hf_config.qk_rope_head_dim, hf_config.qk_nope_head_dim, hf_config.num_attention_heads
    order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    name = q + ("self_attn.q_proj.weight" if hf_config.q_lora_rank is None else "self_attn.q_b_proj.weight")
    w = state[name].view(nh, nope + r, -1)
    state[name] = torch.cat((w[:, :nope], w[:, nope:][:, order]), dim=1).reshape(nh * (nope + r), -1)
    kv = state[q + "self_attn.kv_a_proj_with_mqa.weight"]
    rank = kv.size(0) - r
    state[q + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat((kv[:rank], kv[rank:][order]))


def _gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    sd, out = model.state_dict(), {}

    def bias_of(name: str, n: int) -> torch.Tensor:  # GPT-2 always has biases: zeros are the same function
        return sd.get(name, torch.zeros(n, dtype=sd["wte.weight"].dtype))

    out["transformer.wte.weight"] = sd["wte.weight"]
    out["transformer.wpe.weight"] = sd["pos.wpe.weight"]
    for i in range(model.cfg.n_layer):
        p, q = f"h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[q + f"{ln}.weight"] = sd[p + f"{ln}.weight"]
            out[q + f"{ln}.bias"] = bias_of(p + f"{ln}.bias", model.cfg.d_model)
        for ours, theirs in (("attn.c_attn", "attn.c_attn"), ("attn.c_proj", "attn.c_proj"),
                             ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
            w = sd[p + f"{ours}.weight"]
            out[q + f"{theirs}.weight"] = w.t().contiguous()  # Conv1D stores (in, out)
            out[q + f"{theirs}.bias"] = bias_of(p + f"{ours}.bias", w.size(0))
    out["transformer.ln_f.weight"] = sd["ln_f.weight"]
    out["transformer.ln_f.bias"] = bias_of("ln_f.bias", model.cfg.d_model)
    out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _invert(state: dict[str, torch.Tensor], model: GPT, fam: str) -> dict[str, torch.Tensor]:
    """transformers' state dict -> lmlab's, by running the forward mapping on names and inverting each rule."""
    if fam in HYBRID_TYPES:
        return hybrid_invert(state, model, fam)
    sd = {}
    if fam == "deepseek_v3":
        sd["wte.weight"] = state["model.embed_tokens.weight"]
        for i in range(model.cfg.n_layer):
            p, q = f"h.{i}.", f"model.layers.{i}."
            sd[p + "ln_1.weight"] = state[q + "input_layernorm.weight"]
            sd[p + "ln_2.weight"] = state[q + "post_attention_layernorm.weight"]
            for ours, theirs in _MLA_NAMES.items():
                if q + "self_attn." + theirs in state:
                    sd[p + "attn." + ours] = state[q + "self_attn." + theirs]
            if model.cfg.ffn["name"] == "moe":
                sd.update(moe_invert(state, p, q, model.cfg, fam))
                continue
            sd[p + "mlp.c_fc.weight"] = torch.cat([state[q + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
            sd[p + "mlp.c_proj.weight"] = state[q + "mlp.down_proj.weight"]
        sd["ln_f.weight"] = state["model.norm.weight"]
    elif fam == "gpt_neox":
        nh, hs, d = model.cfg.n_head, model.cfg.head_dim, model.cfg.d_model
        sd["wte.weight"] = state["gpt_neox.embed_in.weight"]
        for i in range(model.cfg.n_layer):
            p, q = f"h.{i}.", f"gpt_neox.layers.{i}."
            for ours, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
                sd[p + f"{ours}.weight"], sd[p + f"{ours}.bias"] = (state[q + f"{theirs}.weight"],
                                                                     state[q + f"{theirs}.bias"])
            qkv = state[q + "attention.query_key_value.weight"].view(nh, 3, hs, d).transpose(0, 1)
            sd[p + "attn.c_attn.weight"] = qkv.reshape(3 * d, d)
            sd[p + "attn.c_attn.bias"] = state[q + "attention.query_key_value.bias"].view(nh, 3, hs).transpose(
                0, 1).reshape(3 * d)
            for ours, theirs in (("attn.c_proj", "attention.dense"), ("mlp.c_fc", "mlp.dense_h_to_4h"),
                                 ("mlp.c_proj", "mlp.dense_4h_to_h")):
                sd[p + f"{ours}.weight"], sd[p + f"{ours}.bias"] = (state[q + f"{theirs}.weight"],
                                                                     state[q + f"{theirs}.bias"])
        sd["ln_f.weight"] = state["gpt_neox.final_layer_norm.weight"]
        sd["ln_f.bias"] = state["gpt_neox.final_layer_norm.bias"]
    elif fam == "gemma2":
        sd = _invert(state, model, "llama")  # the projections; the norms and the embeddings below
        sd["wte.weight"] = state["model.embed_tokens.weight"] * model.cfg.d_model ** 0.5
        for i in range(model.cfg.n_layer):
            for ours, theirs in _GEMMA_NORMS.items():
                sd[f"h.{i}.{ours}.weight"] = state[f"model.layers.{i}.{theirs}.weight"] + 1
        sd["ln_f.weight"] = state["model.norm.weight"] + 1
        sd["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        return sd
    elif fam in ("llama", "ministral", *MOE_TYPES):
        sd["wte.weight"] = state["model.embed_tokens.weight"]
        for i in range(model.cfg.n_layer):
            p, q = f"h.{i}.", f"model.layers.{i}."
            sd[p + "ln_1.weight"] = state[q + "input_layernorm.weight"]
            sd[p + "ln_2.weight"] = state[q + "post_attention_layernorm.weight"]
            for suffix in ("weight", "bias") if model.cfg.bias else ("weight",):
                sd[p + f"attn.c_attn.{suffix}"] = torch.cat(
                    [state[q + f"self_attn.{x}_proj.{suffix}"] for x in "qkv"], dim=0)
                sd[p + f"attn.c_proj.{suffix}"] = state[q + f"self_attn.o_proj.{suffix}"]
                for x in ("q", "k"):  # qk_norm's gains (Qwen3-MoE)
                    if q + f"self_attn.{x}_norm.weight" in state:
                        sd[p + f"attn.{x}_norm"] = state[q + f"self_attn.{x}_norm.weight"]
                if fam in MOE_TYPES:
                    sd.update(moe_invert(state, p, q, model.cfg, fam))
                    continue
                sd[p + f"mlp.c_fc.{suffix}"] = torch.cat(
                    [state[q + f"mlp.{x}_proj.{suffix}"] for x in ("gate", "up")], dim=0)
                sd[p + f"mlp.c_proj.{suffix}"] = state[q + f"mlp.down_proj.{suffix}"]
        sd["ln_f.weight"] = state["model.norm.weight"]
    else:
        sd["wte.weight"] = state["transformer.wte.weight"]
        sd["pos.wpe.weight"] = state["transformer.wpe.weight"]
        for i in range(model.cfg.n_layer):
            p, q = f"h.{i}.", f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                sd[p + f"{ln}.weight"], sd[p + f"{ln}.bias"] = state[q + f"{ln}.weight"], state[q + f"{ln}.bias"]
            for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                sd[p + f"{name}.weight"] = state[q + f"{name}.weight"].t().contiguous()
                sd[p + f"{name}.bias"] = state[q + f"{name}.bias"]
        sd["ln_f.weight"], sd["ln_f.bias"] = state["transformer.ln_f.weight"], state["transformer.ln_f.bias"]
    sd["lm_head.weight"] = state["lm_head.weight"] if "lm_head.weight" in state else sd["wte.weight"]
    return sd


# --- the two directions --------------------------------------------------------------------------------------

def to_hf(model_or_run_dir: GPT | str | Path) -> Any:
    """A transformers model (LlamaForCausalLM or GPT2LMHeadModel) computing what the lmlab model computes: an
    lmlab `GPT`, or a run directory (its last checkpoint)."""
    import transformers


    model = load_model(model_or_run_dir) if isinstance(model_or_run_dir, (str, Path)) else model_or_run_dir
    model = model.next_token_model()  # head=mtp's modules are training's: transformers' families have no place
    config = hf_config(model.cfg)
    fam = family(model.cfg)
    hf = {"llama": transformers.LlamaForCausalLM, "ministral": transformers.MinistralForCausalLM,
          "deepseek_v3": transformers.DeepseekV3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
          "gpt_neox": transformers.GPTNeoXForCausalLM, "mixtral": transformers.MixtralForCausalLM,
          "qwen2_moe": transformers.Qwen2MoeForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
          "bamba": transformers.BambaForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM,
          "gpt2": transformers.GPT2LMHeadModel}[fam](config)
    state = {"deepseek_v3": _deepseek_state, "gemma2": _gemma2_state, "gpt_neox": _neox_state, "gpt2": _gpt2_state,
             **dict.fromkeys(HYBRID_TYPES, hybrid_state)}.get(fam, _llama_state)(model)
    result = hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
    params = {n for n, _ in hf.named_parameters()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if missing := [k for k in result.missing_keys if k in params and k not in tied]:
        raise RuntimeError(f"to_hf: no lmlab weight for {missing[:5]}")
    if result.unexpected_keys:
        raise RuntimeError(f"to_hf: transformers has no place for {result.unexpected_keys[:5]}")
    return hf.eval()


def from_hf(hf_model: Any) -> GPT:
    """An lmlab GPT computing what a transformers LlamaForCausalLM / GPT2LMHeadModel computes."""
    cfg = validate(lmlab_config(hf_model.config))
    fam = family(cfg)
    model = GPT(cfg)
    state = {k: v.detach().float() if v.is_floating_point() else v for k, v in hf_model.state_dict().items()}
    if fam == "deepseek_v3" and getattr(hf_model.config, "rope_interleave", False):
        for i in range(cfg.n_layer):
            _deinterleave(state, f"model.layers.{i}.", hf_model.config)
    model.load_state_dict(_invert(state, model, fam))
    return model.eval()


def export(run_dir: str | Path, out: str | Path) -> Path:
    """`eval.py run=<run> export=hf out=<dir>`: a save_pretrained directory (config.json, model.safetensors) with the
    run's tokenizer as a PreTrainedTokenizerFast, loadable by AutoModelForCausalLM / AutoTokenizer."""

    run, out = RunDir(run_dir), Path(out)
    saved = load_run(run.path, "run")
    hf = to_hf(saved.build())
    eod = (saved.config.get("data") or {}).get("eod")
    tokenizer = tokenizer_fast(run.tokenizer, eod=eod)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf.config, key, getattr(tokenizer, key, None))
        setattr(hf.generation_config, key, getattr(tokenizer, key, None))
    hf.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    readable_as_umask(out.glob("*.safetensors"))
    if tokenizer.eos_token is None:
        log.warning("%s was trained without an end-of-document token (data.eod), so the export has no eos, bos or pad "
                    "token: batched generate() needs an attention_mask (with pad_token_id=<id> alone, every prompt "
                    "token of that id is masked). Train with data.eod='<|endoftext|>' for one.", run.path)
    return out


def readable_as_umask(paths: Iterable[Path]) -> None:
    """Give `paths` the mode a plain open() gives a new file, 0666 less the umask: safetensors writes its files 0600
    whatever the umask (through a private temporary file), so colleagues on a shared file system could read the
    export's config.json but not its weights."""
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        path.chmod(0o666 & ~mask)


def tokenizer_fast(path: str | Path, eod: str | None = None) -> Any:
    """A run's tokenizer.json as a transformers PreTrainedTokenizerFast, its special tokens named: the run's
    end-of-document token (`data.eod`; a plain vocabulary entry of a char tokenizer, a special token of BPE) is eos
    and, as in GPT-2, bos and pad too, unless the vocabulary has tokens of its own for them. The ids are the run's
    (nothing is added: an id past the model's vocabulary would fail in the embedding)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(path))
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    if eod is not None and tok.token_to_id(eod) is not None:
        specials.add(eod)
    named = {}
    for key, candidates in (("eos_token", (eod, "<|endoftext|>", "</s>", "<eos>")), ("bos_token", ("<s>", "<bos>")),
                            ("unk_token", ("<unk>", "[UNK]")), ("pad_token", ("<pad>", "[PAD]"))):
        found = next((c for c in candidates if c in specials), None)
        if found:
            named[key] = found
    if "eos_token" in named:  # GPT-2's convention: one token ends a document, starts one, and pads
        named.setdefault("bos_token", named["eos_token"])
        named.setdefault("pad_token", named["eos_token"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named)


def is_hf_dir(path: str | Path) -> bool:
    """A save_pretrained directory (config.json and weights), not an lmlab run directory."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "checkpoints").exists()


def load_hf_dir(path: str | Path) -> tuple[GPT, Path]:
    """(lmlab GPT, tokenizer.json) of a transformers directory, read offline."""

    import transformers

    env.offline()
    path = Path(path)
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (lmlab reads fast tokenizers; save the tokenizer with "
                                f"save_pretrained)")

    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file)
    # The size from config.json before transformers builds anything (num_hidden_layers=200000 would build for hours).
    check_model_fits(lmlab_config(transformers.AutoConfig.from_pretrained(path)), what=f"{path}/config.json")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    # Strict: transformers fills a missing tensor with its random init and goes on (a score of a model that was never
    # trained); an unexpected one is a checkpoint of another architecture than config.json says.
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        found = "; ".join(f"{k.replace('_keys', '')}: {v[:5]}{' ...' if len(v) > 5 else ''}"
                          for k, v in problems.items() if v)
        raise ValueError(f"{path}: the weights do not match its config.json ({found}); lmlab loads every tensor of "
                         f"the architecture and nothing else (a missing one would be transformers' random init)")
    return from_hf(hf), tokenizer


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
HEADER_LIMIT = 100 << 20  # bytes of a safetensors header (safetensors' own limit)


def check_safetensors(path: Path) -> None:
    """A safetensors file's header, read as data before transformers loads it: valid JSON within its size, every
    tensor of a floating dtype (an integer tensor would be cast into the weights without a word). Refused naming the
    file and the tensor."""
    import json
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= min(HEADER_LIMIT, path.stat().st_size - 8):
            raise ValueError(f"{path}: not a safetensors file (its header's length {size} does not fit the file)")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"{path}: its safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not an object")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{path}: the tensor {name!r} is {dtype!r}; a model's weights are floats "
                             f"({', '.join(FLOAT_DTYPES)})")


def adopt(cfg: Any, arch: GPTConfig) -> None:
    """Make a composed config describe `arch` (a transformers checkpoint's architecture), keeping what a run may
    choose: the length it runs at (except for a learned table) and a RoPE scaling the user asked for."""
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        for key in ("n_layer", "d_model", "n_head", "n_kv_head", "bias", "tie_embeddings"):
            cfg.model[key] = getattr(arch, key)
        if arch.position["name"] == "learned":
            cfg.model.max_seq_len = arch.max_seq_len
        cfg.model.train_len = arch.train_len
        for group in ("block", "norm", "placement", "activation", "ffn", "position", "attention", "init", "residual",
                      "mixer"):
            cfg[group] = OmegaConf.create(dict(getattr(arch, group)))
        if cfg.rope_scaling.name == "none":
            cfg.rope_scaling = OmegaConf.create(dict(arch.rope_scaling))


def as_run(hf_dir: str | Path, run_dir: str | Path, data: dict[str, Any]) -> Path:
    """Write a transformers directory as an lmlab run directory (checkpoint, tokenizer, summary with its data
    config), so eval's length sweep, generate.py and lm-eval read it like any run: `eval.py hf=<dir>`."""

    model, tokenizer = load_hf_dir(hf_dir)
    run = RunDir(run_dir)
    (run.path / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
             "hyper_parameters": {"model": model.cfg.to_dict()}, "global_step": 0}
    torch.save(state, run.path / CHECKPOINTS / LAST)
    atomic_write(run.tokenizer, Path(tokenizer).read_bytes())
    run.write_summary({"status": "completed", "steps": 0, "imported_from": str(hf_dir), "model": model.cfg.to_dict(),
                       "config": {"data": {**data, "tokenizer": str(run.tokenizer)}, "seed": 0}, "overrides": []})
    return run.path
