"""Attention-wide features as parts (`attention.qk_norm`, `gate`, `sinks`, `forget_gate`, `mem_kv`, `xsa`,
`key_offset`, `paired_heads`, the windows): what every attention option takes, each feature in its own file.

A part is a class ending its file in `PARTS` (a new attention-wide key is its part, one line of
conf/attention_base/shared.yaml and its test; nothing else to edit):
- its keys are its __init__'s keyword-only parameters, which every attention option takes (the registry reads them
  through the option's `PARTS`, lmlab.registry); it is on when one of them is not at its default (`always`: built
  whatever its keys, the windows);
- what it needs of the other keys is data, checked in one place (`check`) before anything is built: `requires`
  (another key -> the values it must take while this part is on, and why) and `excludes` (another key -> why it stays
  at its default while this part is on); what a part checks of its own keys it checks in its __init__;
- its __init__ builds its weights on the attention, under the names the state dict keeps (`attn.sink`,
  `attn.gate.weight`, ...), in `rank` order (the order of the parts' weights, which the seeded init draws in and an
  optimizer's saved state is indexed by; a new part builds last);
- it fills the hooks it needs (a hook it leaves as Part's is not called), each at one place of the attention's
  forward: `before_rotation` (q, k) -> (q, k); `rotation`, the position scheme's rotation in its place (one part at
  most); `after_rotation` k -> k (cache and documents in reach); `extras` -> attend's extra arguments (extra key
  columns: a sink logit, memory keys and values; a logit bias: the forget gate's sums); `select`, the keys each query
  reads by content (B, h, T, S) from q and k (a top-k block selection); `norm_key` (a key the parts
  make outside the projection, a memory key, as the tokens' keys are normed); `weighed` (the heads' outputs, reading
  the values they weighed); `output` (the heads' outputs, reading the sublayer's input); `attend` and
  `token_weights`, the attention itself in its place (one part at most); `scale_keys` (QK-clip's per-head rescaling
  of the keys it holds); `causal_only` (why the keys after a query have no form); `keys_read`, the most keys a query reads at a context of
  T (a window's W, a selection's k blocks), and `flops`, its forward FLOPs per token beyond the projections (a
  selection's scoring), which lmlab.model.flops counts;
- `n_params` and `cache_width` (classmethods): its weights and its numbers per token in the KV cache from the sizes
  and its keys alone (the size bounds, FLOPs and memory checks read them through the option's `geometry`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lmlab.registry import gather, option_defaults

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lmlab.config import GPTConfig


@dataclass(frozen=True)
class Widths:
    """An attention layer's sizes as a part's weights read them: query heads, the heads its keys and values are kept
    for (a memory key's: GQA's key/value heads, MLA's every head), a query/key head's and a value head's size."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int


class Part:
    """An attention-wide feature (the package's docstring): its keys, what it needs of the others, its hooks."""

    rank: ClassVar[float] = math.inf
    always: ClassVar[bool] = False
    requires: ClassVar[Mapping[str, tuple[tuple, str]]] = {}
    excludes: ClassVar[Mapping[str, str]] = {}
    takes_share: ClassVar[bool] = False  # its key columns take a share of each row, beside the tokens' weights
    here: bool = True  # whether it acts at this layer (a part on for some layers only: paired_heads=[0, 2])

    def __init__(self, attn: nn.Module, cfg: GPTConfig, **keys: Any) -> None:
        pass

    @classmethod
    def keys(cls) -> dict[str, Any]:
        """Its keys, each with its default."""
        return _keys(cls)

    @classmethod
    def on(cls, given: Mapping[str, Any]) -> bool:
        return cls.always or any(given[key] != default for key, default in cls.keys().items())

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return 0

    @classmethod
    def cache_width(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return 0

    def before_rotation(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def rotation(self, attn: nn.Module, pos: Any, q: torch.Tensor, k: torch.Tensor, offset: int,
                 doc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def after_rotation(self, attn: nn.Module, k: torch.Tensor, pos: Any, offset: int, doc: torch.Tensor | None,
                       cache: Any) -> torch.Tensor:
        return k

    def norm_key(self, attn: nn.Module, k: torch.Tensor) -> torch.Tensor:
        return k

    def extras(self, attn: nn.Module, x: torch.Tensor, cache: Any) -> dict[str, Any]:
        return {}

    def select(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, offset: int,
               docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        raise NotImplementedError

    def weighed(self, attn: nn.Module, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return y

    def output(self, attn: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y

    def attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pos: Any,
               offset: int, docs: Any) -> torch.Tensor:
        raise NotImplementedError

    def token_weights(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, pos: Any, doc: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def scale_keys(self, attn: nn.Module, rows: torch.Tensor) -> None:
        pass

    def causal_only(self, attn: nn.Module) -> str | None:
        return None

    def keys_read(self, attn: nn.Module, seq_len: int) -> int | None:
        return None

    def flops(self, attn: nn.Module, seq_len: int) -> int:
        return 0


@functools.cache
def _keys(part: type[Part]) -> dict[str, Any]:
    return option_defaults(part)


HOOKS = ("before_rotation", "rotation", "after_rotation", "norm_key", "extras", "select", "weighed", "output",
         "attend", "token_weights", "scale_keys", "causal_only", "keys_read", "flops")
ONE_AT_MOST = ("rotation", "attend", "token_weights")  # hooks that replace the attention's own step


def fills(part: type[Part], hook: str) -> bool:
    """Whether a part fills a hook (defines it, not Part's)."""
    return getattr(part, hook) is not getattr(Part, hook)

# every part is a file of this package ending in its `PARTS`, built in `rank` order
PARTS: dict[str, type[Part]] = dict(sorted(gather(__name__, __path__, "PARTS").items(), key=lambda kv: kv[1].rank))


def part_keys() -> dict[str, Any]:
    """Every part's keys, each with its default."""
    return {key: default for part in PARTS.values() for key, default in part.keys().items()}


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def check(given: Mapping[str, Any]) -> None:
    """Refuse, naming the keys, a part on while a key it `requires` is not one of its values or a key it `excludes`
    is not at its default. `given`: every key of the option, the parts' and its own."""
    defaults = part_keys()
    for part in PARTS.values():
        if part.always or not part.on(given):
            continue
        key = next(k for k, d in part.keys().items() if given[k] != d)
        shown = f"attention.{key}={_show(given[key])}"
        for other, (allowed, why) in part.requires.items():
            if given[other] not in allowed:
                raise ValueError(f"{shown} needs attention.{other}={'|'.join(map(_show, allowed))} (got "
                                 f"{given[other]!r}): {why}")
        for other, why in part.excludes.items():
            if given[other] != defaults.get(other, given[other]):
                raise ValueError(f"{shown} with attention.{other}={_show(given[other])}: {why}")


class Parts:
    """The parts on at one attention layer, in `rank` order, and for each hook the parts that fill it."""

    def __init__(self, attn: nn.Module, cfg: GPTConfig, given: Mapping[str, Any]) -> None:
        runs = type(attn).runs_hooks
        for name, part in PARTS.items():
            if part.on(given) and (skipped := [h for h in HOOKS if fills(part, h) and h not in runs]):
                key = next((k for k, d in part.keys().items() if given[k] != d), name)
                raise ValueError(f"attention.{key}={_show(given[key])} acts through the attention's {skipped[0]}, "
                                 f"which {type(attn).__name__} computes its own way: it has no form there; leave it "
                                 f"at its default")
        built = [part(attn, cfg, **{k: given[k] for k in part.keys()}) for part in PARTS.values() if part.on(given)]
        self.on = [p for p in built if p.here]
        self.names = tuple(name for name, part in PARTS.items() if any(type(p) is part for p in self.on))
        self.hooks = {hook: [p for p in self.on if fills(type(p), hook)] for hook in HOOKS}
        self.takes_share = any(p.takes_share for p in self.on)
        for hook in ONE_AT_MOST:
            if len(self.hooks[hook]) > 1:
                raise ValueError(f"{' and '.join(type(p).__name__ for p in self.hooks[hook])} both replace the "
                                 f"attention's {hook}; turn one of them off")
        self.replaces = {hook: self.hooks[hook][0] for hook in ONE_AT_MOST if self.hooks[hook]}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def before_rotation(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for p in self.hooks["before_rotation"]:
            q, k = p.before_rotation(attn, q, k)
        return q, k

    def rotate(self, attn: nn.Module, pos: Any, q: torch.Tensor, k: torch.Tensor, offset: int,
               doc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if (p := self.replaces.get("rotation")) is not None:
            return p.rotation(attn, pos, q, k, offset, doc)
        return pos.rotate(q, k, offset, doc, attn.layer)

    def after_rotation(self, attn: nn.Module, k: torch.Tensor, pos: Any, offset: int, doc: torch.Tensor | None,
                       cache: Any) -> torch.Tensor:
        for p in self.hooks["after_rotation"]:
            k = p.after_rotation(attn, k, pos, offset, doc, cache)
        return k

    def norm_key(self, attn: nn.Module, k: torch.Tensor) -> torch.Tensor:
        for p in self.hooks["norm_key"]:
            k = p.norm_key(attn, k)
        return k

    def extras(self, attn: nn.Module, x: torch.Tensor, cache: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.hooks["extras"]:
            out.update(p.extras(attn, x, cache))
        return out

    def select(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, offset: int,
               docs: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """attend's `select`: the keys every part that selects by content keeps (B, h, T, S), or nothing; `docs`:
        the queries' and the keys' document numbers under attention.doc_mask."""
        masks = [p.select(attn, q, k, offset, docs) for p in self.hooks["select"]]
        if not masks:
            return {}
        out = masks[0]
        for mask in masks[1:]:
            out = out & mask
        return {"select": out}

    def weighed(self, attn: nn.Module, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for p in self.hooks["weighed"]:
            y = p.weighed(attn, y, v)
        return y

    def output(self, attn: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for p in self.hooks["output"]:
            y = p.output(attn, y, x)
        return y

    def scale_keys(self, attn: nn.Module, rows: torch.Tensor) -> None:
        for p in self.hooks["scale_keys"]:
            p.scale_keys(attn, rows)

    def causal_only(self, attn: nn.Module) -> str | None:
        return next(filter(None, (p.causal_only(attn) for p in self.hooks["causal_only"])), None)

    def keys_read(self, attn: nn.Module, seq_len: int) -> int:
        """The most keys a query reads at a context of `seq_len`: the fewest any part allows."""
        return min([seq_len, *filter(None, (p.keys_read(attn, seq_len) for p in self.hooks["keys_read"]))])

    def flops(self, attn: nn.Module, seq_len: int) -> int:
        return sum(p.flops(attn, seq_len) for p in self.hooks["flops"])


def parts_geometry(cfg: GPTConfig, widths: Widths, params: Mapping[str, Any]) -> tuple[int, int]:
    """The weights and the KV cache's numbers per token the parts on under `params` (an option's spec, its unset keys
    at their defaults) add to a layer."""
    given = {**part_keys(), **params}
    n = cache = 0
    for part in PARTS.values():
        if part.on(given):
            own = {k: given[k] for k in part.keys()}
            n += part.n_params(cfg, widths, **own)
            cache += part.cache_width(cfg, widths, **own)
    return n, cache
