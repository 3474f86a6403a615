"""The spike-skip rule (lmlab.run.spikes, `spike_skip:`): which steps of a hand-made sequence it skips, from means and
standard deviations worked out by hand; the keys it refuses; its state across a resume; and the skip itself, which
leaves every optimizer's parameters and state bit-identical while the next step proceeds."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.run.spikes import SpikeSkip, check_spike_skip, restore_groups, skip_update


def _skipped(rule: SpikeSkip, losses: list[float], start: int = 0, **other: list[float]) -> list[int]:
    for step, loss in enumerate(losses, start=start):
        rule.check(step, loss=loss, **{k: v[step - start] for k, v in other.items()})
    return rule.skipped


def test_a_step_above_mean_plus_sigma_std_of_the_window_is_skipped_and_stays_in_the_window() -> None:
    losses = [1.0, 2.0, 3.0, 4.0, 5.5, 6.5, 0.5]
    # step 3: window (1, 2, 3): mean 2, sample std 1, limit 2 + 2·1 = 4; 4.0 is not above it: kept
    # step 4: window (2, 3, 4): mean 3, std 1, limit 5: 5.5 skipped
    # step 5: window (3, 4, 5.5), the skipped value in it (OLMo's): mean 12.5/3, std √(19/12) ≈ 1.258, limit ≈ 6.683:
    #         6.5 kept (without 5.5 in the window, (2, 3, 4)'s limit 5 would have skipped it)
    # step 6: window (4, 5.5, 6.5): 0.5 is far below the mean, and only spikes up are skipped
    rule = SpikeSkip(window=3, sigma=2.0, watch=["loss"])
    assert rule.threshold("loss") is None  # an empty window judges nothing
    assert _skipped(rule, losses) == [4]
    # now (5.5, 6.5, 0.5): mean 25/6, deviations 4/3, 7/3, −11/3, variance (16 + 49 + 121)/9/2 = 31/3
    assert rule.threshold("loss") == pytest.approx(25 / 6 + 2 * math.sqrt(31 / 3), rel=1e-12)


def test_nothing_is_skipped_before_the_window_holds_min_steps_values() -> None:
    losses = [1.0, 2.0, 3.0, 4.0]
    # min_steps 2: step 2 is judged on (1, 2): mean 1.5, std √0.5, limit 1.5 + 2·0.7071 ≈ 2.914 < 3: skipped
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"], min_steps=2), losses) == [2]
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"]), losses) == []  # min_steps null: a full window
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"]), [1.0, 1e9, 1.0]) == []  # before it fills


def test_either_watched_value_skips_a_step() -> None:
    loss = [2.0, 2.0, 2.0, 2.0, 2.0]
    norm = [1.0, 2.0, 3.0, 5.0, 3.0]  # step 3: window (1, 2, 3), limit 4: 5 skipped
    assert _skipped(SpikeSkip(window=3, sigma=2.0), loss, grad_norm=norm) == [3]
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"]), loss, grad_norm=norm) == []
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["grad_norm"]), loss, grad_norm=norm) == [3]
    # a constant window has std 0: anything above its mean is a spike
    assert _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"]), [2.0, 2.0, 2.0, 2.0 + 1e-9]) == [3]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_value_is_skipped_and_never_joins_the_window(bad: float) -> None:
    rule = SpikeSkip(window=3, sigma=2.0, watch=["grad_norm"])
    assert _skipped(rule, [2.0] * 5, grad_norm=[1.0, bad, 2.0, 3.0, 4.0]) == [1]  # even before the window fills
    assert list(rule.windows["grad_norm"]) == [2.0, 3.0, 4.0]  # step 4: window (1, 2, 3), limit 4: 4 is kept


def test_a_resumed_rule_goes_on_with_the_saved_windows_and_skips() -> None:
    losses = [1.0, 2.0, 3.0, 4.0, 5.5, 6.5, 9.0]
    straight = _skipped(SpikeSkip(window=3, sigma=2.0, watch=["loss"]), losses)
    first = SpikeSkip(window=3, sigma=2.0, watch=["loss"])
    _skipped(first, losses[:5])
    resumed = SpikeSkip(window=3, sigma=2.0, watch=["loss"])
    resumed.load_state_dict(first.state_dict())
    resumed.load_state_dict(first.state_dict())  # LitGPT's state is loaded twice on a resume: no doubled values
    assert list(resumed.windows["loss"]) == [3.0, 4.0, 5.5] and resumed.skipped == [4]
    assert _skipped(resumed, losses[5:], start=5) == straight == [4, 6]
    fresh = SpikeSkip(window=3, sigma=2.0, watch=["loss"])  # without the saved window: nothing judged at 6
    assert _skipped(fresh, losses[5:], start=5) == []


@pytest.mark.parametrize("key, value, message", [
    ("window", 1, r"spike_skip.window=1 must be an integer >= 2"),
    ("sigma", 0, r"spike_skip.sigma=0 must be a float > 0"),
    ("sigma", -1.0, r"spike_skip.sigma=-1.0 must be a float > 0"),
    ("watch", [], r"spike_skip.watch=\[\] watches nothing"),
    ("watch", ["loss", "lr"], r"spike_skip.watch=\['loss', 'lr'\] must be"),
    ("min_steps", 1, r"spike_skip.min_steps=1 must be"),
    ("min_steps", 200, r"spike_skip.min_steps=200 must be <= spike_skip.window=128"),
    ("enabled", "yes", r"spike_skip.enabled='yes' must be"),
])
def test_bad_keys_are_refused_by_name(key: str, value, message: str) -> None:
    block = OmegaConf.to_container(compose([])["spike_skip"])
    check_spike_skip(block)  # the defaults pass
    with pytest.raises(ValueError, match=message):
        check_spike_skip({**block, key: value})


def test_the_run_checks_refuse_a_bad_key_before_training() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"spike_skip.window=1 must be"):
        check_config(compose(["spike_skip.enabled=true", "spike_skip.window=1"]))


# ---- the skip: no parameter, no optimizer state moves ----------------------------------------------------------


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _optimizers() -> list[str]:
    from lmlab.optim import OPTIMIZERS

    return sorted(OPTIMIZERS)


@pytest.mark.parametrize("name, extra", [(n, []) for n in _optimizers()] + [("adamw", ["optim.fused=false"])])
def test_a_skipped_update_leaves_parameters_and_optimizer_state_bit_identical(name: str, extra: list[str]) -> None:
    """Every registered optimizer: after two real steps, a skipped one (its gradients dropped, its group settings put
    back) changes no parameter and no entry of the optimizer's state (AdamW: step, exp_avg, exp_avg_sq; Muon's and
    schedule-free's per-group step counters); the next step then moves the parameters as usual."""
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT
    from lmlab.run.lit import configure_optimization

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16))
    optim = OmegaConf.to_container(compose([f"optim={name}", *extra]).optim, resolve=True)
    out = configure_optimization(model, optim, {"name": "cosine", "warmup_steps": 2}, 10)
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    x = torch.randint(0, 50, (2, 16))

    def backward() -> None:
        opt.zero_grad()
        model(x, x).backward()

    for _ in range(2):
        backward(), opt.step(), sched.step()
    params, state = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    backward()
    kept = skip_update(opt)
    opt.step()
    restore_groups(opt, kept)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert _same(opt.state_dict(), state)
    if name == "adamw":
        first = opt.state[next(model.parameters())]
        assert float(first["step"]) == 2  # the skipped step is not counted

    backward(), opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert not _same(opt.state_dict(), state)
