"""Schedule-free AdamW (Defazio et al., 2024, "The Road Less Scheduled"; Meta's `schedulefree` package, whose
AdamWScheduleFree this runs). No decay schedule: the optimizer keeps a base sequence z (Adam-like steps at the constant
lr), its weighted average x (the weights to evaluate) and trains at their interpolation y:

    y = (1 − β1)·z + β1·x;   z ← z − lr·(g(y)/√v̂ + wd·y);   x ← (1 − c)·x + c·z,  c = lr_max² / Σ lr_i²

The model's parameters hold y in train mode and x in eval mode; `train()` and `eval()` switch in place. LitGPT calls
`eval()` when validation starts and `train()` when it ends (so val/loss is x's, and the checkpoint ModelCheckpoint
writes at validation holds x); a checkpoint written while training (an interruption, the end of the run) stores x as
its weights too (what eval.py and init_from read) and y beside them (`lmlab.train_weights`), which a resume puts back:
resuming reproduces the uninterrupted run exactly. The schedule group's warm-up applies (the package's own warm-up is
off); its decay is what schedule-free replaces, so LitGPT runs the `constant` schedule with the same warmup_steps.
"""

from __future__ import annotations

import schedulefree
import torch


class ScheduleFreeAdamW(schedulefree.AdamWScheduleFree):
    warmup_only = True  # the schedule's warm-up, never its decay

    @property
    def training(self) -> bool:
        return bool(self.param_groups[0]["train_mode"])

    @torch.no_grad()
    def eval_weights(self) -> dict[int, torch.Tensor]:
        """x for every parameter with state, by data_ptr, computed out of place (in train mode; eval mode: p itself),
        exactly as `eval()` would leave it."""
        out = {}
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                z = self.state[p].get("z")
                if z is not None:
                    out[p.data_ptr()] = p.lerp(z.to(p.device), 1 - 1 / beta1) if group["train_mode"] else p.detach()
        return out
