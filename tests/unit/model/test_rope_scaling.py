"""RoPE scaling: the numbers of docs/ROPE.md §2.7, parity with transformers 5.24, and the invariants
(dynamic = default within the trained length, scale 1 = identity, YaRN's ramp on the original length)."""

import inspect
import math

import pytest
import torch
from omegaconf import OmegaConf

from lmlab.model.rope_scaling import ROPE_SCALINGS, rope_frequencies, rotary_dim, yarn_correction_range
from lmlab.registry import option_params
from tests.runs import ROOT

CONF = ROOT / "conf" / "rope_scaling"
DIM, BASE, L = 64, 10_000.0, 256
DEFAULT = 1.0 / (BASE ** (torch.arange(0, DIM, 2, dtype=torch.int64).float() / DIM))
DYNAMIC = sorted(name for name, fn in ROPE_SCALINGS.items() if getattr(fn, "dynamic", False))
WITH_FACTOR = sorted(name for name, fn in ROPE_SCALINGS.items() if "factor" in inspect.signature(fn).parameters)


def _at(name: str, length: int) -> tuple[torch.Tensor, float]:
    """Run option `name` at `length` (max_seq_len for static options, seq_len for dynamic ones), trained at L."""
    kw = {} if name == "none" else {"original_max_len": L}
    return ROPE_SCALINGS[name](DIM, BASE, length, length, **kw)


# ---- ROPE.md §2.7 test vectors -------------------------------------------------------------------------------


def test_yarn_vector_d64() -> None:
    assert yarn_correction_range(64, 1e4, 2048) == (8, 21)
    inv_freq, attention = ROPE_SCALINGS["yarn"](64, 1e4, 8192, 8192, factor=4.0, original_max_len=2048)
    assert attention == pytest.approx(1.138629436, abs=1e-9)
    idx = [0, 8, 12, 16, 21, 31]
    expected = torch.tensor([1.0, 0.1, 2.432521e-2, 5.384615e-3, 5.928435e-4, 3.333804e-5])
    torch.testing.assert_close(inv_freq[idx], expected, rtol=2e-6, atol=0)
    default = torch.tensor([1.0, 0.1, 3.162278e-2, 1.0e-2, 2.371374e-3, 1.333522e-4])
    torch.testing.assert_close(DEFAULT[idx], default, rtol=2e-6, atol=0)
    assert torch.equal(inv_freq[:9], DEFAULT[:9])  # j <= low: extrapolated, untouched
    torch.testing.assert_close(inv_freq[21:], DEFAULT[21:] / 4, rtol=1e-6, atol=0)  # j >= high: interpolated


def test_yarn_correction_range_untruncated() -> None:
    low, high = yarn_correction_range(64, 1e4, 2048, truncate=False)
    assert low == pytest.approx(8.0640008, abs=1e-6) and high == pytest.approx(20.1052007, abs=1e-6)


def test_yarn_mscale_vector() -> None:
    kw = dict(factor=40.0, original_max_len=4096)
    assert ROPE_SCALINGS["yarn"](128, 1e4, 4096, 4096, mscale=1.0, mscale_all_dim=1.0, **kw)[1] == 1.0
    assert ROPE_SCALINGS["yarn"](128, 1e4, 4096, 4096, **kw)[1] == pytest.approx(1.368887945, abs=1e-9)


def test_dynamic_linear_vector() -> None:
    """d 64, base 1e4, trained 2048, a forward of 8192: s = 4, so inv_freq[-1] = 1e4^(-62/64) / 4 = 3.33380e-5
    (1e4^(-62/64) = 10^-3.875 = 1.333521e-4, by hand); at 2048 and below, plain RoPE; at 3072, PI with s = 1.5."""
    fn = ROPE_SCALINGS["dynamic_linear"]
    inv_freq, attention = fn(64, 1e4, 2048, 8192, original_max_len=2048)
    assert attention == 1.0 and inv_freq[-1].item() == pytest.approx(3.333802e-5, rel=1e-6)
    assert inv_freq[0].item() == 0.25  # the highest frequency, 1, divided by s too (PI squeezes every pair)
    plain = ROPE_SCALINGS["none"](64, 1e4, 2048, 2048)[0]
    assert torch.equal(fn(64, 1e4, 2048, 2048, original_max_len=2048)[0], plain)
    assert torch.equal(fn(64, 1e4, 2048, 100, original_max_len=2048)[0], plain)
    torch.testing.assert_close(fn(64, 1e4, 2048, 3072, original_max_len=2048)[0],
                               ROPE_SCALINGS["linear"](64, 1e4, 3072, 3072, factor=1.5, original_max_len=2048)[0])


def test_dynamic_ntk_vector() -> None:
    fn = ROPE_SCALINGS["dynamic_ntk"]
    inv_freq, attention = fn(64, 1e4, 2048, 8192, factor=2.0, original_max_len=2048)
    assert attention == 1.0
    assert inv_freq[-1].item() == pytest.approx(1.9050307e-5, rel=1e-6)
    base = inv_freq[-1].double().item() ** (-64 / 62)  # inv_freq[-1] = b'^(-(d-2)/d)
    assert base == pytest.approx(74534.83, rel=1e-5)
    for seq_len in (1, 1000, 2048):  # b' = b within the trained length
        assert torch.equal(fn(64, 1e4, 2048, seq_len, factor=2.0, original_max_len=2048)[0], DEFAULT)


def test_llama3_vector() -> None:
    inv_freq, attention = ROPE_SCALINGS["llama3"](
        128, 5e5, 131072, 131072, factor=8.0, original_max_len=8192, low_freq_factor=1.0, high_freq_factor=4.0
    )
    default = 1.0 / (5e5 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    assert attention == 1.0
    assert torch.equal(inv_freq[:29], default[:29])
    torch.testing.assert_close(inv_freq[35:], default[35:] / 8, rtol=1e-6, atol=0)
    ratios = torch.tensor([1.207484, 1.553415, 2.026313, 2.694530, 3.684253, 5.257327])
    torch.testing.assert_close(default[29:35] / inv_freq[29:35], ratios, rtol=2e-6, atol=0)


# ---- parity with transformers 5.24 ROPE_INIT_FUNCTIONS -------------------------------------------------------

# (HF rope_type, HF rope_parameters, lmlab spec, head_dim, base, rotary_pct, max_position_embeddings, seq_len)
HF_CASES = {
    "linear": ("linear", {"factor": 4.0}, {"name": "linear", "factor": 4.0}, 64, 1e4, 1.0, 2048, None),
    "linear_partial": ("linear", {"factor": 2.5}, {"name": "linear", "factor": 2.5}, 128, 5e5, 0.25, 4096, None),
    "dynamic_long": (
        "dynamic", {"factor": 2.0}, {"name": "dynamic_ntk", "factor": 2.0, "original_max_len": 2048},
        64, 1e4, 1.0, 2048, 8192,
    ),
    "dynamic_short": (
        "dynamic", {"factor": 2.0}, {"name": "dynamic_ntk", "factor": 2.0, "original_max_len": 2048},
        64, 1e4, 1.0, 2048, 1000,
    ),
    "dynamic_factor1_partial": (
        "dynamic", {"factor": 1.0}, {"name": "dynamic_ntk", "original_max_len": 1024}, 128, 5e5, 0.5, 1024, 3000,
    ),
    "yarn": (
        "yarn", {"factor": 4.0, "original_max_position_embeddings": 2048},
        {"name": "yarn", "factor": 4.0, "original_max_len": 2048}, 64, 1e4, 1.0, 8192, None,
    ),
    "yarn_factor_from_lengths": (
        "yarn", {"factor": None, "original_max_position_embeddings": 2048},
        {"name": "yarn", "original_max_len": 2048}, 64, 1e4, 1.0, 16384, None,
    ),
    "yarn_mscale": (
        "yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"name": "yarn", "factor": 40.0, "original_max_len": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
        128, 1e4, 1.0, 163840, None,
    ),
    "yarn_untruncated_partial": (
        "yarn",
        {"factor": 3.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0, "beta_slow": 2.0,
         "attention_factor": 1.25, "truncate": False},
        {"name": "yarn", "factor": 3.0, "original_max_len": 1024, "beta_fast": 16.0, "beta_slow": 2.0,
         "attention_factor": 1.25, "truncate": False},
        128, 1e4, 0.5, 4096, None,
    ),
    "yarn_high_clamped": (  # small base: high > d-1, clamped like HF
        "yarn", {"factor": 2.0, "original_max_position_embeddings": 32768},
        {"name": "yarn", "factor": 2.0, "original_max_len": 32768}, 32, 50.0, 1.0, 65536, None,
    ),
    "ntk_by_parts": (
        "yarn", {"factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.0},
        {"name": "ntk_by_parts", "factor": 8.0, "original_max_len": 512}, 64, 1e4, 1.0, 4096, None,
    ),
    "llama3_31": (
        "llama3",
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"name": "llama3", "factor": 8.0, "original_max_len": 8192}, 128, 5e5, 1.0, 131072, None,
    ),
    "llama3_other": (
        "llama3",
        {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 1024},
        {"name": "llama3", "factor": 4.0, "original_max_len": 1024, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
        64, 1e4, 1.0, 4096, None,
    ),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_parity_with_transformers(case: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type, hf_params, spec, head_dim, base, pct, max_pos, seq_len = HF_CASES[case]
    rope = {"rope_type": rope_type, "rope_theta": base, **hf_params}
    if pct != 1.0:
        rope["partial_rotary_factor"] = pct
    config = transformers.LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=max_pos,
        rope_parameters=rope,
    )
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    inv_freq, attention = rope_frequencies(head_dim, base, spec, max_seq_len=max_pos, seq_len=seq_len, rotary_pct=pct)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == hf_inv_freq.shape
    assert torch.equal(inv_freq, hf_inv_freq)  # same float32 expressions: bit for bit
    assert attention == pytest.approx(hf_attention, rel=1e-12)


# ---- the traps --------------------------------------------------------------------------------------------------


def test_yarn_ramp_uses_original_length_and_base() -> None:
    """With factor and original_max_len fixed, the length the model runs at now must not move the ramp."""
    runs = [ROPE_SCALINGS["yarn"](DIM, BASE, n, n, factor=4.0, original_max_len=L) for n in (L, 4 * L, 64 * L)]
    assert all(torch.equal(inv_freq, runs[0][0]) and a == runs[0][1] for inv_freq, a in runs)
    # factor: null follows max_seq_len / original_max_len, with the same ramp
    assert torch.equal(ROPE_SCALINGS["yarn"](DIM, BASE, 4 * L, 4 * L, original_max_len=L)[0], runs[0][0])
    # the ramp edges come from L and the *original* base: pairs <= low untouched, pairs >= high divided by s
    low, high = yarn_correction_range(DIM, BASE, L)
    assert torch.equal(runs[0][0][: low + 1], DEFAULT[: low + 1])
    torch.testing.assert_close(runs[0][0][high:], DEFAULT[high:] / 4, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", DYNAMIC)
def test_dynamic_is_default_within_trained_length(name: str) -> None:
    fn = ROPE_SCALINGS[name]
    for seq_len in (1, L // 2, L):
        inv_freq, attention = fn(DIM, BASE, 8 * L, seq_len, original_max_len=L)
        assert torch.equal(inv_freq, DEFAULT) and attention == 1.0
    inv_freq, _ = fn(DIM, BASE, 8 * L, L + 1, original_max_len=L)
    assert not torch.equal(inv_freq, DEFAULT)
    assert (inv_freq <= DEFAULT).all()


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_dynamic_flag_only_on_dynamic_options(name: str) -> None:
    assert getattr(ROPE_SCALINGS[name], "dynamic", False) is name.startswith("dynamic_")


@pytest.mark.parametrize("name", sorted(set(ROPE_SCALINGS) - set(DYNAMIC)))
def test_static_options_ignore_seq_len(name: str) -> None:
    fn, kw = ROPE_SCALINGS[name], {} if name == "none" else {"original_max_len": L}
    a, b = fn(DIM, BASE, 4 * L, 1, **kw), fn(DIM, BASE, 4 * L, 64 * L, **kw)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_scale_one_is_identity(name: str) -> None:
    """At the trained length (factor null) every option is plain RoPE, bit for bit, with attention factor 1."""
    inv_freq, attention = _at(name, L)
    assert torch.equal(inv_freq, DEFAULT) and attention == 1.0


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_every_option_but_none_scales_at_4x(name: str) -> None:
    inv_freq, attention = _at(name, 4 * L)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (DIM // 2,) and isinstance(attention, float)
    assert torch.equal(inv_freq, DEFAULT) is (name == "none")
    # every scheme divides each frequency by something in [1, s]: it never raises a frequency
    assert (inv_freq <= DEFAULT).all() and (inv_freq >= DEFAULT / 4 * (1 - 1e-6)).all()


def test_linear_is_default_over_s() -> None:
    for s in (1.5, 4.0, 32.0):
        assert torch.equal(ROPE_SCALINGS["linear"](DIM, BASE, L, L, factor=s)[0], DEFAULT / s)


def test_ntk_lowest_frequency_over_s_highest_unchanged() -> None:
    for s in (2.0, 4.0, 16.0):
        inv_freq, attention = ROPE_SCALINGS["ntk"](DIM, BASE, L, L, factor=s)
        assert attention == 1.0 and inv_freq[0] == DEFAULT[0] == 1.0
        assert inv_freq[-1].item() == pytest.approx(DEFAULT[-1].item() / s, rel=1e-6)
        ratio = DEFAULT / inv_freq  # s^(2j/(d-2)): grows from 1 to s
        assert (ratio[1:] > ratio[:-1]).all()


def test_dynamic_ntk_with_factor_one_is_ntk_at_current_length() -> None:
    dynamic, _ = ROPE_SCALINGS["dynamic_ntk"](DIM, BASE, L, 4 * L, original_max_len=L)
    static, _ = ROPE_SCALINGS["ntk"](DIM, BASE, L, L, factor=4.0)
    torch.testing.assert_close(dynamic, static, rtol=1e-6, atol=0)


def test_yarn_attention_factor_and_ntk_by_parts() -> None:
    for s in (1.5, 2.0, 4.0, 16.0, 40.0):
        inv_freq, attention = ROPE_SCALINGS["yarn"](DIM, BASE, L, L, factor=s, original_max_len=L)
        assert attention == pytest.approx(0.1 * math.log(s) + 1, rel=1e-12)
        parts, parts_attention = ROPE_SCALINGS["ntk_by_parts"](DIM, BASE, L, L, factor=s, original_max_len=L)
        assert torch.equal(parts, inv_freq) and parts_attention == 1.0


def test_dynamic_yarn_is_yarn_at_current_length() -> None:
    dynamic = ROPE_SCALINGS["dynamic_yarn"](DIM, BASE, L, 4 * L, original_max_len=L)
    static = ROPE_SCALINGS["yarn"](DIM, BASE, 4 * L, 4 * L, factor=4.0, original_max_len=L)
    assert torch.equal(dynamic[0], static[0]) and dynamic[1] == static[1]


# ---- YAML files and rope_frequencies ----------------------------------------------------------------------------


def test_yaml_files_match_registry() -> None:
    assert sorted(p.stem for p in CONF.glob("*.yaml")) == sorted(ROPE_SCALINGS)


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_yaml_keys_are_accepted_and_default_to_identity(name: str) -> None:
    spec = OmegaConf.load(CONF / f"{name}.yaml")
    assert spec.name == name
    option_params("rope_scaling", ROPE_SCALINGS, spec)  # raises on a key the function does not take
    inv_freq, attention = rope_frequencies(DIM, BASE, spec, max_seq_len=L)  # trained length: plain RoPE
    assert torch.equal(inv_freq, DEFAULT) and attention == 1.0


def test_rope_frequencies_defaults() -> None:
    assert torch.equal(rope_frequencies(DIM, BASE, max_seq_len=L)[0], DEFAULT)
    assert rotary_dim(64, 0.25) == 16 and rotary_dim(64, 0.3) == 18  # int(19.2) rounded down to even
    inv_freq, _ = rope_frequencies(64, BASE, {"name": "linear", "factor": 2.0}, max_seq_len=L, rotary_pct=0.3)
    torch.testing.assert_close(inv_freq, 1.0 / (BASE ** (torch.arange(0, 18, 2).float() / 18)) / 2, rtol=0, atol=0)
    spec = {"name": "dynamic_ntk", "original_max_len": L}  # seq_len defaults to max_seq_len
    assert torch.equal(
        rope_frequencies(DIM, BASE, spec, max_seq_len=4 * L)[0],
        rope_frequencies(DIM, BASE, spec, max_seq_len=4 * L, seq_len=4 * L)[0],
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(scaling={"name": "rope2"}), r"rope_scaling='rope2'.*yarn"),
        (dict(scaling={"name": "yarn", "bogus": 1}), r"rope_scaling='yarn'.*bogus"),
        (dict(scaling={"name": "dynamic_yarn", "factor": 2.0}), r"rope_scaling='dynamic_yarn'.*factor"),
        (dict(head_dim=2, rotary_pct=0.5), r"position\.rotary_pct"),
        (dict(rotary_pct=1.5), r"position\.rotary_pct"),
        (dict(scaling={"name": "llama3", "low_freq_factor": 4.0}), r"rope_scaling\.high_freq_factor"),
        (dict(scaling={"name": "yarn", "original_max_len": 0}), r"rope_scaling\.original_max_len"),
    ],
)
def test_bad_input_names_the_key(kwargs: dict, match: str) -> None:
    kwargs = {"head_dim": DIM, "base": BASE, "max_seq_len": L, **kwargs}
    with pytest.raises(ValueError, match=match):
        rope_frequencies(**kwargs)


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_odd_rotary_dim_names_the_key(name: str) -> None:
    with pytest.raises(ValueError, match=r"position\.rotary_pct"):
        ROPE_SCALINGS[name](DIM - 1, BASE, L, L)


@pytest.mark.parametrize("name", WITH_FACTOR)
def test_factor_below_one_names_the_key(name: str) -> None:
    with pytest.raises(ValueError, match=r"rope_scaling\.factor"):
        rope_frequencies(DIM, BASE, {"name": name, "factor": 0.5}, max_seq_len=4 * L, seq_len=4 * L)


# ---- YaRN's ramp: the paper's Definition 2 (linear in r = L/λ) as an option --------------------------------------


def test_yarn_ratio_ramp_is_the_papers_definition_2() -> None:
    """d 8, base 1e4, L 64, s 4, α = 1, β = 32: θ_j = 1e4^(−2j/8), r_j = 64·θ_j/(2π), γ = clamp((r − 1)/31, 0, 1),
    θ'_j = (1 − γ)·θ_j/4 + γ·θ_j, worked out here pair by pair."""
    from lmlab.model.rope_scaling import yarn

    expected = []
    for j in range(4):
        theta = 1e4 ** (-2 * j / 8)
        r = 64 * theta / (2 * math.pi)
        gamma = min(max((r - 1) / 31, 0.0), 1.0)
        expected.append((1 - gamma) * theta / 4 + gamma * theta)
    # r = 10.19, 1.019, 0.102, 0.0102: pair 0 on the ramp, pair 1 just on it, pairs 2 and 3 fully interpolated
    inv_freq, attention = yarn(8, 1e4, 256, 256, factor=4.0, original_max_len=64, ramp="ratio")
    torch.testing.assert_close(inv_freq, torch.tensor(expected), rtol=1e-6, atol=0)
    assert attention == pytest.approx(0.1 * math.log(4) + 1)


def test_the_two_ramps_agree_outside_the_ramp_and_differ_on_it() -> None:
    from lmlab.model.rope_scaling import ntk_by_parts

    d, base, L, s = 64, 1e4, 2048, 4.0
    index, _ = ntk_by_parts(d, base, 8192, 8192, factor=s, original_max_len=L)
    ratio, _ = ntk_by_parts(d, base, 8192, 8192, factor=s, original_max_len=L, ramp="ratio")
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    r = L * theta / (2 * math.pi)
    fast, slow = r > 64, r < 0.5  # well past either end of the ramp
    torch.testing.assert_close(ratio[fast].double(), theta[fast], rtol=1e-6, atol=0)
    torch.testing.assert_close(index[fast].double(), theta[fast], rtol=1e-6, atol=0)
    torch.testing.assert_close(ratio[slow].double(), theta[slow] / s, rtol=1e-6, atol=0)
    torch.testing.assert_close(index[slow].double(), theta[slow] / s, rtol=1e-6, atol=0)
    assert ((ratio - index).abs() / index).max() > 0.3  # inside the ramp the paper's and HF's differ a lot


def test_the_ratio_ramp_is_refused_by_the_transformers_export() -> None:
    from lmlab.config import GPTConfig
    from lmlab.interop.hf import NotRepresentable, hf_config
    from lmlab.model.resolve import resolve

    cfg = resolve(GPTConfig(vocab_size=20, n_layer=1, d_model=32, n_head=4, max_seq_len=32, train_len=16,
                    norm={"name": "rms"}, ffn={"name": "swiglu"}, position={"name": "rope"},
                    rope_scaling={"name": "yarn", "factor": 2.0, "ramp": "ratio"}))
    with pytest.raises(NotRepresentable, match="rope_scaling.ramp='ratio'"):
        hf_config(cfg)
