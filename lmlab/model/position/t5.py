"""T5's relative position bias: learned, bucketed by distance."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import nn

from lmlab.model.position.base import Position, causal_distances
from lmlab.registry import Range


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's unidirectional bucket of a distance n = i − j (Raffel et al., 2020; `_relative_position_bucket` with
    bidirectional=False): n itself below E = num_buckets / 2, then E + ⌊ln(n / E) / ln(max_distance / E) · (num_buckets
    − E)⌋, logarithmic up to max_distance, and the last bucket at and beyond it. Negative n (the future) is bucket 0."""
    exact = num_buckets // 2
    n = distance.clamp(min=0)
    log = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    return torch.where(n < exact, n, (exact + log.long()).clamp(max=num_buckets - 1))


class T5Bias(Position):
    """T5's relative position bias (Raffel et al., 2020): logit(i, j) += table[bucket(i − j), h], one learned
    (num_buckets, n_head) table, shared by every layer as T5 computes it in its first layer and passes it on.

    Buckets are T5's causal ones (`t5_bucket`): exact below num_buckets / 2, logarithmic up to `max_distance`, one
    bucket for everything further, so any length runs. T5 adds the bias to unscaled logits (its init absorbs 1/√d); here
    it is added after the 1/√d scale, in the same logit units. The table is an nn.Embedding: the model's `init` sets it
    (init=gpt2: N(0, 0.02)), without weight decay, in the optimizer's `rest` group. transformers has no decoder-only
    architecture with T5's bias (T5 and its kin are encoder-decoders), so `export=hf` refuses position=t5.

    Bidirectional (`causal` False, head=mlm): T5's encoder buckets (`_relative_position_bucket` with
    bidirectional=True), half of the buckets for the keys at or before the query and half for those after it, each
    half bucketed as above with num_buckets / 2."""

    logit_bias = "position=t5 adds a learned bucket bias to every logit"

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, num_buckets: Annotated[int, Range(ge=2)] = 32,
                 max_distance: Annotated[int, Range(ge=2)] = 128) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        if max_distance <= num_buckets // 2:
            raise ValueError(f"position.max_distance={max_distance} must exceed position.num_buckets / 2 = "
                             f"{num_buckets // 2}, the distances given a bucket each; the log buckets span the rest")
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_head)

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        # attn_bias: int64 distances and buckets, float32 logs, a bool mask, then the gathered (T, T, nh) bias and its
        # masked copy; SDPA's math path with an explicit mask as under ALiBi (counted, not measured)
        return T * T * (29 + 8 * n_head) + 8 * batch * n_head * T * T

    @property
    def causal_only(self) -> str | None:
        if self.num_buckets < 4:
            return (f"position.num_buckets={self.num_buckets} leaves a bidirectional bias {self.num_buckets // 2} "
                    f"bucket(s) per direction, too few for T5's exact and logarithmic ranges: use num_buckets >= 4")
        return None

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        dist, future = causal_distances(T, offset, device)
        if not self.causal:  # T5's encoder buckets: the keys after the query in the upper half
            half = self.num_buckets // 2
            bucket = future.long() * half + t5_bucket(dist.abs(), half, self.max_distance)
            return self.table(bucket).permute(2, 0, 1).to(dtype)  # (nh, T, offset + T)
        bias = self.table(t5_bucket(dist, self.num_buckets, self.max_distance)).permute(2, 0, 1)  # (nh, T, offset + T)
        return bias.masked_fill(future, float("-inf")).to(dtype)


OPTIONS = {"t5": T5Bias}
