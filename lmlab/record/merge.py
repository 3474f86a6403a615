"""Checkpoint merging: the weights of a run's last k step checkpoints averaged, as `eval.py run=<dir> merge=last:k`
evaluates them (issue 62; WSM, Tian et al. 2025: a weighted average of the checkpoints of a constant-LR phase stands
in for a decay run).

The checkpoints are those `checkpoint.keep_last=k` kept at the run's validations (checkpoints/step_<N>.ckpt,
lmlab.run.keep_last), loaded with weights_only=True. Only floating-point parameters are averaged; buffers (RoPE
caches, the MoE routers' expert_bias, which is a load-balancing state and not a weight) and integer tensors are the
newest checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmlab.record.rundir import SavedRun, load_checkpoint

SCHEMES = ("uniform", "linear")  # uniform: 1/k each; linear: 1, 2, ..., k (the newest heaviest), normalised
FORMS = "merge=last:<k> (the uniform average of the last k step checkpoints) or merge=last:<k>:linear (weights " \
        "1..k, the newest heaviest)"


def parse_merge(spec: Any) -> tuple[int, str]:
    """`last:k` -> (k, "uniform"), `last:k:linear` -> (k, "linear"); anything else refused naming the forms."""
    parts = spec.split(":") if isinstance(spec, str) else []
    ok = len(parts) in (2, 3) and parts[0] == "last" and parts[1].isdigit() and int(parts[1]) >= 1 and (
        len(parts) == 2 or parts[2] in SCHEMES)
    if not ok:
        raise ValueError(f"merge={spec!r}: accepted forms: {FORMS}")
    return int(parts[1]), parts[2] if len(parts) == 3 else "uniform"


def coefficients(k: int, scheme: str) -> list[float]:
    """The weight of each of k checkpoints, oldest first, summing to 1."""
    raw = [1.0] * k if scheme == "uniform" else [float(i) for i in range(1, k + 1)]
    return [w / sum(raw) for w in raw]


def merge_states(states: Sequence[dict[str, torch.Tensor]], coeffs: Sequence[float],
                 params: set[str]) -> dict[str, torch.Tensor]:
    """sum_i coeffs[i] * states[i][name] for each floating-point tensor named in `params` (in float64, cast back to
    its dtype); every other entry (buffers, integer tensors) is the last state's."""
    merged = {}
    for name, last in states[-1].items():
        if name in params and last.is_floating_point():
            merged[name] = sum(c * s[name].double() for c, s in zip(coeffs, states)).to(last.dtype)
        else:
            merged[name] = last
    return merged


def merged_weights(saved: SavedRun, spec: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The GPT state dict of `merge=spec` over the run's step checkpoints, and what was merged (steps, weights)."""
    from lmlab.record.rundir import RunDir

    k, scheme = parse_merge(spec)
    found = RunDir(saved.path).step_checkpoints()
    if len(found) < k:
        raise ValueError(f"merge={spec}: {saved.path} has {len(found)} step checkpoints (checkpoints/step_<N>.ckpt), "
                         f"{k} needed: train it with checkpoint.keep_last={k} (or more), which keeps the last k "
                         f"validations' checkpoints; accepted forms: {FORMS}")
    chosen = found[-k:]
    states = []
    for step, path in chosen:
        state = load_checkpoint(path, f"merge={spec}")["state_dict"]
        states.append({n.removeprefix("model."): v for n, v in state.items() if n.startswith("model.")})
        if states[-1].keys() != saved.weights.keys() or any(
                v.shape != saved.weights[n].shape for n, v in states[-1].items()):
            raise ValueError(f"merge={spec}: {path} does not hold the weights of {saved.path}'s model (other names "
                             f"or shapes)")
    params = {n for n, _ in saved.build("live").named_parameters(remove_duplicate=False)}  # tied: both names
    coeffs = coefficients(k, scheme)
    return merge_states(states, coeffs, params), {"spec": spec, "steps": [s for s, _ in chosen], "weights": coeffs}
