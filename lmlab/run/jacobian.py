"""The Pre/Post-Norm Jacobian argument as a figure: per block, how much ∂x_{l+1}/∂x_l stretches the residual stream.

The source note reasons with the block Jacobians: Pre-Norm x + F(N(x)) has J = I + J_F·J_N (an identity path that
keeps gradients at every depth), Post-Norm N(x + F(x)) has J = J_N·(I + J_F) (each layer's norm rescales the whole
path). lmlab measures ‖J_l‖ per block as its RMS gain, ‖J_l‖_F / √n over the n = T·d entries of one sequence's
stream, estimated by vector-Jacobian products with Gaussian probes: E‖Jᵀu‖² = ‖J‖_F² for u ~ N(0, I) (the same
Frobenius norm as the JVPs' E‖Jv‖², and one backward works through every op of the model, fused autograd Functions
included, where forward-mode torch.func.jvp does not), so √(mean over probes of ‖Jᵀu‖² / n) is unbiased in the
square (tests/unit/run/test_jacobian.py checks it against autograd's full Jacobian). One forward of the block, then a backward
per probe.

Logged as `jac/norm/layer_XX` every `jacobian.every_n_steps` steps (0: off, the default) on the first sequence of the
batch, with dropout off, `jacobian.probes` probes each.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lmlab import names
from lmlab.record.tracking import log_at

JAC_NORM = names.JAC_NORM


def block_inputs(model: nn.Module, idx: torch.Tensor) -> list[tuple[torch.Tensor, tuple, dict]]:
    """Each block's input x_l and the other arguments the model's own forward gives it (position hooks, cache,
    documents), read by forward pre-hooks during one forward: whatever the residual options do around the blocks."""
    seen: list[tuple[torch.Tensor, tuple, dict]] = []

    def keep(module, args, kwargs):
        seen.append((args[0].detach(), args[1:], kwargs))

    hooks = [block.register_forward_pre_hook(keep, with_kwargs=True) for block in model.h]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for h in hooks:
            h.remove()
    return seen


def block_jacobian_norms(model: nn.Module, idx: torch.Tensor, probes: int = 4, seed: int = 0) -> list[float]:
    """‖∂x_{l+1}/∂x_l‖_F / √n of every block on the sequences `idx` (B, T), from `probes` Gaussian VJPs."""
    was_training = model.training
    model.eval()
    try:
        inputs = block_inputs(model, idx)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        out = []
        for block, (x, rest, kwargs) in zip(model.h, inputs):
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                y = block(x, *rest, **kwargs)
                total = 0.0
                for i in range(probes):
                    u = torch.randn(y.shape, generator=gen, dtype=y.dtype).to(y.device)
                    (g,) = torch.autograd.grad(y, x, u, retain_graph=i < probes - 1)
                    total += float(g.double().pow(2).sum())
            out.append(math.sqrt(total / probes / x.numel()))
        return out
    finally:
        model.train(was_training)


class JacobianNorms(Callback):
    """Logs jac/norm/layer_XX every `every_n_steps` steps (before the step's update) on the batch's first sequence."""

    def __init__(self, every_n_steps: int, probes: int = 4) -> None:
        self.every_n_steps, self.probes = every_n_steps, probes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.every_n_steps or step % self.every_n_steps:
            return
        norms = block_jacobian_norms(pl_module.model, batch[0][:1], self.probes, seed=step)
        log_at(trainer, {f"{JAC_NORM}/{names.layer(i)}": v for i, v in enumerate(norms)}, step)
