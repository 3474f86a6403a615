"""FP8 training per kind of Linear layer (`precision.fp8`): torchao's Float8Linear swapped in for the Linear layers of
the kinds named, the way torchtitan's float8 converter and nanochat's base_train use it. Opt-in: `precision.fp8=[]`,
the default, converts nothing and imports nothing.

A converted layer keeps its weight and bias (the same Parameters, so the same state-dict keys: its checkpoint loads
into a model without FP8, which eval.py, export and generation build) and runs its three matmuls (the forward, the
two of the backward) on float8 operands with dynamic scales: e4m3 for inputs and weights, e5m2 for gradients. On a
GPU of compute capability >= 8.9 (Ada, Hopper, Blackwell) these are FP8 tensor-core matmuls (torch._scaled_mm); on the
CPU torchao emulates them (the same casts, the product in high precision): FP8's numbers at no speed-up, which is what
the tests check. Only matmuls large enough gain: a layer converts when both its dimensions are multiples of 16 (the
FP8 matmul's rule) and at least `precision.fp8_min_features`; below that it stays as it was (bf16 under bf16-mixed).

The kinds (`KINDS`) are found by the sublayer a Linear belongs to (its `sublayer`, the monitor's name for it) and its
attribute there, so the model's code knows nothing of FP8. The output head, an MoE's routed experts and router, the
recurrent mixers, GAU and the gates are never converted (`KEPT` says why for the names a user may try).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import warnings
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lmlab.model.capabilities import Sublayer

# kind -> (the `sublayer` of the module holding the layers, their attribute names in it)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp": ("ffn", ("c_fc", "c_proj")),  # a dense FFN's (GLU: [gate; up] and down), an MoE's shared experts' too
    "attn_qkv": ("attn", ("c_attn", "q_proj", "q_a", "q_b", "kv_a", "kv_b")),  # fused q, k, v; MLA's low-rank ones
    "attn_proj": ("attn", ("c_proj",)),  # the attention's output projection
}
_KIND_OF = {(role, attr): kind for kind, (role, attrs) in KINDS.items() for attr in attrs}

KEPT = {  # names a user may try, and why they stay out
    "head": "the output head's logits come from its weight (the embedding's when tied) through F.linear inside the "
            "loss, not from a Linear layer; torchtitan's FP8 configs leave their output layer out too",
    "experts": "an MoE's routed experts are applied grouped (grouped_linear), not as Linear layers",
    "router": "an MoE's router computes its logits in fp32 on purpose",
}

# torchao's Float8LinearConfig.from_recipe_name: one scale per tensor (nanochat's; torchao's default), one per row,
# or per row with the weight gradient's matmul in high precision
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# train.yaml's floor on both dimensions. torchao's H100 benchmarks (its _auto_filter_for_recipe) find tensorwise FP8
# slower than bf16 for out_features <= 1024 unless in_features > 4096, and rowwise for out_features <= 2048; nanochat's
# floor of 128 only leaves out gates, its models being >= 1280 wide. At 1024 GPT-2 124M (768 wide) converts nothing.
MIN_FEATURES = 1024
FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada)


def kinds_of(model: nn.Module) -> dict[str, str]:
    """Every Linear layer one of KINDS names, whatever its size: qualified name -> kind, in module order. Subclasses
    of nn.Linear that are not applied as one (an MoE's Experts) are not Linear layers here."""
    found = {}
    for name, parent in model.named_modules():
        role = parent.sublayer if isinstance(parent, Sublayer) else None
        for attr, child in parent.named_children():
            kind = _KIND_OF.get((role, attr))
            if kind is not None and type(child) is nn.Linear:
                found[f"{name}.{attr}" if name else attr] = kind
    return found


def fits(layer: nn.Linear, min_features: int) -> bool:
    """Whether the FP8 matmul takes `layer` and gains from it: both dimensions multiples of 16 and >= min_features."""
    return all(n % 16 == 0 and n >= min_features for n in (layer.in_features, layer.out_features))


def selected(model: nn.Module, kinds: list[str], min_features: int) -> list[str]:
    """The qualified names of the layers `apply` converts for these kinds and floor, in module order."""
    return [name for name, kind in kinds_of(model).items()
            if kind in kinds and fits(model.get_submodule(name), min_features)]


def settings(cfg: DictConfig) -> tuple[list[str], int, str]:
    """`precision.fp8` (a list of kinds; one name alone is read as a list of it), `precision.fp8_min_features` and
    `precision.fp8_recipe` of a run's config (a config without the block: FP8 off)."""
    block = OmegaConf.select(cfg, "precision", default=None)
    block = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else dict(block or {})
    kinds = block.get("fp8") or []
    if not isinstance(kinds, (str, list)):
        raise ValueError(f"precision.fp8={kinds!r} must be a list of kinds of Linear layers: {', '.join(KINDS)} "
                         f"(e.g. precision.fp8=[mlp,attn_proj]; [] is off)")
    min_features, recipe = block.get("fp8_min_features", MIN_FEATURES), block.get("fp8_recipe", RECIPES[0])
    return [kinds] if isinstance(kinds, str) else kinds, min_features, recipe


def check(cfg: DictConfig) -> None:
    """Refuse, naming the key and what it accepts, a `precision:` block that cannot run: an unknown kind, a floor that
    is not an integer >= 1, an unknown recipe; and FP8 asked for without torchao, or on a GPU without FP8 matmuls."""
    from lmlab.registry import PositiveInt, check_values

    kinds, min_features, recipe = settings(cfg)
    accepted = ", ".join(KINDS)
    for kind in kinds:
        if isinstance(kind, str) and kind in KEPT:
            raise ValueError(f"precision.fp8: {kind!r} stays out of FP8 ({KEPT[kind]}); precision.fp8 takes {accepted} "
                             f"(e.g. precision.fp8=[mlp,attn_proj]; [] is off)")
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"precision.fp8: {kind!r} is not a kind of Linear layer lmlab converts; precision.fp8 "
                             f"takes {accepted} (e.g. precision.fp8=[mlp,attn_proj]; [] is off)")
    check_values("precision.", {"fp8_min_features": min_features, "fp8_recipe": recipe},
                 {"fp8_min_features": PositiveInt, "fp8_recipe": Literal[RECIPES]})
    if not kinds:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("precision.fp8 needs torchao, the `fp8` extra: pip install -e .[fp8] (or precision.fp8=[] "
                         "to train without FP8)")
    if on_gpu(cfg) and (capability := torch.cuda.get_device_capability()) < FP8_CAPABILITY:
        raise ValueError(f"precision.fp8={kinds} needs a GPU with FP8 matmuls (compute capability >= 8.9: Ada, Hopper, "
                         f"Blackwell); this one is {capability[0]}.{capability[1]}: use precision.fp8=[]")


def on_gpu(cfg: DictConfig) -> bool:
    """Whether the run trains on a CUDA GPU (trainer.accelerator gpu or cuda, or auto with one present)."""
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="auto"))
    return torch.cuda.is_available() and accelerator in ("gpu", "cuda", "auto")


def apply(model: nn.Module, cfg: DictConfig, *, emulate: bool | None = None) -> list[str]:
    """Convert `model`'s Linear layers of the kinds `precision.fp8` names, at or above the floor, to torchao's
    Float8Linear in place, before it is compiled or sharded; return their qualified names ([] when FP8 is off).
    `emulate`: torchao's CPU emulation (None: on unless the run trains on a CUDA GPU). A layer's own marks (`fused`,
    `is_residual_proj`, ... read by lmlab's attention, inits and optimizers) go with it to the new module."""
    kinds, min_features, recipe = settings(cfg)
    if not kinds:
        return []
    names = selected(model, kinds, min_features)
    if not names:
        warnings.warn(f"precision.fp8={kinds} converted no layer: each is under precision.fp8_min_features="
                      f"{min_features} or not a multiple of 16 in one dimension; the run trains without FP8 "
                      f"(lower precision.fp8_min_features to convert smaller layers)", stacklevel=2)
        return []
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=not on_gpu(cfg) if emulate is None else emulate)
    if recipe != "tensorwise":  # torchtitan's workaround for pytorch/pytorch#150859 (rowwise scales under inductor)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    before = {name: model.get_submodule(name) for name in names}
    chosen = frozenset(names)  # torchao's module_filter_fn: (module, qualified name) -> whether it converts
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in chosen, config=config)
    for name, old in before.items():
        new = model.get_submodule(name)
        for key, value in vars(old).items():  # from_float copies the weight and bias only
            if key not in vars(new):
                setattr(new, key, value)
    return names


def _torchao() -> Any:
    """torchao.float8, imported without its import-time noise (the warnings of its optional CUDA extensions, which a
    CPU or a wheel without them lacks, and torch's on torchao's pytree registrations)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8 as float8
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return float8
