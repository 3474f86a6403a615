"""The GPU's own paths, on a CUDA device (`pytest -m gpu`; skipped, saying why, on a machine without one): the model's
logits and gradients on CUDA against the CPU's, FlexAttention (the GPU's path for windows, documents and softcaps,
with its backward) against lmlab's banded path, MoE's grouped matmul in bf16 against the padded batched matmul, and
torch.compile against eager. The CPU tests check the same paths where the CPU runs them (tests/unit/model/attention/test_flex.py,
tests/unit/model/test_moe.py, tests/unit/model/test_compile.py); scripts/bench_gpu.sh measures their speed."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model import moe as moe_mod
from lmlab.model.attention import flex
from lmlab.model.ffn import FFNS
from lmlab.model.gpt import GPT, validate
from lmlab.registry import build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BASE = dict(vocab_size=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=64)


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 matmuls in full precision (no TF32), so that CUDA and the CPU compute the same function."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _grads(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(idx, torch.roll(idx, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", [{}, {"attention": {"name": "gqa"}, "norm": {"name": "rms"},
                                       "ffn": {"name": "swiglu"}, "position": {"name": "rope"}}],
                         ids=["gpt2", "llama"])
def test_cuda_computes_the_cpus_logits_and_gradients(arch: dict) -> None:
    torch.manual_seed(0)
    cpu = GPT(validate(GPTConfig(**BASE, **arch)))
    gpu = GPT(validate(GPTConfig(**BASE, **arch))).cuda()
    gpu.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    loss_c, grads_c = _grads(cpu, idx)
    loss_g, grads_g = _grads(gpu, idx.cuda())
    torch.testing.assert_close(loss_g.cpu(), loss_c, rtol=1e-5, atol=1e-5)
    for name, g in grads_c.items():
        torch.testing.assert_close(grads_g[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("attention", [{"name": "mha", "window": 8, "doc_mask": True},
                                       {"name": "gqa", "window": 16, "pattern": ["local", "global"], "softcap": 20.0},
                                       {"name": "mla", "doc_mask": True, "softcap": 30.0}])
def test_flexattention_trains_as_the_banded_path_does(attention: dict, monkeypatch) -> None:
    """On CUDA the masked layers go through FlexAttention, forward and backward; with it turned off they take lmlab's
    banded path: the same loss and gradients."""
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**BASE, "attention": attention, "eod_id": 0}))).cuda()
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
    calls = []
    real = flex.flex_attend
    monkeypatch.setattr("lmlab.model.attention.score.flex_attend", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    loss_f, grads_f = _grads(model, idx)
    assert calls  # FlexAttention ran
    monkeypatch.setattr(flex, "FLEX_DEVICES", set())
    loss_b, grads_b = _grads(model, idx)
    torch.testing.assert_close(loss_f, loss_b, rtol=1e-4, atol=1e-5)
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-3, atol=1e-4, msg=name)


def test_moe_grouped_matmul_in_bf16_equals_the_padded_batched_matmul(monkeypatch) -> None:
    assert moe_mod._grouped_mm_runs("cuda", torch.bfloat16)  # the path the GPU trains MoEs on
    torch.manual_seed(0)
    m = build("ffn", FFNS, {"name": "moe", "n_experts": 8, "top_k": 2, "expert": "swiglu", "n_shared": 1}, 64, 128,
              activation={"name": "silu"}, bias=False).cuda().to(torch.bfloat16)
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    grouped = m(x)
    grouped.float().square().sum().backward()
    grads = {n: p.grad.float().clone() for n, p in m.named_parameters()}
    m.zero_grad()
    monkeypatch.setattr(moe_mod, "_grouped_mm_runs", lambda *a: False)
    loop = m(x)
    loop.float().square().sum().backward()
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad.float(), grads[n], rtol=5e-2, atol=5e-2, msg=n)


def test_compile_on_cuda_gives_the_eager_loss_and_gradients() -> None:
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**BASE, position={"name": "rope"}))).cuda()
    idx = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(3)).cuda()
    loss_e, grads_e = _grads(model, idx)
    compiled = torch.compile(model)
    compiled.zero_grad(set_to_none=True)
    loss_c = compiled(idx, torch.roll(idx, -1, 1))
    loss_c.backward()
    torch.testing.assert_close(loss_c.detach(), loss_e, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads_e[n], rtol=1e-3, atol=1e-5, msg=n)
