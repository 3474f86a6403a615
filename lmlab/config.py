"""GPTConfig: the sizes and one spec per architecture axis, with every derived size worked out once.

`arch_config(cfg)` gathers the flat Hydra groups (`cfg.model`, `cfg.norm`, `cfg.placement`, ...) into one
GPTConfig; that plain dict is what checkpoints and summaries store, so a run can be rebuilt without `conf/`.
`validate()` resolves every name and key and builds the model on the meta device, so bad input fails before
any data is loaded or any step is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from lmlab.registry import PositiveFloat, PositiveInt, Range, build, check_value, check_values, option_params

ARCH_GROUPS = ("block", "norm", "placement", "activation", "ffn", "position", "rope_scaling", "attention", "init")
COMPUTE_KEYS = ("checkpointing", "chunked_loss")  # how the model computes, not what it is: free to change on resume
# Keys of the ffn group that GPTConfig turns into the hidden size (the FFN class never sees them), typed like an
# option's own keys.
# `hidden` sets the size itself, unmatched (a transformers config's intermediate_size).
FFN_SIZES = {"hidden_mult": PositiveFloat, "multiple_of": PositiveInt, "hidden": PositiveInt | None}


@dataclass
class GPTConfig:
    vocab_size: PositiveInt
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
    chunked_loss: bool = False  # LM head + loss in row blocks (lmlab.loss.linear_cross_entropy): no (tokens, V) logits
    block: dict = field(default_factory=lambda: {"name": "transformer"})
    norm: dict = field(default_factory=lambda: {"name": "rms"})
    placement: dict = field(default_factory=lambda: {"name": "pre"})
    activation: dict = field(default_factory=lambda: {"name": "gelu"})
    ffn: dict = field(default_factory=lambda: {"name": "mlp", "hidden_mult": 4, "multiple_of": 64})
    position: dict = field(default_factory=lambda: {"name": "rope"})
    rope_scaling: dict = field(default_factory=lambda: {"name": "none"})
    attention: dict = field(default_factory=lambda: {"name": "mha"})
    init: dict = field(default_factory=lambda: {"name": "gpt2"})

    def __post_init__(self) -> None:
        from lmlab.model.attention import ATTENTIONS
        from lmlab.model.block import BLOCKS
        from lmlab.model.ffn import FFNS, matched_hidden

        types = _field_types()
        for f in dataclasses.fields(self):  # the sizes are `model.<key>`; the groups are named by themselves
            check_value(f.name if f.name in ARCH_GROUPS else f"model.{f.name}", getattr(self, f.name), types[f.name])
        for group in ARCH_GROUPS:  # plain dicts, whatever mapping type came in (OmegaConf, a dataclass field, ...)
            setattr(self, group, dict(getattr(self, group)))
        if self.train_len is None:
            self.train_len = self.max_seq_len
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                             f"choose n_head among {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}")
        self.head_dim = self.d_model // self.n_head

        attn_name, _ = option_params("attention", ATTENTIONS, self.attention)
        self.kv_heads = ATTENTIONS[attn_name].kv_heads(self.n_head, self.n_kv_head)
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            divisors = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(f"model.n_kv_head={self.kv_heads} must divide model.n_head={self.n_head} (attention="
                             f"{attn_name}); choose among {divisors}")

        # The FFN's hidden size: the MLP's is hidden_mult · d_model rounded to multiple_of; every option is sized to
        # the MLP's parameter count within 1% (lmlab.model.ffn.matched_hidden), unless ffn.hidden sets it.
        check_values("ffn.", self.ffn, FFN_SIZES)  # hidden_mult=0 would otherwise round up to one multiple_of
        self.ffn_spec = {k: v for k, v in self.ffn.items() if k not in FFN_SIZES}
        ffn_name, _ = option_params("ffn", FFNS, self.ffn_spec)
        multiple_of = self.ffn.get("multiple_of", 64)
        mlp_hidden = max(multiple_of, multiple_of * round(self.ffn.get("hidden_mult", 4) * self.d_model / multiple_of))
        self.ffn_hidden = self.ffn.get("hidden") or matched_hidden(FFNS[ffn_name], self.d_model, mlp_hidden,
                                                                    self.bias, multiple_of)

        # The attention geometry the position scheme is built for: (n_head, head_dim), or one head of GAU's key size.
        kind = build("block", BLOCKS, self.block, self)
        self.attn_heads, self.attn_head_dim, self.cache_width = kind.heads, kind.head_dim, kind.cache_width
        # Weights from the sizes alone (the blocks' and the embeddings'; norms, gains and position tables aside): what
        # the size bound reads before a model is built, even on the meta device (lmlab.memory.check_model_fits).
        self.n_params_estimate = kind.n_params() * self.n_layer + self.vocab_size * self.d_model * (
            1 if self.tie_embeddings else 2)

    def validate(self) -> GPTConfig:
        """Resolve every option and build the model on the meta device; raise ValueError naming the bad key."""
        import torch

        from lmlab.memory import check_model_fits
        from lmlab.model.gpt import GPT
        from lmlab.model.position import POSITIONS

        pos_name, _ = option_params("position", POSITIONS, self.position)
        if self.rope_scaling.get("name", "none") != "none" and not POSITIONS[pos_name].accepts_scaling:
            raise ValueError(f"rope_scaling={self.rope_scaling['name']!r} needs position=rope (got position="
                             f"{pos_name!r}); use rope_scaling=none with this scheme")
        check_model_fits(self)  # before the meta build, which itself holds tens of kB of Python objects per layer
        with torch.device("meta"):
            GPT(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(GPTConfig, include_extras=True)


def arch_config(cfg: Mapping[str, Any], vocab_size: int | None = None) -> GPTConfig:
    """The GPTConfig of a composed config: `cfg.model` sizes plus the architecture groups."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    sizes = dict(plain["model"])
    if vocab_size is not None:
        sizes["vocab_size"] = vocab_size
    if sizes.get("vocab_size") is None:
        raise ValueError("model.vocab_size is unknown: it comes from the tokenizer (pass vocab_size=...)")
    known = {f.name for f in dataclasses.fields(GPTConfig)} - set(ARCH_GROUPS)
    if unknown := sorted(sizes.keys() - known):
        raise ValueError(f"model does not take {unknown}; it takes {sorted(known)}")
    return GPTConfig(**sizes, **{g: plain[g] for g in ARCH_GROUPS if g in plain})
