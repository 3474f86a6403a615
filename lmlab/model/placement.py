"""Where the norms sit around each sublayer (the residual wiring).

Contract: a `Block(cfg, layer_idx)` subclass with its own `branch(x, f, j)` (what sublayer j adds to the stream: x +
branch; `additive`) or, for a placement that normalises the sum, its own `sublayer(x, f, j)`: how sublayer j (1-based,
`f` already bound to the position scheme and KV cache) and its norm `ln_j` (and `ln_j_post`) enter the residual
stream. The residual options (lmlab.model.residual) change a block through one hook each, at build time: a
*branch transform* (`add_transform`: a module `t(j, y)` on each sublayer's branch — a learned scale, a dropped layer),
an *input transform* (`add_input_transform`: a module `t(j, h, cache, doc)` on what each sublayer reads — a canon
layer) or the block's *wiring* (`set_wiring`: an object whose `wire(block, x, fs)` applies the sublayers `fs` to the
stream — in turn by default, summed from one input, over n copies of the stream). The
`block` group supplies the sublayers (attention + FFN, or one GAU); `Block.forward(x, pos, cache=None)` applies the
placement to each in turn, so every placement works with every block. Each placement says on itself whether the
model needs a final norm before the LM head (`final_norm`) and what gain the DeepNet init applies to its value/output
weights (`init_gain`). N = norm, F = a sublayer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.block import BLOCKS
from lmlab.model.capabilities import TokenMixer
from lmlab.model.norm import NORMS
from lmlab.registry import build

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache
    from lmlab.model.position import Position

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class Sequential:
    """The default wiring: each sublayer in turn, x ← x + t(branch_j(x)) (its own rule for a placement that
    normalises the sum)."""

    def wire(self, block: Block, x: torch.Tensor, fs: list[tuple[int, Sublayer]]) -> torch.Tensor:
        for j, f in fs:
            x = block.step(x, f, j)
        return x


SEQUENTIAL = Sequential()


class Block(nn.Module):
    final_norm = True  # the residual stream is unnormalised at the top: norm it before the head
    post_norms = False  # a second norm on each sublayer's output (double placement)
    additive = True  # sublayer(x, f, j) = x + branch(x, f, j): the stream plus a branch (not a norm of the sum)

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        sublayers = build("block", BLOCKS, cfg.block, cfg).sublayers(layer_idx)
        self.sublayer_names = tuple(sublayers)  # attribute names, in order (transformer: attn, mlp)
        for j, (name, module) in enumerate(sublayers.items(), 1):
            setattr(self, f"ln_{j}", build("norm", NORMS, cfg.norm, cfg.d_model))
            setattr(self, name, module)
        if self.post_norms:
            for j in range(1, len(sublayers) + 1):
                setattr(self, f"ln_{j}_post", build("norm", NORMS, cfg.norm, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.transforms: tuple[str, ...] = ()  # the branch transforms' attribute names, applied in this order
        self.input_transforms: tuple[str, ...] = ()  # the input transforms' attribute names, applied in this order
        self.wiring: str | None = None  # the wiring's attribute name (None: the sublayers in turn, SEQUENTIAL)

    @staticmethod
    def init_gain(n_layer: int) -> float:
        return 1.0

    def add_transform(self, name: str, transform: nn.Module) -> None:
        """A residual option's change to every branch of this block: `transform(j, y)` on sublayer j's branch (on F(x)
        inside the norm, for a placement that normalises the sum). Its weights are `h.<i>.<name>.*`."""
        setattr(self, name, transform)
        self.transforms = (*self.transforms, name)

    def add_input_transform(self, name: str, transform: nn.Module) -> None:
        """A residual option's change to what every sublayer of this block reads: `transform(j, h, cache, doc)` on
        sublayer j's input h (after its norm, under the placements that norm the input), `cache` this layer's
        LayerCache when generating (None otherwise; what the transform keeps between forwards goes in its `inputs`)
        and `doc` the document numbers (or None), for a transform that reads along the sequence. Its weights are
        `h.<i>.<name>.*`."""
        setattr(self, name, transform)
        self.input_transforms = (*self.input_transforms, name)

    def set_wiring(self, name: str, wiring: Any, option: str) -> None:
        """A residual option's way of applying the sublayers to the stream (`wiring.wire(block, x, fs)`); one per
        block. Its weights, if any, are `h.<i>.<name>.*`."""
        if self.wiring is not None:
            raise ValueError(f"residual={option} rewires each block, and another residual option already does: "
                             f"choose one of them")
        setattr(self, name, wiring)
        self.wiring = name

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        fs = []
        for j, name in enumerate(self.sublayer_names, 1):
            module = getattr(self, name)
            f = partial(module, pos=pos, cache=cache, doc=doc) if isinstance(module, TokenMixer) else module
            fs.append((j, partial(self._fed, f, j, cache, doc) if self.input_transforms else f))
        return (SEQUENTIAL if self.wiring is None else getattr(self, self.wiring)).wire(self, x, fs)

    def _fed(self, f: Sublayer, j: int, cache: LayerCache | None, doc: torch.Tensor | None,
             h: torch.Tensor) -> torch.Tensor:
        """Sublayer j applied to its input h through the residual options' input transforms, in order."""
        for name in self.input_transforms:
            h = getattr(self, name)(j, h, cache, doc)
        return f(h)

    def transform(self, j: int, y: torch.Tensor) -> torch.Tensor:
        """Sublayer j's branch `y` through the residual options' transforms, in order."""
        for name in self.transforms:
            y = getattr(self, name)(j, y)
        return y

    def step(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        """Sublayer j applied to the stream x, its branch transformed: x + t(branch) for the additive placements;
        for the others the transform goes inside their rule, on F(x)."""
        if self.additive:
            return x + self.transform(j, self.branch(x, f, j))
        return self.sublayer(x, partial(self._transformed, f, j) if self.transforms else f, j)

    def _transformed(self, f: Sublayer, j: int, h: torch.Tensor) -> torch.Tensor:
        return self.transform(j, f(h))

    def branch(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        """What sublayer j adds to the stream (the additive placements)."""
        raise NotImplementedError

    def sublayer(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        """Sublayer j wired into the stream: x + branch for the additive placements, their own rule otherwise."""
        return x + self.branch(x, f, j)

    def norm(self, j: int, post: bool = False) -> nn.Module:
        return getattr(self, f"ln_{j}_post" if post else f"ln_{j}")


class PreNorm(Block):
    """Pre-LN (Xiong et al., 2020; GPT-2): x + F(N(x)). Gradients reach every layer through the identity path."""

    def branch(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        return self.drop(f(self.norm(j)(x)))


class PostNorm(Block):
    """Post-LN (Vaswani et al., 2017): N(x + F(x)). Large last-layer gradients at init; needs warmup."""

    final_norm = False
    additive = False

    def sublayer(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        return self.norm(j)(x + self.drop(f(x)))


class DoubleNorm(Block):
    """Sandwich / double norm (Ding et al., 2021, CogView; Gemma 2): x + N(F(N(x)))."""

    post_norms = True

    def branch(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        return self.drop(self.norm(j, post=True)(f(self.norm(j)(x))))


class PostNormNonResidual(Block):
    """Post-norm on the branch only: x + N(F(x)) (the 'non-residual post-norm' of the source notes; Swin v2's
    res-post-norm). The identity path stays unnormalised, so the stream grows and a final norm is needed."""

    def branch(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        return self.drop(self.norm(j)(f(x)))


class DeepNorm(Block):
    """DeepNorm (Wang et al., 2022, DeepNet): N(α·x + F(x)), with α = (2L)^(1/4) and the value/output/FFN
    weights initialised with gain β = (8L)^(-1/4) — the decoder-only constants (L = number of layers)."""

    final_norm = False
    additive = False

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.alpha = (2 * cfg.n_layer) ** 0.25

    @staticmethod
    def init_gain(n_layer: int) -> float:
        return (8 * n_layer) ** -0.25

    def sublayer(self, x: torch.Tensor, f: Sublayer, j: int) -> torch.Tensor:
        return self.norm(j)(self.alpha * x + self.drop(f(x)))


PLACEMENTS = {"pre": PreNorm, "post": PostNorm, "double": DoubleNorm, "post_nonres": PostNormNonResidual,
              "deepnorm": DeepNorm}
