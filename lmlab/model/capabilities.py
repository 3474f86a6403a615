"""What the model's parts offer to shared code, listed in one place as types: read by an isinstance check on a
protocol, or as a declared attribute with its default, never by probing for an attribute's name.

- `TokenMixer`: a sublayer the block calls as `(x, pos=, cache=, doc=)` (attention, a recurrent mixer, GAU);
  `SequenceMixer` the contract attention and the recurrent mixers share (geometry, cache, causal-only, FLOPs), with
  `AttentionWeights` (softmax attention's figures: its weights) and `RecurrentMixer` (the mixers' figures and backend)
  beside it;
- `Sublayer`: a block's sublayer with its name in the monitor's figures (`sublayer`; `sublayer_name` reads it);
- `ReadsPositions`: a layer the position scheme reaches (attention, GAU);
- `SideChannel`: a sublayer that records terms of the side channel (lmlab.model.side: an MoE's balancing losses);
  `Routes`: one that routes tokens (an MoE's routing statistics, the monitor's figures);
- `FollowsStep` (lmlab.model.steps) and `StepFollower`: modules whose state follows the training step;
- `FitsVocabulary`, `SizedAs`, `UpdatesBias`: option classes that take the tokenizer, size their experts as another
  kind, update a routing bias after each step;
- `NamesParams`: a head whose own weights the monitor names other than `mtp` (head=classify's);
- `MakesModel`, `ChecksRun`: a norm option that makes the model around it and refuses training-loop settings
  (norm=ngpt);
- the residual options' hooks (`Embeds`, `Starts`, `Before`, `After`, `Attaches`, `CountsParams`);
- from lmlab.optim.capabilities, below the model (the optimizers read them too): the Linear layers' marks (`Marks`,
  set with `mark`, read with `marks`: `fused`, `value_parts`, `head_rows`, `is_residual_proj`, `is_readout`,
  `n_experts`), `Decays` and `ClipsLogits`; beside them what an optimizer option declares (`capabilities(option)`)
  and what a built optimizer offers the loop (`FollowsHorizon`, `WarmupOnly`, `EvalWeights`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lmlab.model.steps import FollowsStep
from lmlab.optim.capabilities import ClipsLogits, Decays, Marks, mark, marks

if TYPE_CHECKING:
    import torch

    from lmlab.model.side import Term


@runtime_checkable
class TokenMixer(Protocol):
    """A sublayer that reads other tokens: the block calls it as `(x, pos=, cache=, doc=)` (the others as `(x)`)."""

    mixes_tokens: bool

    def forward(self, x: torch.Tensor, pos: Any = None, cache: Any = None, doc: torch.Tensor | None = None
                ) -> torch.Tensor: ...


@runtime_checkable
class ScaledLogits(TokenMixer, Protocol):
    """A token mixer whose logits carry a scale (attention's 1/√d·temperature), which param=mup's attention
    multiplier rescales."""

    scale: float


@runtime_checkable
class SequenceMixer(TokenMixer, Protocol):
    """What softmax attention (lmlab.model.attention: MHA and its variants) and the recurrent mixers
    (lmlab.model.mixer) share, as OLMo-core's SequenceMixer and fla's layers do:

    - `sublayer`: its name in the monitor's figures (`attn`, `mix`);
    - `geometry(cfg, **keys)` (a classmethod): the layer from its sizes and keys alone, nothing built — its weights,
      what its cache holds per token (attention's `Geometry.cache_width`) or per sequence (a mixer's
      `MixerGeometry.state_numbers`), the FLOPs beyond its matmuls; read by the size bounds, FLOPs and memory;
    - `forward(x, pos=, cache=, doc=)`: with a `LayerCache` it continues from it and writes what the next token
      needs (attention: keys and values; a recurrent mixer: `cache.state`);
    - `causal_only`: why it has no bidirectional form (head=mlm refuses it; None: it has one).
    """

    sublayer: str
    causal_only: str | None

    @classmethod
    def geometry(cls, cfg: Any, **keys: Any) -> Any: ...


@runtime_checkable
class AttentionWeights(Protocol):
    """Softmax attention's figures for the monitor: its weights on the tokens and each head's max logit (`probs`),
    and whether each row is a distribution (`sums_to_one`), and whether a sink takes a share of each row that reads no
    value (`sink_share`: the row's weights and that share make the distribution)."""

    sums_to_one: bool
    sink_share: bool

    def probs(self, x: torch.Tensor, pos: Any, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class RecurrentMixer(SequenceMixer, Protocol):
    """A recurrent mixer (lmlab.model.mixer): its figures for the monitor (state norm, gate statistics) and the path
    its last forward ran (`backend_used`: lmlab's PyTorch form or a kernel package's)."""

    backend_used: str | None

    def figures(self) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class Sublayer(Protocol):
    """A block's sublayer that names itself in the monitor's figures (`grad/norm/layer_XX/<sublayer>`)."""

    sublayer: str


def sublayer_name(module: object, attr: str) -> str:
    """The name of a block's sublayer `module` (held as the block's attribute `attr`) in the monitor's figures: its
    own `sublayer` where it is a `Sublayer`, else `attr`."""
    return module.sublayer if isinstance(module, Sublayer) else attr


@runtime_checkable
class ReadsPositions(Protocol):
    """A layer the position scheme reaches (its rotation, its logit bias) when `reads_positions`: attention, GAU."""

    reads_positions: bool


@runtime_checkable
class SideChannel(Protocol):
    """A sublayer with terms of the side channel (lmlab.model.side): the terms its last forward recorded, the metrics
    it records and where they are logged (`declared`), and the monitor's figure groups it has (`figure_groups`)."""

    terms: list[Term]
    declared: dict[str, tuple[str, ...]]
    figure_groups: tuple[str, ...]


@runtime_checkable
class Routes(Protocol):
    """A sublayer that routes tokens (ffn=moe): its last training forward's routing sums (`stats`, None before one),
    which the monitor turns into its figures (lmlab.model.moe.figures)."""

    stats: torch.Tensor | None


@runtime_checkable
class StepFollower(Protocol):
    """A module the training loop hands its step to (`FollowsStep` is the mixin for those whose state follows it;
    head=mtp_logits takes it too)."""

    def set_step(self, step: int | None, max_steps: int | None = None) -> None: ...


@runtime_checkable
class UpdatesBias(Protocol):
    """A sublayer that updates its routing bias after each optimizer step (an MoE's loss-free balancing)."""

    def update_bias(self, reduce: Any = None) -> None: ...


@runtime_checkable
class FitsVocabulary(Protocol):
    """A head option that takes what it needs from the data's tokenizer (head=prefix's prefix table)."""

    def fit_vocabulary(self, spec: dict[str, Any], tokenizer: Any, vocab_size: int, eod_id: int | None,
                       data: str | None) -> dict[str, Any]: ...


@runtime_checkable
class SizedAs(Protocol):
    """An FFN option whose size is matched as another kind's (an MoE: each expert as a dense FFN of its kind)."""

    def sized_as(self, spec: Any) -> type: ...


@runtime_checkable
class NamesParams(Protocol):
    """A head whose own weights the monitor groups under `params_group` (head=classify's label layer); a head without
    it: `mtp` (head=mtp's modules)."""

    params_group: str


@runtime_checkable
class MakesModel(Protocol):
    """A norm option that makes the model around it (norm=ngpt, lmlab.model.ngpt): `attach(model, **its keys)`, called
    once by the built GPT, returns its model-wide part (the GPT's `norm_model`)."""

    def attach(self, model: Any, **keys: Any) -> Any: ...


@runtime_checkable
class ChecksRun(Protocol):
    """A norm option that refuses training-loop settings (norm=ngpt): `check_run(optim, strategy, averages)`, run by
    lmlab.run.checks before training."""

    def check_run(self, optim: dict[str, Any], strategy: str | None, averages: bool) -> None: ...


# the residual options' hooks (lmlab.model.residual.Connections): each option has those it needs

@runtime_checkable
class Embeds(Protocol):
    def embed(self, x: torch.Tensor, idx: torch.Tensor, cache: Any, doc: torch.Tensor | None) -> torch.Tensor: ...


@runtime_checkable
class Starts(Protocol):
    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None: ...


@runtime_checkable
class Before(Protocol):
    def before(self, i: int, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class After(Protocol):
    def after(self, i: int, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Attaches(Protocol):
    """A residual option that changes the built model through the blocks' hooks (lmlab.model.placement)."""

    def attach(self, model: Any) -> None: ...


@runtime_checkable
class CountsParams(Protocol):
    """An option class whose weights count for the size bounds (`n_params(cfg, **keys)`, a classmethod)."""

    def n_params(self, cfg: Any, **keys: Any) -> int: ...


RESIDUAL_HOOKS = {"embed": Embeds, "start": Starts, "before": Before, "after": After}

__all__ = ["RESIDUAL_HOOKS", "After", "AttentionWeights", "Attaches", "Before", "ChecksRun", "ClipsLogits",
           "CountsParams", "Decays", "Embeds", "FitsVocabulary", "FollowsStep", "MakesModel", "Marks", "NamesParams",
           "ReadsPositions", "RecurrentMixer", "Routes", "ScaledLogits", "SequenceMixer", "SideChannel", "SizedAs",
           "Starts", "StepFollower", "Sublayer", "TokenMixer", "UpdatesBias", "mark", "marks", "sublayer_name"]
