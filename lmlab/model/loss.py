"""The language-modelling loss: token cross-entropy with one backward formula.

`cross_entropy(logits, targets)` equals `F.cross_entropy(logits.float(), targets)` (mean over the targets that are
not `ignore_index`) in value and gradient. Its backward is the closed form softmax − onehot, scaled, written in two
passes over the (N, V) logits; autograd through torch's loss zero-fills an (N, V) buffer for nll_loss's gradient,
scatters into it, and runs log_softmax's backward on top (1 thread, N = 2048, V = 4096: 44 ms forward + backward
against 32 ms). Lower-precision logits (bf16 autocast) are read by log_softmax directly into fp32, without a
separate upcast copy, and get their gradient back in their own dtype.

Two options change the objective, on both paths (and in their closed-form backward): `softcap` c, the final-logit
softcap z ← c·tanh(z / c) before the softmax (Gemma 2; a `Softcap` for its asymmetric form), and `z_loss` λ,
PaLM's auxiliary z-loss λ·mean(log Z)², log Z the log-partition of each row, which keeps the logits from drifting.
With `parts=True` the functions return the objective and, detached, its cross-entropy and z-loss parts (what the
loggers show apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Z_LOSS = "z_loss"  # its side-channel term (lmlab.model.side): train/z_loss, mean (log Z)², already in the objective


@dataclass(frozen=True)
class Softcap:
    """The final-logit softcap z ← c·tanh((z + b) / w): Gemma 2's with w = c and b = 0 (a plain float c stands for
    it), and the GPT-2 speedrun's asymmetric logit rescale (record 54, 23·σ((z + 5) / 7.5)): A·σ((z + b) / s) is
    A/2 + (A/2)·tanh((z + b) / 2s), whose constant the softmax drops, so c = A/2 = 11.5, w = 2s = 15, b = 5; the
    offset moves the logits' range off centre, [−c, c] reached at −b ∓ ∞."""

    cap: float
    width: float | None = None  # w; None: the cap
    offset: float = 0.0  # b

    @property
    def w(self) -> float:
        return self.cap if self.width is None else self.width

    def tanh(self, z: torch.Tensor) -> torch.Tensor:
        """t = tanh((z + b) / w): the capped logits are c·t, their derivative (c / w)·(1 − t²)."""
        return torch.tanh((z + self.offset) / self.w) if self.offset else torch.tanh(z / self.w)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.cap * self.tanh(z)

    def grad(self, t: torch.Tensor) -> torch.Tensor:
        return (self.cap / self.w) * (1 - t.square())


def as_softcap(softcap: float | Softcap | None) -> Softcap | None:
    return softcap if softcap is None or isinstance(softcap, Softcap) else Softcap(float(softcap))


def _nll_sum(logp: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed −log p(target) over the valid rows of logp (N, V), and the (N, 1) class index used per row."""
    index = torch.where(valid, targets, 0)[:, None]  # any class on ignored rows: masked out here and in backward
    return -torch.where(valid, logp.gather(1, index).squeeze(1), 0.0).sum(), index


def _dlogits(probs: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax − onehot) · scale, written into `probs` (the softmax); scale (N, 1) is
    d loss / d row (0 on ignored rows)."""
    return probs.mul_(scale).scatter_add_(1, index, -scale)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (N, V)
        valid = targets != ignore_index  # (N,)
        count = valid.sum()
        nll, index = _nll_sum(logp, targets, valid)
        ctx.save_for_backward(logp, index, valid, count)
        ctx.dtype = logits.dtype
        return nll / count  # all rows ignored: 0 / 0 = nan, as torch's

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logp, index, valid, count = ctx.saved_tensors
        scale = torch.where(valid, grad / count, 0.0)[:, None]
        return _dlogits(logp.exp(), index, scale).to(ctx.dtype), None, None  # logp stays intact: backward may rerun


def _capped_rows(z: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, softcap: float | Softcap | None,
                 z_loss: float, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows z (N, V) in fp32: the summed NLL and summed (log Z)² of the (softcapped) rows, and d objective / d z
    for objective = (NLL + z_loss·(log Z)²) summed over the valid rows / count."""
    softcap = as_softcap(softcap)
    if softcap is not None:
        t = softcap.tanh(z)
        z = softcap.cap * t
    logp = torch.log_softmax(z, dim=-1)
    nll, index = _nll_sum(logp, targets, valid)
    lse = (z[:, 0] - logp[:, 0])[:, None]  # log Z per row (logp = z − log Z in every column)
    z_sq = torch.where(valid[:, None], lse.square(), 0.0).sum()
    scale = valid[:, None].to(z.dtype) / count.clamp(min=1)  # every row ignored: a zero gradient, not 0 / 0
    probs = logp.exp_()
    dz = _dlogits(probs.clone() if z_loss else probs, index, scale)
    if z_loss:
        dz.add_(probs.mul_(lse * (2 * z_loss) * scale))
    if softcap is not None:
        dz.mul_(softcap.grad(t))
    return nll, z_sq, dz


class _CappedCrossEntropy(torch.autograd.Function):
    """cross_entropy with a softcap and/or a z-loss: the gradient is worked out in forward (one (N, V) tensor kept)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, softcap: float | Softcap | None,
                z_loss: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = targets != ignore_index
        count = valid.sum()
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        nll, z_sq, dz = _capped_rows(z, targets, valid, softcap, z_loss, count)
        ctx.save_for_backward(dz)
        ctx.dtype = logits.dtype
        ce, zl = nll / count, z_sq / count
        ctx.mark_non_differentiable(ce, zl)
        return ce + z_loss * zl, ce, zl

    @staticmethod
    def backward(ctx, grad: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (dz,) = ctx.saved_tensors
        return (dz * grad).to(ctx.dtype), None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  softcap: float | Softcap | None = None, z_loss: float = 0.0, parts: bool = False) -> Any:
    """Mean token cross-entropy, in fp32 (fp64 for fp64 logits). logits (..., V), targets (...) class ids. With a
    `softcap` or a `z_loss`, their objective (module docstring); `parts=True`: (objective, cross-entropy, z-loss)."""
    flat, t = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    if softcap is None and not z_loss:
        loss = _CrossEntropy.apply(flat, t, ignore_index)
        return (loss, loss.detach(), torch.zeros_like(loss)) if parts else loss
    out = _CappedCrossEntropy.apply(flat, t, ignore_index, softcap, float(z_loss))
    return out if parts else out[0]


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         chunk_elems: int = 1 << 25, softcap: float | Softcap | None = None, z_loss: float = 0.0,
                         parts: bool = False) -> Any:
    """`cross_entropy(h @ weight.T, targets)` without ever holding the (N, V) logits: row blocks of about
    `chunk_elems` logits each, the head's gradients computed block by block in the forward pass.

    h (..., d) the final hidden states, weight (V, d) the LM head, targets (...). Under autocast the matmuls run in
    the autocast dtype, as the head's Linear would. Memory: the unchunked path keeps an fp32 (N, V) tensor for
    backward and allocates another (and the logits) during it; this keeps dh (N, d) and an fp32 dW (V, d).
    """
    h2, t = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    rows = max(1, chunk_elems // weight.size(0))
    plain = softcap is None and not z_loss and not parts
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        if plain:
            return _LinearCrossEntropy.apply(h2, weight, t, ignore_index, rows)
        out = _LinearCrossEntropy.apply(h2, weight, t, ignore_index, rows, softcap, float(z_loss))
        return out if parts else out[0]
    with torch.no_grad():  # no gradient wanted (eval): the objective's terms block by block, nothing else
        hc, wc, _ = _compute_dtype(h2, weight)
        valid = t != ignore_index
        nll = z_sq = torch.zeros((), device=h.device)
        for i in range(0, hc.size(0), rows):
            block_nll, _, logp = _block_nll(hc[i:i + rows], wc, t[i:i + rows], valid[i:i + rows], softcap)
            nll = nll + block_nll
            if z_loss or parts:  # log Z = z − log p in any column: column 0's
                z0 = _capped((hc[i:i + rows] @ wc[:1].t()).to(logp.dtype), softcap)[:, 0]
                z_sq = z_sq + torch.where(valid[i:i + rows], (z0 - logp[:, 0]).square(), 0.0).sum()
        ce, zl = nll / valid.sum(), z_sq / valid.sum()
        return (ce + z_loss * zl, ce, zl) if parts else ce + z_loss * zl


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """h and weight in the dtype the head's matmul would use: autocast's when it is on for this device."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    return h.to(dtype), weight.to(dtype), dtype


def _capped(z: torch.Tensor, softcap: float | Softcap | None) -> torch.Tensor:
    """The final-logit softcap c·tanh((z + b) / w) (`Softcap`), or z itself without one."""
    return z if softcap is None else as_softcap(softcap)(z)


def _block_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
               softcap: float | Softcap | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed NLL of one row block (softcapped logits, with one), its fp32 log-probs and the class index per row."""
    with torch.autocast(h.device.type, enabled=False):  # dtypes are explicit here
        acc = torch.promote_types(h.dtype, torch.float32)
        if softcap is None:  # bf16 logits read straight into fp32, no separate upcast copy
            logp = torch.log_softmax(h @ weight.t(), dim=-1, dtype=acc)
        else:
            logp = torch.log_softmax(_capped((h @ weight.t()).to(acc), softcap), dim=-1)
    return *_nll_sum(logp, targets, valid), logp


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                rows: int, softcap: float | Softcap | None = None, z_loss: float | None = None) -> Any:
        hc, wc, dtype = _compute_dtype(h, weight)
        valid = targets != ignore_index
        count = valid.sum()
        acc = torch.promote_types(dtype, torch.float32)
        dh = torch.empty(h.shape, dtype=dtype, device=h.device)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        z_total = torch.zeros((), dtype=acc, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.size(0), rows):
                if z_loss is None:  # the plain loss: one log-softmax per block, its gradient in place
                    nll, index, logp = _block_nll(hc[i:i + rows], wc, targets[i:i + rows], valid[i:i + rows])
                    scale = valid[i:i + rows, None].to(logp.dtype) / count.clamp(min=1)  # (as _capped_rows)
                    dlogits = _dlogits(logp.exp_(), index, scale).to(dtype)  # logp is this block's own: in place
                else:
                    z = (hc[i:i + rows] @ wc.t()).to(acc)
                    nll, z_sq, dlogits = _capped_rows(z, targets[i:i + rows], valid[i:i + rows], softcap, z_loss,
                                                      count)
                    dlogits = dlogits.to(dtype)
                    z_total += z_sq
                total += nll
                torch.mm(dlogits, wc, out=dh[i:i + rows])
                dw += (dlogits.t() @ hc[i:i + rows]).to(acc)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, weight.dtype)
        if z_loss is None:
            return total / count
        ce, zl = total / count, z_total / count
        ctx.mark_non_differentiable(ce, zl)
        return ce + z_loss * zl, ce, zl

    @staticmethod
    def backward(ctx, grad: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None,
                                                                      None, None]:
        dh, dw = ctx.saved_tensors
        return (dh * grad).to(ctx.dtypes[0]), (dw * grad).to(ctx.dtypes[1]), None, None, None, None, None
