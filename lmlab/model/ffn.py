"""Position-wise feed-forward networks (the `ffn` axis).

Contract: `FFN(dim, hidden, *, activation, bias)` maps (..., dim) -> (..., dim); `activation` is the
config of the `activation` group. `n_params(dim, hidden, bias)` on each class is its parameter count, from
which `matched_hidden` (applied once by `GPTConfig`) sizes every option to the MLP's parameter count: a GLU
has three matrices instead of two, so its hidden size is about 2/3 of the MLP's (`hidden_ratio`), rounded to
the coarsest multiple that keeps it within 1% of the MLP's parameters. A routed option (`moe`, lmlab.model.moe) is
not matched to the MLP: it says with `sized_as(spec)` which kind sizes each of its experts, and its `n_params` takes
its own options. The dense kinds live in lmlab.model.dense, below the MoE whose experts they are; this file holds the
registry of both.
"""

from __future__ import annotations

from lmlab.model.dense import DENSE_FFNS, GLU, MLP, GeGLU, ReGLU, SwiGLU, matched_hidden  # noqa: F401  (public here)
from lmlab.model.moe import MoE

FFNS = {**DENSE_FFNS, "moe": MoE}
