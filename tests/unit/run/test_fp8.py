"""FP8 per module (lmlab.run.fp8, `precision.fp8`), on the CPU through torchao's emulation: which Linear layers each
kind and the floor pick, counted by hand on small models; that a converted model's loss is FP8's (close to fp32's, not
equal to it), its gradients reach every converted weight and it learns; the keys refused by name; and train.py with
precision.fp8=[mlp] completing, the converted layers in its summary."""

from __future__ import annotations

import json
import math
import typing
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lmlab import build_model, compose
from lmlab.run import fp8

pytest.importorskip("torchao")

SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=16", "model.vocab_size=64"]
MLP = ["h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.1.mlp.c_fc", "h.1.mlp.c_proj"]
QKV = ["h.0.attn.c_attn", "h.1.attn.c_attn"]
PROJ = ["h.0.attn.c_proj", "h.1.attn.c_proj"]


def _cfg(*overrides: str):
    return compose([*SMALL, *overrides])


def _converted(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)


@pytest.mark.parametrize("kinds, expected", [
    ("[mlp]", MLP),
    ("[attn_qkv]", QKV),
    ("[attn_proj]", PROJ),
    ("[mlp,attn_qkv,attn_proj]", ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj",
                                  "h.1.attn.c_attn", "h.1.attn.c_proj", "h.1.mlp.c_fc", "h.1.mlp.c_proj"]),
])
def test_each_kind_converts_exactly_its_layers_and_never_the_head(kinds: str, expected: list[str]) -> None:
    """GPT-2's blocks at d 64: c_attn (192, 64), c_proj (64, 64), c_fc (256, 64), c_proj (64, 256), all over a floor
    of 64; the head (64, 64) is never one of them."""
    cfg = _cfg(f"precision.fp8={kinds}", "precision.fp8_min_features=64")
    model = build_model(cfg)
    assert fp8.apply(model, cfg) == expected
    assert _converted(model) == expected
    assert type(model.lm_head) is nn.Linear
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert len(kept) == 9 - len(expected)  # 4 per layer and the head, the rest as they were


def test_the_floor_and_the_multiple_of_16_leave_small_layers_as_they_were() -> None:
    """MLA with a latent of 32 at d 64, 2 heads of 32 (RoPE part 16): q_proj (96, 64), kv_a (48, 64), kv_b (128, 32).
    A floor of 64 takes q_proj alone, 32 all three, 128 none (and says so). SwiGLU's matched hidden at d 64 is 172
    (c_fc 344 × 64, c_proj 64 × 172): not multiples of 16, so no floor converts them."""
    mla = ["attention=mla", "attention.kv_lora_rank=32", "precision.fp8=[attn_qkv]"]
    for floor, layers in ((64, ["q_proj"]), (32, ["q_proj", "kv_a", "kv_b"]), (16, ["q_proj", "kv_a", "kv_b"])):
        cfg = _cfg(*mla, f"precision.fp8_min_features={floor}")
        assert fp8.apply(build_model(cfg), cfg) == [f"h.{i}.attn.{n}" for i in range(2) for n in layers], floor
    for cfg in (_cfg(*mla, "precision.fp8_min_features=128"),
                _cfg("ffn=swiglu", "precision.fp8=[mlp]", "precision.fp8_min_features=16")):
        model = build_model(cfg)
        with pytest.warns(UserWarning, match=r"precision.fp8=\[.*\] converted no layer.*fp8_min_features"):
            assert fp8.apply(model, cfg) == []
        assert _converted(model) == []


def test_an_moes_experts_and_router_stay_its_shared_expert_converts() -> None:
    """ffn=moe: the routed experts (Experts, applied grouped) and the router are not Linear layers of a kind; the
    shared expert is a dense MLP (256, 64) and (64, 256), which `mlp` takes. The model still runs."""
    cfg = _cfg("ffn=moe", "ffn.expert=mlp", "ffn.n_shared=1", "precision.fp8=[mlp]", "precision.fp8_min_features=64")
    model = build_model(cfg)
    assert fp8.apply(model, cfg) == [f"h.{i}.mlp.shared.{n}" for i in range(2) for n in ("c_fc", "c_proj")]
    for block in model.h:
        assert type(block.mlp.router) is nn.Linear and type(block.mlp.c_fc).__name__ == "Experts"
    x, y = _batch()
    assert torch.isfinite(model(x, y))


def test_the_converted_model_computes_fp8s_loss_and_every_converted_weight_gets_its_gradient() -> None:
    """Every block Linear in FP8 (emulated: e4m3 inputs and weights, e5m2 gradients, one scale per tensor): the loss
    within 5% of the fp32 model's with the same weights, and not equal to it (FP8 ran); each converted weight's
    gradient finite, non-zero and pointing the fp32 gradient's way; the same Parameters, state-dict keys and marks."""
    cfg = _cfg("precision.fp8=[mlp,attn_qkv,attn_proj]", "precision.fp8_min_features=16")
    ref, model = build_model(cfg), build_model(cfg)
    model.load_state_dict(ref.state_dict())
    weights = {n: p for n, p in model.named_parameters()}
    names = fp8.apply(model, cfg)
    assert len(names) == 8 and dict(model.named_parameters()) == weights  # the same objects: the optimizer's
    assert model.state_dict().keys() == ref.state_dict().keys()  # checkpoints load into a model without FP8
    assert model.h[0].attn.c_attn.fused == ref.h[0].attn.c_attn.fused  # the marks lmlab's code reads went along
    assert model.h[0].mlp.c_proj.is_residual_proj
    x, y = _batch()
    loss, loss_ref = model(x, y), ref(x, y)
    assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 5e-2
    assert loss.item() != loss_ref.item()
    loss.backward()
    loss_ref.backward()
    ref_params = dict(ref.named_parameters())
    for name in names:
        g, g_ref = model.get_submodule(name).weight.grad, ref_params[f"{name}.weight"].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
        assert torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0) > 0.9, name


def test_the_fp8_model_learns_a_batch_as_the_fp32_one_does() -> None:
    """30 AdamW steps on one batch: FP8's loss falls as fp32's does (both below half the start, within 10%)."""
    cfg = _cfg("precision.fp8=[mlp,attn_qkv,attn_proj]", "precision.fp8_min_features=16")
    ref, model = build_model(cfg), build_model(cfg)
    model.load_state_dict(ref.state_dict())
    fp8.apply(model, cfg)
    x, y = _batch()
    final = []
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        start = m(x, y).item()
        for _ in range(30):
            opt.zero_grad()
            loss = m(x, y)
            loss.backward()
            opt.step()
        final.append(loss.item())
        assert loss.item() < 0.5 * start
    assert abs(final[1] - final[0]) / final[0] < 0.1, final


@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "tensorwise"), ("rowwise", "axiswise"),
                                                 ("rowwise_with_gw_hp", "axiswise")])
def test_the_recipe_sets_torchaos_scaling_and_the_cpu_emulates(recipe: str, granularity: str) -> None:
    cfg = _cfg("precision.fp8=[mlp]", "precision.fp8_min_features=16", f"precision.fp8_recipe={recipe}")
    model = build_model(cfg)
    fp8.apply(model, cfg)
    layer = model.h[0].mlp.c_fc
    assert layer.config.emulate  # no FP8 GPU here: torchao's emulation
    assert layer.config.cast_config_input.scaling_granularity.value == granularity
    x, y = _batch()
    model(x, y).backward()
    assert layer.weight.grad.abs().sum() > 0


def test_on_an_fp8_gpu_the_matmuls_are_real_and_an_older_gpu_is_refused(monkeypatch) -> None:
    """trainer.accelerator=gpu: FP8 tensor-core matmuls (no emulation) at compute capability 9.0; 8.0 (an A100) is
    refused by the check, naming the key; trainer.accelerator=cpu on a machine with a GPU emulates."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cfg = _cfg("precision.fp8=[mlp]", "precision.fp8_min_features=16", "trainer.accelerator=gpu")
    fp8.check(cfg)
    model = build_model(cfg)  # built on the CPU, as train.py builds it before Lightning moves it
    fp8.apply(model, cfg)
    assert not model.h[0].mlp.c_fc.config.emulate
    cpu = _cfg("precision.fp8=[mlp]", "precision.fp8_min_features=16", "trainer.accelerator=cpu")
    model = build_model(cpu)
    fp8.apply(model, cpu)
    assert model.h[0].mlp.c_fc.config.emulate
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"precision.fp8=\['mlp'\] needs a GPU with FP8 matmuls .* this one is 8\.0"):
        fp8.check(cfg)
    fp8.check(_cfg("trainer.accelerator=gpu"))  # FP8 off: any GPU


@pytest.mark.parametrize("override, message", [
    ("precision.fp8=[mlpp]", r"precision.fp8: 'mlpp' is not a kind .* takes mlp, attn_qkv, attn_proj"),
    ("precision.fp8=[mlp,attention]", r"precision.fp8: 'attention' is not a kind .* takes mlp, attn_qkv, attn_proj"),
    ("precision.fp8=[head]", r"precision.fp8: 'head' stays out of FP8 .* takes mlp, attn_qkv, attn_proj"),
    ("precision.fp8=3", r"precision.fp8=3 must be a list of kinds .* mlp, attn_qkv, attn_proj"),
    ("precision.fp8_min_features=0", r"precision.fp8_min_features=0 must be an integer >= 1"),
    ("precision.fp8_recipe=delayed", r"precision.fp8_recipe='delayed' must be one of .*tensorwise.*rowwise"),
])
def test_a_bad_precision_key_is_refused_before_training_by_name(override: str, message: str) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(_cfg(override))  # among the run's checks, before anything is built
    check_config(_cfg("precision.fp8=mlp", "precision.fp8_min_features=16"))  # one kind alone is a list of it


def test_without_torchao_fp8_is_refused_naming_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError, match=r"precision.fp8 needs torchao.*pip install -e \.\[fp8\]"):
        fp8.check(_cfg("precision.fp8=[mlp]"))
    fp8.check(_cfg())  # FP8 off (the default): torchao is not needed


def test_fp8_off_converts_nothing() -> None:
    cfg = _cfg()
    assert list(cfg.precision.fp8) == [] and cfg.precision.fp8_min_features == fp8.MIN_FEATURES
    model = build_model(cfg)
    assert fp8.apply(model, cfg) == [] and _converted(model) == []


def test_a_training_run_records_the_converted_layers_and_its_checkpoint_loads_without_fp8(corpus: Path,
                                                                                         tmp_path: Path) -> None:
    """train() (what train.py runs) with precision.fp8=[mlp] on the tiny run (d 32, MLP hidden 128): the four FFN
    matrices convert at a floor of 32, the run completes with a finite val loss and summary.json lists them; its
    checkpoint builds the plain model eval.py and export read, and a resume goes on in FP8."""
    from lmlab.record.rundir import load_model
    from lmlab.record.summary import RunSummary
    from lmlab.run.training import train
    from tests.runs import tiny

    run, cache = tmp_path / "run", tmp_path / "cache"
    fp8_on = ["precision.fp8=[mlp]", "precision.fp8_min_features=32"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = train(compose(tiny(corpus, cache, "trainer.max_steps=10", *fp8_on)), run)
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert json.loads((run / "summary.json").read_text())["fp8"] == MLP
    assert set(summary) <= set(typing.get_type_hints(RunSummary))  # declared, as summary.json's readers rely on
    assert summary["final_val_loss"] is not None and math.isfinite(summary["final_val_loss"])
    model = load_model(run)  # strict load of the FP8 run's weights into a model without FP8
    assert _converted(model) == [] and type(model.h[0].mlp.c_fc) is nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = train(compose(tiny(corpus, cache, "trainer.max_steps=15", *fp8_on)), run)
    assert resumed["status"] == "completed" and resumed["steps"] == 15 and resumed["fp8"] == MLP
    assert [(a["from_step"], a["to_step"]) for a in resumed["attempts"]] == [(0, 10), (10, 15)]


@pytest.mark.slow
def test_the_conversion_after_litgpt_is_built_is_what_its_compiled_forward_runs() -> None:
    """training.py converts after LitGPT has wrapped the model in torch.compile: the wrapper traces at its first call,
    so the compiled forward is the FP8 model's (its loss equal to the eager converted model's, not the fp32 one's)."""
    from lmlab.config import arch_config
    from lmlab.run.lit import LitGPT

    cfg = _cfg("model.n_layer=1", "precision.fp8=[mlp,attn_qkv,attn_proj]", "precision.fp8_min_features=16")
    lit = LitGPT(model=arch_config(cfg, vocab_size=64).to_dict(), optim=dict(cfg.optim), schedule=dict(cfg.schedule),
                 max_steps=10, compile=True)
    x, y = _batch()
    before = lit.model(x, y).item()
    assert len(fp8.apply(lit.model, cfg)) == 4
    eager = lit.model(x, y).item()
    assert eager != before
    assert lit.forward_fn(x, y).item() == pytest.approx(eager, abs=1e-5)


@pytest.mark.e2e
def test_train_py_with_fp8_on_the_mlp_completes(corpus: Path, tmp_path: Path) -> None:
    """`python train.py ... precision.fp8=[mlp]` as a user types it: status completed, the converted layers recorded."""
    from tests.runs import ROOT, cli, tiny

    run = tmp_path / "run"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=10"), "precision.fp8=[mlp]",
              "precision.fp8_min_features=32", f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10 and summary["fp8"] == MLP
