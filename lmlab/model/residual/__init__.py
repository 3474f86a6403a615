"""How the blocks connect (the `residual` axis): the residual stream between layers and inside a block, beyond
`x_{l+1} = placement(x_l, sublayers)`. The placement still wires each sublayer into the stream; these options change
what the stream carries from layer to layer.

The group holds any number of options at once, each under its own name (`residual=unet`, or several:
`'residual=[value_residual,unet,scaled]'`, as the GPT-2 speedrun stacks them); `standard` is today's stream, no
option at all. Contract: `Option(cfg, **own params)`, an nn.Module built once per model, that may
- `attach(model)`: configure the blocks at build time through their three hooks (lmlab.model.placement: a branch
  transform with `block.add_transform`, an input transform with `block.add_input_transform`, a wiring with
  `block.set_wiring`) or a value mix on each attention, refusing by key what it cannot apply to;
- `embed(x, idx, cache, doc)`: change the token embeddings x (B, T, d) of tokens idx (B, T) before the embedding
  norm (a look-back on the previous token: smear), or compute from the tokens what it adds later (bigram_hash); the
  first hook of a forward. `cache`: the KVCache when generating, where what it needs of the previous forward's last
  token is kept (`cache.layers[0].inputs`, under its name); `doc`: every position's document number (B, offset + T),
  or None;
- `start(x0, idx)`: reset its per-forward state at the start of a forward (x0: the embedding output, idx: the tokens);
- `n_params(cfg, **own params)` (a classmethod, if it has weights of a size that matters): its weights from the sizes
  alone, for the size bounds;
- `before(i, x)` / `after(i, x)`: change the stream at the input of layer i / after it (re-injections, skips; after
  the last layer, L − 1, is the stream the final norm reads).
Each option's weights live in it (`residual.<name>.*` in the state dict); inits leave them at their constructors'
values. `Connections` runs the chosen options in the order they are named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.capabilities import RESIDUAL_HOOKS, Attaches, CountsParams
from lmlab.registry import gather, option_params

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import KVCache


class Standard(nn.Module):
    """The stream as the placement makes it: x_{l+1} = block_l(x_l). Nothing to do."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()


# every option but `standard` is a file of this package ending in its `OPTIONS` (a new option is its file, its YAML and
# its test)
RESIDUALS: dict[str, type[nn.Module]] = {"standard": Standard, **gather(__name__, __path__, "OPTIONS")}


def residual_specs(spec: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """The chosen options as (name, keyword arguments), checked against their signatures; the group is a mapping of
    option name -> its keys (`{}` for none)."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"residual={spec!r} must name its options, e.g. residual=unet or "
                         f"'residual=[value_residual,unet]'; choose among {sorted(RESIDUALS)}")
    out = []
    for name, params in spec.items():
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"residual.{name}={params!r} must be the option's keys (a mapping), e.g. "
                             f"residual.{name}={{}}")
        out.append(option_params("residual", RESIDUALS, {"name": name, **(params or {})}, keys=f"residual.{name}"))
    return out


class Connections(nn.Module):
    """The model's residual options, in order; `lmlab.model.gpt` calls `embed` on the token embeddings, then `start`,
    then `before` and `after` around every layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.options = nn.ModuleDict({name: RESIDUALS[name](cfg, **params)
                                      for name, params in residual_specs(cfg.residual)})
        self._hooks = {hook: [o for o in self.options.values() if isinstance(o, kind)]
                       for hook, kind in RESIDUAL_HOOKS.items()}

    def attach(self, model: nn.Module) -> None:
        for option in self.options.values():
            if isinstance(option, Attaches):
                option.attach(model)

    def embed(self, x: torch.Tensor, idx: torch.Tensor, cache: KVCache | None, doc: torch.Tensor | None
              ) -> torch.Tensor:
        for option in self._hooks["embed"]:
            x = option.embed(x, idx, cache, doc)
        return x

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        for option in self._hooks["start"]:
            option.start(x0, idx)

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        for option in self._hooks["before"]:
            x = option.before(i, x)
        return x

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        for option in self._hooks["after"]:
            x = option.after(i, x)
        return x


def residual_params(cfg: GPTConfig) -> int:
    """The weights the residual options add that matter for the size bounds (value embeddings' tables)."""
    return sum(RESIDUALS[name].n_params(cfg, **params) for name, params in residual_specs(cfg.residual)
               if isinstance(RESIDUALS[name], CountsParams))
