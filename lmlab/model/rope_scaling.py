"""RoPE scaling: how the rotary frequencies change so a model reaches past the length it was trained at.

Contract: every option is a plain function

    f(dim, base, max_seq_len, seq_len, *, <the scheme's own keys>) -> (inv_freq, attention_factor)

- `dim` is the rotary dimension d (even), `base` is theta; `inv_freq` is float32 of shape (d/2,) and
  `attention_factor` multiplies both cos and sin, so attention logits scale by its square (as in HF).
- `max_seq_len` is the length the model runs at now (at zero-shot eval: the evaluated length); `seq_len` is the
  length of the current forward, read only by dynamic options, which carry `fn.dynamic = True` so that RoPE
  recomputes them per forward instead of once.
- `original_max_len` is the trained length L (None: `max_seq_len`). A static `factor` of None means
  `max(1, max_seq_len / original_max_len)`, so at eval the factor follows the evaluated length.

The formulas are those of Hugging Face transformers 5.24 (`modeling_rope_utils.py`), written out in
docs/ROPE.md, computed with the same float32 expressions so a model extended here means the same thing there.
Static NTK-aware and Dynamic-YaRN are not HF rope types; they follow the NTK-aware post and the YaRN paper.
One deliberate difference: any scale of exactly 1 returns the default frequencies bit for bit (HF's yarn and
llama3 blends can differ in the last ulp), so "scaling that does not scale" is the identity.
"""

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from lmlab.registry import PositiveFloat, PositiveInt, Range, option_params

Factor = Annotated[float, Range(ge=1)]  # the scale s; below 1 would compress the trained range (see _check_factor)


def rotary_dim(head_dim: int, rotary_pct: float = 1.0) -> int:
    """d = int(head_dim * rotary_pct), rounded down to even: RoPE rotates pairs, so an odd d cannot be rotated."""
    if not 0 < rotary_pct <= 1:
        raise ValueError(f"position.rotary_pct must be in (0, 1] (got {rotary_pct})")
    if rotary_pct == 1 and head_dim % 2:
        raise ValueError(f"position=rope rotates pairs of dims, but the head dim model.d_model / model.n_head = "
                         f"{head_dim} is odd; choose d_model and n_head giving an even head dim")
    d = int(head_dim * rotary_pct)
    d -= d % 2  # a partial rotary width rounds down; the remaining dims pass through unrotated
    if d < 2:
        raise ValueError(
            f"position.rotary_pct={rotary_pct} with head_dim={head_dim} leaves {d} rotary dims; need an even d >= 2"
        )
    return d


def _default_inv_freq(dim: int, base: float) -> Tensor:
    """1 / base^(2j/d), j = 0 … d/2−1, with HF's exact float32 expression (so parity is bitwise)."""
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dim must be even and >= 2 (got {dim}); it is int(head_dim * position.rotary_pct)")
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _trained_len(max_seq_len: int, original_max_len: int | None) -> int:
    """L, the length the model was trained at; None means the model runs at its trained length now."""
    length = max_seq_len if original_max_len is None else original_max_len
    if length < 1:
        raise ValueError(f"rope_scaling.original_max_len must be >= 1 (got {length})")
    return length


def _check_factor(factor: float) -> float:
    # factor < 1 would *raise* the frequencies (compress the trained range); HF only warns, we fail early.
    if factor < 1:
        raise ValueError(f"rope_scaling.factor must be >= 1 (got {factor}); use null to follow max_seq_len")
    return float(factor)


def _static_scale(factor: float | None, max_seq_len: int, original_max_len: int | None) -> float:
    """s: the given factor, or the current length over the trained one (never below 1)."""
    if factor is None:
        return max(1.0, max_seq_len / _trained_len(max_seq_len, original_max_len))
    return _check_factor(factor)


def _ntk_inv_freq(dim: int, base: float, ratio: float) -> Tensor:
    """Default frequencies with base' = base · ratio^(d/(d−2)), which divides the lowest frequency by exactly ratio.

    d = 2 has only the pair j = 0, whose frequency is 1 for any base, so there is nothing to rescale.
    """
    if ratio == 1 or dim == 2:
        return _default_inv_freq(dim, base)
    return _default_inv_freq(dim, base * ratio ** (dim / (dim - 2)))


def yarn_correction_range(
    dim: int, base: float, original_max_len: int, beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True
) -> tuple[float, float]:
    """YaRN's (low, high) pair indices: below low a pair turns > beta_fast times over L (kept), above high < beta_slow.

    Uses the *original* length and base: the ramp describes what the model saw in training, not where it runs now.
    `high` is clamped to d−1 as in HF although pairs only run to d/2−1 (it only matters for tiny L).
    """

    def pair_index(rotations: float) -> float:
        return dim * math.log(original_max_len / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


Ramp = Literal["index", "ratio"]


def _yarn_inv_freq(
    dim: int, base: float, scale: float, original_max_len: int, beta_fast: float, beta_slow: float, truncate: bool,
    ramp_in: Ramp = "index",
) -> Tensor:
    """NTK-by-parts: high-frequency pairs unchanged, low-frequency pairs divided by s, a linear ramp between.

    `index` (the default; transformers and the reference code): linear in the pair index j between the correction
    pairs where a pair turns beta_fast and beta_slow times over L; same float32 expression as HF (ramp built as
    1 − (1 − ramp)) for bitwise parity. `ratio`: the paper's Definition 2, linear in r = L/λ_j (λ_j = 2π/θ_j the
    pair's wavelength), γ = clamp((r − beta_slow) / (beta_fast − beta_slow), 0, 1), θ'_j = (1 − γ)·θ_j/s + γ·θ_j.
    The two agree outside the ramp and differ inside it (r is exponential in j)."""
    if scale == 1:
        return _default_inv_freq(dim, base)
    if ramp_in == "ratio":
        theta = _default_inv_freq(dim, base)
        r = original_max_len * theta / (2 * math.pi)  # rotations of each pair over the trained length
        gamma = ((r - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)
        return (1 - gamma) * theta / scale + gamma * theta
    low, high = yarn_correction_range(dim, base, original_max_len, beta_fast, beta_slow, truncate)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    interpolated, extrapolated = 1.0 / (scale * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def _yarn_attention(
    scale: float, attention_factor: float | None, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """YaRN's temperature, sqrt(1/t) = 0.1 ln s + 1, unless given; the DeepSeek mscale ratio when both are set."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(_mscale(scale, mscale) / _mscale(scale, mscale_all_dim))
    return _mscale(scale)


def none(dim: int, base: float, max_seq_len: int, seq_len: int) -> tuple[Tensor, float]:
    """Plain RoPE (Su et al., 2021): 1 / base^(2j/d); the baseline every other option must reduce to at s = 1."""
    return _default_inv_freq(dim, base), 1.0


def linear(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor | None = None,
    original_max_len: PositiveInt | None = None,
) -> tuple[Tensor, float]:
    """Position Interpolation (Chen et al., 2023): every frequency / s, i.e. positions squeezed into the trained
    range. Dividing inv_freq is the same as dividing positions, since the angle is their product."""
    return _default_inv_freq(dim, base) / _static_scale(factor, max_seq_len, original_max_len), 1.0


def dynamic_linear(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, original_max_len: PositiveInt | None = None,
) -> tuple[Tensor, float]:
    """Dynamic Position Interpolation (the dynamic form of Chen et al., 2023, as the source notes list it beside
    dynamic NTK): PI with s = max(1, seq_len / L) per forward, so a forward within the trained length is the plain
    model exactly, and a longer one squeezes its positions just into the trained range."""
    scale = max(1.0, seq_len / _trained_len(max_seq_len, original_max_len))
    inv_freq = _default_inv_freq(dim, base)
    return (inv_freq if scale == 1 else inv_freq / scale), 1.0


dynamic_linear.dynamic = True


def ntk(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor | None = None,
    original_max_len: PositiveInt | None = None,
) -> tuple[Tensor, float]:
    """Static NTK-aware scaling (bloc97, 2023): base' = base · s^(d/(d−2)). The highest frequency is unchanged
    (extrapolate what is resolved), the lowest is divided by exactly s (interpolate what never turned fully)."""
    return _ntk_inv_freq(dim, base, _static_scale(factor, max_seq_len, original_max_len)), 1.0


def dynamic_ntk(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor = 1.0,
    original_max_len: PositiveInt | None = None,
) -> tuple[Tensor, float]:
    """Dynamic NTK (bloc97/emozilla 2023; HF `dynamic`): base' = base · (factor·n/L − (factor−1))^(d/(d−2)) with
    n = max(seq_len, L). Short inputs keep the trained frequencies exactly; longer ones stretch only as far as
    needed. factor = 1 gives s = n/L."""
    length = _trained_len(max_seq_len, original_max_len)
    factor = _check_factor(factor)
    n = max(seq_len, length)
    if n == length:
        return _default_inv_freq(dim, base), 1.0
    return _ntk_inv_freq(dim, base, factor * n / length - (factor - 1)), 1.0


dynamic_ntk.dynamic = True


def ntk_by_parts(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor | None = None,
    original_max_len: PositiveInt | None = None, beta_fast: PositiveFloat = 32.0, beta_slow: PositiveFloat = 1.0,
    truncate: bool = True, ramp: Ramp = "index",
) -> tuple[Tensor, float]:
    """NTK-by-parts (bloc97 2023; YaRN paper §3.2, Peng et al. 2023, arXiv 2309.00071): YaRN's frequencies without
    its attention temperature, to separate the two effects in ablations."""
    scale = _static_scale(factor, max_seq_len, original_max_len)
    length = _trained_len(max_seq_len, original_max_len)
    return _yarn_inv_freq(dim, base, scale, length, beta_fast, beta_slow, truncate, ramp), 1.0


def yarn(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor | None = None,
    original_max_len: PositiveInt | None = None, beta_fast: PositiveFloat = 32.0, beta_slow: PositiveFloat = 1.0,
    attention_factor: PositiveFloat | None = None, mscale: float | None = None, mscale_all_dim: float | None = None,
    truncate: bool = True, ramp: Ramp = "index",
) -> tuple[Tensor, float]:
    """YaRN (Peng et al., 2023, arXiv 2309.00071): NTK-by-parts frequencies plus cos/sin scaled by 0.1 ln s + 1,
    which sharpens attention back to the entropy it had at the trained length. Ramp on the original L and base."""
    scale = _static_scale(factor, max_seq_len, original_max_len)
    length = _trained_len(max_seq_len, original_max_len)
    inv_freq = _yarn_inv_freq(dim, base, scale, length, beta_fast, beta_slow, truncate, ramp)
    return inv_freq, _yarn_attention(scale, attention_factor, mscale, mscale_all_dim)


def dynamic_yarn(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, original_max_len: PositiveInt | None = None,
    beta_fast: PositiveFloat = 32.0, beta_slow: PositiveFloat = 1.0, mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True, ramp: Ramp = "index",
) -> tuple[Tensor, float]:
    """Dynamic-YaRN (Peng et al., 2023, arXiv 2309.00071 §3.3): YaRN with s = max(1, seq_len / L) per forward, so
    inputs within the trained length see the trained model exactly (frequencies and attention factor 1)."""
    length = _trained_len(max_seq_len, original_max_len)
    scale = max(1.0, seq_len / length)
    inv_freq = _yarn_inv_freq(dim, base, scale, length, beta_fast, beta_slow, truncate, ramp)
    return inv_freq, _yarn_attention(scale, None, mscale, mscale_all_dim)


dynamic_yarn.dynamic = True


def llama3(
    dim: int, base: float, max_seq_len: int, seq_len: int, *, factor: Factor | None = None,
    original_max_len: PositiveInt | None = None, low_freq_factor: PositiveFloat = 1.0,
    high_freq_factor: PositiveFloat = 4.0,
) -> tuple[Tensor, float]:
    """Llama 3.1 scaling (Meta, 2024): by wavelength λ = 2π/θ_j, pairs with λ < L/high_freq_factor are unchanged,
    λ > L/low_freq_factor divided by s, and a smooth blend in L/λ between: YaRN's idea with wavelength bands."""
    scale = _static_scale(factor, max_seq_len, original_max_len)
    length = _trained_len(max_seq_len, original_max_len)
    if high_freq_factor <= low_freq_factor:
        raise ValueError(
            f"rope_scaling.high_freq_factor ({high_freq_factor}) must be > low_freq_factor ({low_freq_factor})"
        )
    inv_freq = _default_inv_freq(dim, base)
    if scale == 1:
        return inv_freq, 1.0
    low_freq_wavelen, high_freq_wavelen = length / low_freq_factor, length / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scale, inv_freq)
    smooth = (length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / scale + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def rope_frequencies(
    head_dim: int, base: float, scaling: Mapping[str, Any] | None = None, *, max_seq_len: int,
    seq_len: int | None = None, rotary_pct: float = 1.0,
) -> tuple[Tensor, float]:
    """(inv_freq, attention_factor) for a head: d from `rotary_dim`, `scaling` a spec like {"name": "yarn",
    "factor": 4} (None: plain RoPE), `seq_len` the current forward's length (default max_seq_len)."""
    dim = rotary_dim(head_dim, rotary_pct)
    name, params = option_params("rope_scaling", ROPE_SCALINGS, scaling or {"name": "none"})
    return ROPE_SCALINGS[name](dim, base, max_seq_len, max_seq_len if seq_len is None else seq_len, **params)


def window_yarn(inv_freq: Tensor, windows: list[int], *, alpha: float = 1.0, beta: float = 32.0, slope: float = 0.2
                ) -> tuple[Tensor, float]:
    """YaRN applied in training at each growth of the attention window (the GPT-2 speedrun's record 31,
    2025-09-10_Yarn, `apply_yarn`): for each change W -> W' in `windows` (the longest layers' window over the run, in
    tokens), each pair's rotations over the old window r = W·θ_j/2π set γ = clamp((r − α)/(β − α), 0, 1) and
    θ_j ← θ_j·(W/W' + γ·(1 − W/W')) — pairs turning ≤ α times over W interpolated by W/W', ≥ β times kept, a ramp
    between — cumulatively, from the θ the last change left — and the attention logits' scale by
    Π (slope·ln(W'/W) + 1) (returned: it multiplies the whole logit, rotated dims or not). Windows that repeat change
    nothing."""
    theta, logit_scale = inv_freq.clone(), 1.0
    for old, new in zip(windows, windows[1:], strict=False):
        if new == old:
            continue
        ratio = old / new
        gamma = ((old * theta / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0, 1)
        theta = theta * (ratio + gamma * (1 - ratio))
        logit_scale *= slope * math.log(new / old) + 1
    return theta, logit_scale


ROPE_SCALINGS = {
    "none": none,
    "linear": linear,
    "dynamic_linear": dynamic_linear,
    "ntk": ntk,
    "dynamic_ntk": dynamic_ntk,
    "ntk_by_parts": ntk_by_parts,
    "yarn": yarn,
    "dynamic_yarn": dynamic_yarn,
    "llama3": llama3,
}
