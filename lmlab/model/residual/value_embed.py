"""`residual=value_embed`: extra token-embedding tables added to the attention values of chosen layers (the GPT-2
speedrun's value embeddings): v_l ← λ_l·v_l + μ_l·E_t(idx) with table t of width n_kv_head·head_dim, λ and μ learned
per layer (init 0.5 each, the speedrun's). `tables` tables are shared the speedrun's way, U-net-like: layer i and layer
L − tables + i use table i (the first and the last `tables` layers; a layer in both reads the same table once);
`layers` names the layers instead (table i for the i-th entry: a layer, or a list of layers that share it — the
speedrun's record 15 mirrors them, [[0, 11], [1, 10], [2, 9]]). Each table adds vocab·n_kv_head·head_dim weights,
counted in `n_params`. Needs attention whose values are computed per token before they are cached (refused for
attention=mla and block=gau). A layer of the layout without attention (mixer.pattern: `none`, a recurrent mixer) reads
no table, as in the speedrun's record 35, whose first layer lost its attention and table 0 served layer L − 3 alone; a
table left with no layer, or a layer named in `layers` without attention, is refused.

`gate_channels=k` > 0 is the speedrun's gated form (record 55, "gates on value embeds"): v_l ← v_l + 2σ(W_l·x_{:k})·E,
a gate per key/value head read from the first k channels of the attention's input x (the record's 12), W_l from zero
(a gate of 1 at init), in place of the two scalars; W_l is a matrix of no Linear, so under optim=muon it steps with
AdamW (the record moved its gates to Adam, record 56)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.layers import layer_plan
from lmlab.model.mixer import ATTENTION, layer_types
from lmlab.registry import NonNegativeInt, PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class _Tokens:
    """This forward's token ids, shared by the layers' mixes (not a module)."""

    idx: torch.Tensor | None = None


class ValueEmbedMix(nn.Module):
    def __init__(self, table: nn.Embedding, tokens: _Tokens, kv_heads: int, gate_channels: int = 0) -> None:
        super().__init__()
        self.table = [table]  # the owner's table, not registered twice
        self.tokens = tokens
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5])) if not gate_channels else None
        self.gate = nn.Parameter(torch.zeros(kv_heads, gate_channels)) if gate_channels else None  # W: (nkv, k)

    def forward(self, v: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:  # v (B, nkv, T, hs), x (B, T, d)
        B, nkv, T, hs = v.shape
        ve = self.table[0](self.tokens.idx).view(B, T, nkv, hs).transpose(1, 2).to(v.dtype)
        if self.gate is not None:  # 2σ(W·x_{:k}) per head: (B, T, nkv) -> (B, nkv, T, 1)
            g = 2 * torch.sigmoid(F.linear(x[..., :self.gate.size(1)], self.gate.to(x.dtype)))
            return v + g.transpose(1, 2).unsqueeze(-1).to(v.dtype) * ve
        lam = self.lambdas.to(v.dtype)
        return lam[0] * v + lam[1] * ve


class ValueEmbed(nn.Module):
    def __init__(self, cfg: GPTConfig, *, tables: PositiveInt = 3, layers: list[int | list[int]] | None = None,
                 gate_channels: NonNegativeInt = 0) -> None:
        super().__init__()
        if gate_channels > cfg.d_model:
            raise ValueError(f"residual.value_embed.gate_channels={gate_channels} is more than model.d_model="
                             f"{cfg.d_model}: the gate reads the first k channels of the attention's input")
        self.gate_channels, self.kv_heads = gate_channels, cfg.kv_heads
        if cfg.block.get("name", "transformer") != "transformer":
            raise ValueError(f"residual=value_embed adds to attention values: it needs block=transformer (got "
                             f"block={cfg.block['name']!r})")
        if cfg.attention.get("name") == "mla":
            raise ValueError("residual=value_embed with attention=mla: MLA caches a latent, not values; use "
                             "attention=mha|gqa|mqa|diff")
        self.layer_tables = {layer.index: layer.value_embed for layer in layer_plan(cfg)
                             if layer.value_embed is not None}  # the layer plan's (lmlab.model.layers): `attending`
        n_tables = max(self.layer_tables.values()) + 1
        self.tables = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.kv_heads * cfg.head_dim) for _ in range(n_tables))
        self.tokens = _Tokens()

    @staticmethod
    def assignment(n_layer: int, tables: int, layers: list[int] | None) -> dict[int, int]:
        """layer -> the table it reads."""
        if layers is not None:
            entries = [[e] if isinstance(e, int) else list(e) for e in layers]
            flat = [i for e in entries for i in e]
            if bad := [i for i in flat if not 0 <= i < n_layer]:
                raise ValueError(f"residual.value_embed.layers has {bad}, not layers of the model (0 .. {n_layer - 1})")
            if twice := sorted({i for i in flat if flat.count(i) > 1}):
                raise ValueError(f"residual.value_embed.layers names layer {twice} twice: a layer reads one table")
            return {i: t for t, e in enumerate(entries) for i in e}
        if tables > n_layer:
            raise ValueError(f"residual.value_embed.tables={tables} is more than model.n_layer={n_layer}: each table "
                             f"serves the first and the last `tables` layers")
        out = {n_layer - tables + t: t for t in range(tables)}
        out.update({t: t for t in range(tables)})
        return out

    @classmethod
    def attending(cls, cfg: GPTConfig, tables: int, layers: list[int] | None,
                  mixers: Sequence[str] | None = None) -> dict[int, int]:
        """The assignment without the layers that have no attention (no values to add to, by `mixers`, each layer's
        mixer: the layer plan's); refused when it names such a layer (`layers`) or leaves a table unread."""
        out = cls.assignment(cfg.n_layer, tables, layers)
        types = layer_types(cfg) if mixers is None else mixers
        if layers is not None and (bad := [i for i in out if types[i] != ATTENTION]):
            raise ValueError(f"residual.value_embed.layers={list(layers)} has {bad}, layers without attention in "
                             f"mixer.pattern={cfg.mixer.get('pattern')}: name attention layers only")
        kept = {i: t for i, t in out.items() if types[i] == ATTENTION}
        if unread := sorted(set(out.values()) - set(kept.values())):
            raise ValueError(f"residual.value_embed.tables={tables}: table {unread} would serve only layers without "
                             f"attention ({sorted(i for i in out if i not in kept)} in mixer.pattern="
                             f"{cfg.mixer.get('pattern')}); use fewer tables, or name attention layers in "
                             f"residual.value_embed.layers")
        return kept

    @classmethod
    def n_params(cls, cfg: GPTConfig, *, tables: int = 3, layers: list[int] | None = None,
                 gate_channels: int = 0) -> int:
        n_tables = len(layers) if layers is not None else tables
        per_layer = cfg.kv_heads * gate_channels if gate_channels else 2  # the gate's W, or λ and μ
        return n_tables * cfg.vocab_size * cfg.kv_heads * cfg.head_dim + per_layer * len(cls.attending(cfg, tables,
                                                                                                        layers))

    def attach(self, model: nn.Module) -> None:
        for i, t in sorted(self.layer_tables.items()):
            model.h[i].attn.value_mixes.append(ValueEmbedMix(self.tables[t], self.tokens, self.kv_heads,
                                                             self.gate_channels))

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        self.tokens.idx = idx


OPTIONS = {"value_embed": ValueEmbed}
