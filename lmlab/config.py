"""GPTConfig: the sizes and one spec per architecture axis, plus the sizes derived from them, declared and saved.

`arch_config(cfg)` gathers the flat Hydra groups (`cfg.model`, `cfg.norm`, `cfg.placement`, ...) into one
GPTConfig; that plain dict is what checkpoints and summaries store, so a run can be rebuilt without `conf/`.
The derived sizes (`DERIVED`: head size, key/value heads, the FFN's width, the attention geometry the position
scheme is built for, the KV cache's width) depend on the options' own rules, so `lmlab.model.resolve` works them out
once, from the option registries; they are then fields like any other, saved with the record and read back as they
are. This module sits below the model and imports none of it; `lmlab.model.gpt.validate` resolves a config and
builds the model on the meta device, so bad input fails before any data is loaded or any step is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from lmlab.registry import NonNegativeInt, PositiveFloat, PositiveInt, Range, check_value, check_values

ARCH_GROUPS = ("block", "norm", "placement", "activation", "ffn", "position", "rope_scaling", "attention", "init",
               "residual", "param", "head", "mixer")
COMPUTE_KEYS = ("checkpointing", "chunked_loss")  # how the model computes, not what it is: free to change on resume
GROUP_COMPUTE_KEYS = {"mixer": ("backend",)}  # the same within a group: mixer.backend (its kernel or PyTorch form)


def what_it_is(record: dict[str, Any]) -> dict[str, Any]:
    """A model record without its groups' compute keys (GROUP_COMPUTE_KEYS): what two records must share to be the
    same architecture."""
    return {k: {kk: vv for kk, vv in v.items() if kk not in GROUP_COMPUTE_KEYS[k]} if k in GROUP_COMPUTE_KEYS
            and isinstance(v, dict) else v for k, v in record.items()}
# Keys of the ffn group that GPTConfig turns into the hidden size (the FFN class never sees them), typed like an
# option's own keys.
# `hidden` sets the size itself, unmatched (a transformers config's intermediate_size).
FFN_SIZES = {"hidden_mult": PositiveFloat, "multiple_of": PositiveInt, "hidden": PositiveInt | None}
# What a `model.layers` entry takes: the group key it is written into (lmlab.model.layers resolves them) and its values.
LAYER_KEYS = {"mixer": ("mixer.pattern", "attention, the mixer's name, mixer or none"),
              "window": ("attention.pattern", "a window of >= 1 keys, local (attention.window), global or null"),
              "ffn": ("ffn.skip_layers", "true or false (false: no FFN)"),
              "nope": ("position.nope_layers", "true or false (true: no positions, the layer left unrotated)")}
LAYER_VALUES = {"mixer": lambda v: isinstance(v, str),
                "window": lambda v: v is None or v in ("local", "global") or (isinstance(v, int)
                                                                              and not isinstance(v, bool) and v >= 1),
                "ffn": lambda v: isinstance(v, bool), "nope": lambda v: isinstance(v, bool)}
# Keys of the ffn group that say which layers have an FFN (lmlab.model.block reads them; the FFN class never sees them).
FFN_LAYERS = {"skip_layers": Annotated[list[int], Range(ge=0)] | None}
# The derived sizes (lmlab.model.resolve fills them; None in a record written before December 2026: worked out then)
DERIVED = ("head_dim", "kv_heads", "ffn_hidden", "attn_heads", "attn_head_dim", "cache_width", "attn_width",
           "unused")
OPTIONAL_GROUPS = ("attention", "ffn")  # groups a block kind may not read (lmlab.model.block: each kind's `uses`)


@dataclass
class GPTConfig:
    vocab_size: PositiveInt
    vocab_pad: PositiveInt = 1  # the embedding's and head's rows rounded up to a multiple of this (a GPU's matmuls:
                                # 64 or 128); the extra rows' logits are left out of the loss, softmax and export
    n_layer: PositiveInt = 4
    d_model: PositiveInt = 128
    n_head: PositiveInt = 4
    n_kv_head: int | None = None  # key/value heads for attention=gqa (its range: a divisor of n_head, below)
    max_seq_len: PositiveInt = 128  # the length the model runs at (its learned table size, the RoPE scaling target)
    train_len: PositiveInt | None = None  # the length it was trained at (None: max_seq_len); differs after extension
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    bias: bool = False  # biases in every Linear (GPT-2: True)
    tie_embeddings: bool = True
    checkpointing: bool = False  # recompute each block's activations in backward: memory for ~1/3 more compute
    chunked_loss: bool = False  # LM head + loss in row blocks (lmlab.model.loss.linear_cross_entropy): no (tokens, V)
                                # logits
    logit_softcap: PositiveFloat | None = None  # the final logits z ← c·tanh((z + b) / w) (Gemma 2: w = c, b = 0)
    logit_softcap_width: PositiveFloat | None = None  # w (None: c); the speedrun's logit rescale: 15
    logit_softcap_offset: float = 0.0  # b; the speedrun's asymmetric logit rescale (record 54): 5
    untie_at_step: PositiveInt | None = None  # a tied head gets its own copy of the embedding at this step (speedrun)
    embed_norm: bool = False  # the norm group applied to the embedding output (the GPT-2 speedrun's; Gemma-style)
    embed_scale: PositiveFloat | Literal["sqrt_d"] | None = None  # the token embeddings × this (sqrt_d: √d_model,
                                                                # Gemma's; the DyT paper's LLaMA runs start it there)
    embed_scale_learned: bool = False  # that factor a learned scalar from its value (the DyT paper's LLaMA runs)
    eod_id: int | None = None  # the document separator (data.eod's id; data=token_bin: data.doc_sep) the documents
                               # are found by (doc masks)
    doc_sep_role: Literal["eod", "bos"] = "eod"  # eod_id ends each document (eod) or opens each (bos: token_bin's)
    block: dict = field(default_factory=lambda: {"name": "transformer"})
    norm: dict = field(default_factory=lambda: {"name": "rms"})
    placement: dict = field(default_factory=lambda: {"name": "pre"})
    activation: dict = field(default_factory=lambda: {"name": "gelu"})
    ffn: dict = field(default_factory=lambda: {"name": "mlp", "hidden_mult": 4, "multiple_of": 64})
    position: dict = field(default_factory=lambda: {"name": "rope"})
    rope_scaling: dict = field(default_factory=lambda: {"name": "none"})
    attention: dict = field(default_factory=lambda: {"name": "mha"})
    init: dict = field(default_factory=lambda: {"name": "gpt2"})
    residual: dict = field(default_factory=lambda: {"standard": {}})  # option name -> its keys (lmlab.model.residual)
    param: dict = field(default_factory=lambda: {"name": "sp"})  # the parametrisation (lmlab.model.param): sp, mup
    head: dict = field(default_factory=lambda: {"name": "next"})  # what is predicted (lmlab.model.head): next, mtp
    mixer: dict = field(default_factory=lambda: {"name": "attention"})  # each layer's token mixer (lmlab.model.mixer)
    # Each layer's overrides, cycled over n_layer (its length divides it): mixer, window, ffn, nope (LAYER_KEYS), the
    # general form of the groups' per-layer keys, written into them here (the record holds those; this None).
    layers: list[dict[str, Any]] | None = None
    # Derived (DERIVED), worked out by lmlab.model.resolve from the options; modules receive these final numbers.
    head_dim: int | None = None  # d_model / n_head
    kv_heads: int | None = None  # the key/value heads the attention option keeps (n_head, n_kv_head or 1)
    ffn_hidden: int | None = None  # the FFN's width, matched to the MLP's parameter count (lmlab.model.ffn)
    attn_heads: int | None = None  # the attention geometry the position scheme is built for: the block's heads
    attn_head_dim: int | None = None  # ... and their size (one head of key size s for GAU)
    cache_width: int | None = None  # numbers a layer's KV cache holds per token
    attn_width: int | None = None  # a layer's query/key width plus its value width: its scores' FLOPs (model.flops)
    unused: list[str] | None = None  # the groups the block does not read (block=gau: attention, ffn): not validated

    def __post_init__(self) -> None:
        types = _field_types()
        for f in dataclasses.fields(self):  # the sizes are `model.<key>`; the groups are named by themselves
            if f.name not in DERIVED:
                check_value(f.name if f.name in ARCH_GROUPS else f"model.{f.name}", getattr(self, f.name),
                            types[f.name])
        for group in ARCH_GROUPS:  # plain dicts, whatever mapping type came in (OmegaConf, a dataclass field, ...)
            setattr(self, group, dict(getattr(self, group)))
        if self.train_len is None:
            self.train_len = self.max_seq_len
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                             f"choose n_head among {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}")
        if self.layers is not None:
            self._spell_layers()
            self.layers = None  # the record holds the groups' keys: the model the same as their spelling builds

    def _spell_layers(self) -> None:
        """`layers` written as the groups' per-layer keys (LAYER_KEYS), which lmlab.model.layers resolves into each
        layer's record: each entry's key checked, the length dividing n_layer, and a group's key given as well
        refused, naming both."""
        entries = list(self.layers)
        if not entries or self.n_layer % len(entries):
            divisors = [n for n in range(1, self.n_layer + 1) if self.n_layer % n == 0]
            raise ValueError(f"model.layers has {len(entries)} entries, which does not divide model.n_layer="
                             f"{self.n_layer}: the entries are cycled over the layers; use a length among {divisors}")
        for i, entry in enumerate(entries):
            if unknown := sorted(set(entry) - set(LAYER_KEYS)):
                accepted = "; ".join(f"{k}: {what}" for k, (_, what) in LAYER_KEYS.items())
                raise ValueError(f"model.layers[{i}] has {unknown}: a layer's entry takes {accepted}")
            for key, value in entry.items():
                if not LAYER_VALUES[key](value):
                    raise ValueError(f"model.layers[{i}].{key}={value!r}: {key} is {LAYER_KEYS[key][1]}")
        given = [k for k in LAYER_KEYS if any(k in e for e in entries)]
        for key in given:
            group, sub = LAYER_KEYS[key][0].split(".")
            if (old := getattr(self, group).get(sub)) is not None:
                raise ValueError(f"model.layers gives each layer's {key}, and {LAYER_KEYS[key][0]}={old} does too: "
                                 f"give one of them (model.layers=[...] or {LAYER_KEYS[key][0]})")
        at = [entries[i % len(entries)] for i in range(self.n_layer)]
        if "mixer" in given:
            self.mixer["pattern"] = [e.get("mixer", self.mixer.get("name", "attention")) for e in entries]
        if "window" in given:  # an entry without one: attention.window (local), or the whole context
            rest = "global" if self.attention.get("window") is None else "local"
            self.attention["pattern"] = [rest if "window" not in e else "global" if e["window"] is None
                                         else e["window"] for e in entries]
        if "ffn" in given:
            self.ffn["skip_layers"] = [i for i, e in enumerate(at) if not e.get("ffn", True)] or None
        if "nope" in given:
            self.position["nope_layers"] = [i for i, e in enumerate(at) if e.get("nope", False)] or None

    @property
    def ffn_spec(self) -> dict[str, Any]:
        """The ffn group as its option takes it: without the sizing keys (FFN_SIZES), which give `ffn_hidden`, and the
        layers' (FFN_LAYERS), which the block kind reads."""
        return {k: v for k, v in self.ffn.items() if k not in FFN_SIZES and k not in FFN_LAYERS}

    @property
    def padded_vocab(self) -> int:
        """The embedding's and head's rows: vocab_size rounded up to a multiple of vocab_pad."""
        return -(-self.vocab_size // self.vocab_pad) * self.vocab_pad

    @property
    def resolved(self) -> bool:
        return all(getattr(self, name) is not None for name in DERIVED)

    def inputs(self) -> dict[str, Any]:
        """The record without its derived sizes: what a user chose (compared on resume and init_from)."""
        return {k: v for k, v in self.to_dict().items() if k not in DERIVED}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(GPTConfig, include_extras=True)


def arch_config(cfg: Mapping[str, Any], vocab_size: int | None = None, eod_id: int | None = None) -> GPTConfig:
    """The GPTConfig of a composed config: `cfg.model` sizes plus the architecture groups; `eod_id`, the tokenizer's
    end-of-document token (else data=token_bin's `data.doc_sep`), and `data.doc_sep_role`, whether it ends or opens
    each document, are recorded when documents matter to the model (attention.doc_mask, position.per_document)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    sizes = dict(plain["model"])
    if vocab_size is not None:
        sizes["vocab_size"] = vocab_size
    if sizes.get("vocab_size") is None:
        raise ValueError("model.vocab_size is unknown: it comes from the tokenizer (pass vocab_size=...)")
    from_data = {"eod_id", "doc_sep_role"}  # the documents: the data's, not model.* keys
    known = {f.name for f in dataclasses.fields(GPTConfig)} - set(ARCH_GROUPS) - set(DERIVED) - from_data
    if unknown := sorted(sizes.keys() - known):
        raise ValueError(f"model does not take {unknown}; it takes {sorted(known)}")
    if (plain.get("attention") or {}).get("doc_mask") or (plain.get("position") or {}).get("per_document"):
        data = plain.get("data") or {}  # data=token_bin's separator is an id of its config, ending or opening
        check_values("data.", data, {"doc_sep": NonNegativeInt | None, "doc_sep_role": Literal["eod", "bos"]})
        sizes["eod_id"] = data.get("doc_sep") if eod_id is None else eod_id
        sizes["doc_sep_role"] = data.get("doc_sep_role", "eod")
    return GPTConfig(**sizes, **{g: plain[g] for g in ARCH_GROUPS if g in plain})
