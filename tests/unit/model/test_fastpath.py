"""The fast path is the same maths as the slow one: SDPA gets no materialised mask at the default settings and its
gradients equal explicit attention's; GQA broadcasts K/V inside SDPA and equals repeating them; RoPE tables are
cached per length and device; activation checkpointing changes memory, not numbers; a bf16-autocast step stays
close to fp32; and `python -m lmlab.bench` runs end to end with the peers at exactly lmlab's sizes.
(Forward SDPA-vs-explicit for every attention × position is in test_attention.py.) No torch.compile here."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.position import POSITIONS

V, B, T = 50, 2, 12
BASE = dict(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=16)


def _model(**overrides) -> GPT:
    return GPT(GPTConfig(**{**BASE, **overrides}))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


def _loss_and_grads(model: GPT, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _explicit_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v written out, with K/V repeated per group: the reference for SDPA."""
    if enable_gqa:
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    n = q.size(-2)
    if attn_mask is None:
        attn_mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(q @ k.transpose(-2, -1) * scale + attn_mask, dim=-1) @ v


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Record every SDPA call's mask, causal flag and K/V head count."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append({"mask": attn_mask, "is_causal": is_causal, "q_heads": q.size(1), "kv_heads": k.size(1),
                      "enable_gqa": enable_gqa})
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


# ---- SDPA ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", sorted(p for p, cls in POSITIONS.items() if not cls.attention_bytes(1, 8, 1)))
def test_no_materialised_mask_without_a_position_bias(position: str, sdpa_calls: list[dict]) -> None:
    _model(position={"name": position})(torch.randint(0, V, (B, T)))
    assert len(sdpa_calls) == BASE["n_layer"]
    assert all(c["mask"] is None and c["is_causal"] for c in sdpa_calls)


def test_alibi_passes_its_bias_as_the_mask(sdpa_calls: list[dict]) -> None:
    _model(position={"name": "alibi"})(torch.randint(0, V, (B, T)))
    assert all(c["mask"] is not None and not c["is_causal"] for c in sdpa_calls)
    assert sdpa_calls[0]["mask"].shape == (BASE["n_head"], T, T)


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_sdpa_gradients_equal_explicit_attention(position: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same weights, same batch: the loss and every parameter's gradient through SDPA equal those through
    softmax(q kᵀ + mask) v written out (the forward alone is checked in test_attention.py)."""
    model, batch = _model(position={"name": position}, attention={"name": "gqa"}, n_kv_head=2), _batch()
    loss, grads = _loss_and_grads(model, batch)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _explicit_sdpa)
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


# ---- GQA ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("attention", "n_kv"), [("gqa", 2), ("gqa", 1), ("mqa", None)])
def test_gqa_broadcasts_kv_inside_sdpa(attention: str, n_kv: int | None, sdpa_calls: list[dict]) -> None:
    """K and V reach SDPA with their own head count (no repeat_interleave copy) and enable_gqa set."""
    _model(attention={"name": attention}, n_kv_head=n_kv, position={"name": "rope"})(torch.randint(0, V, (B, T)))
    assert all(c["kv_heads"] == (n_kv or 1) and c["q_heads"] == BASE["n_head"] and c["enable_gqa"]
               for c in sdpa_calls)


def test_mha_does_not_ask_for_gqa(sdpa_calls: list[dict]) -> None:
    _model()(torch.randint(0, V, (B, T)))
    assert all(not c["enable_gqa"] and c["kv_heads"] == BASE["n_head"] for c in sdpa_calls)


@pytest.mark.parametrize("n_kv", [1, 2])
def test_enable_gqa_equals_repeated_kv(n_kv: int) -> None:
    """SDPA(q, k, v, enable_gqa) == SDPA(q, repeat(k), repeat(v)), forward and gradients, with query head h
    reading kv head h // group (repeat_interleave, as HF's repeat_kv)."""
    q = torch.randn(B, 4, T, 8, requires_grad=True)
    k, v = (torch.randn(B, n_kv, T, 8, requires_grad=True) for _ in range(2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (gq, gk, gv) = torch.autograd.grad(y.square().sum(), (q, k, v))
    group = 4 // n_kv
    y_ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           is_causal=True)
    (rq, rk, rv) = torch.autograd.grad(y_ref.square().sum(), (q, k, v))
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- RoPE tables ----------------------------------------------------------------------------------------------------


def test_rope_tables_are_cached_once_and_sliced() -> None:
    model = _model(position={"name": "rope"})
    rope = model.pos
    cos, sin = rope.cos_sin(T, torch.device("cpu"), torch.float32)
    again = rope.cos_sin(T, torch.device("cpu"), torch.float32)
    assert again[0].data_ptr() == cos.data_ptr() and again[1].data_ptr() == sin.data_ptr()  # nothing recomputed
    other = rope.cos_sin(T - 2, torch.device("cpu"), torch.float32)
    assert other[0].shape == (T - 2, BASE["d_model"] // BASE["n_head"]) and other[0].data_ptr() == cos.data_ptr()
    torch.testing.assert_close(other[0], cos[: T - 2], rtol=0, atol=0)
    model(torch.randint(0, V, (B, T)))
    model(torch.randint(0, V, (B, T - 3)))
    assert len(rope._cache) == 1  # one table (fp32, CPU) for every length up to the longest, not one per call


# ---- activation checkpointing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"dropout": 0.1}, {"position": {"name": "rope"}, "norm": {"name": "rms"},
                                                             "ffn": {"name": "swiglu"}}])
def test_checkpointing_gives_identical_loss_and_gradients(overrides: dict) -> None:
    plain, ckpt = _model(**overrides), _model(**overrides, checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    batch = _batch()
    torch.manual_seed(1)  # dropout draws the same masks in both (checkpoint restores the RNG for its recompute)
    loss, grads = _loss_and_grads(plain, batch)
    torch.manual_seed(1)
    ckpt_loss, ckpt_grads = _loss_and_grads(ckpt, batch)
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(ckpt_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def _saved_bytes(model: GPT, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward outside checkpointed regions (a checkpoint's own hooks take the rest)."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return sum(saved)


def test_checkpointing_saves_activation_memory() -> None:
    x = torch.randint(0, V, (B, T))
    plain = _saved_bytes(_model(n_layer=4), x)
    ckpt = _saved_bytes(_model(n_layer=4, checkpointing=True), x)
    assert ckpt < plain / 3, (ckpt, plain)


def test_checkpointing_only_when_training_with_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    import lmlab.model.gpt as gpt

    calls = []
    monkeypatch.setattr(gpt, "checkpoint", lambda fn, *a, **kw: calls.append(kw) or fn(*a))
    model, x = _model(checkpointing=True), torch.randint(0, V, (B, T))
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert calls == []
    model.train()
    model(x)
    assert calls == [{"use_reentrant": False}] * BASE["n_layer"]


def test_checkpointing_is_a_model_key_off_by_default() -> None:
    from lmlab import compose
    from lmlab.config import arch_config

    assert arch_config(compose([]), vocab_size=V).checkpointing is False
    assert arch_config(compose(["model.checkpointing=true"]), vocab_size=V).checkpointing is True


# ---- bf16 autocast --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"position": {"name": "rope"}, "norm": {"name": "rms"},
                                           "ffn": {"name": "swiglu"}}])
def test_bf16_autocast_step_is_close_to_fp32(overrides: dict) -> None:
    """A training step under CPU autocast (what trainer.precision=bf16-mixed does): activations in bf16, weights,
    gradients and the loss in fp32, loss within bf16 precision of the fp32 loss; the optimizer step stays finite."""
    model, batch = _model(**overrides), _batch()
    loss32, grads32 = _loss_and_grads(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(batch[0]).dtype == torch.bfloat16
        loss16, grads16 = _loss_and_grads(model, batch)
    assert loss16.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item()
    cos = F.cosine_similarity(torch.cat([g.flatten() for g in grads16.values()]),
                              torch.cat([g.flatten() for g in grads32.values()]), dim=0)
    assert cos > 0.99 and all(g.dtype == torch.float32 for g in grads16.values())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- the benchmark --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["llama", "gpt2"])
def test_bench_peers_have_exactly_lmlab_sizes(config: str) -> None:
    """The comparison is at equal size: the same parameter count and the same FFN width as lmlab's model."""
    pytest.importorskip("transformers")
    from lmlab import compose
    from lmlab.bench import CONFIGS, hf_peer
    from lmlab.config import arch_config

    kind, overrides = CONFIGS[config]
    gcfg = arch_config(compose(overrides + ["model.n_layer=2"]), vocab_size=None)
    with torch.device("meta"):
        ours, peer = GPT(gcfg), hf_peer(kind, gcfg)
    count = sum(p.numel() for p in {id(p): p for p in ours.parameters()}.values())
    assert count == sum(p.numel() for p in {id(p): p for p in peer.parameters()}.values())
    assert (peer.config.intermediate_size if kind == "llama" else peer.config.n_inner) == gcfg.ffn_hidden
    assert (gcfg.d_model, gcfg.n_head, gcfg.max_seq_len, gcfg.vocab_size) == (384, 6, 256, 4096)


@pytest.mark.parametrize(("config", "override", "named"), [("llama", "norm=layer", "'norm': 'layer'"),
                                                          ("gpt2", "position=rope", "'position': 'rope'"),
                                                          ("gpt2", "attention.qk_norm=true", "attention flags")])
def test_bench_refuses_a_peer_of_another_architecture(config: str, override: str, named: str) -> None:
    pytest.importorskip("transformers")
    from lmlab import compose
    from lmlab.bench import CONFIGS, hf_peer
    from lmlab.config import arch_config

    kind, overrides = CONFIGS[config]
    with pytest.raises(ValueError, match=named):
        hf_peer(kind, arch_config(compose(overrides + [override]), vocab_size=None))


def test_bench_runs_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from lmlab.bench import main

    path = tmp_path / "bench.json"
    out = main(["--config", "llama", "--threads", "1", "--set", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                "model.max_seq_len=16", "model.vocab_size=64", "--batch", "2", "--repeats", "2", "--steps", "1",
                "--eval-steps", "1", "--warmup", "1", "--loop-steps", "2", "--loop-repeats", "1", "--mm-size", "256",
                "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["ratios"].keys() == {"train_vs_llama", "eval_vs_llama", "mem_vs_llama"}
    for key in ("train_vs_llama", "eval_vs_llama"):
        r = saved["ratios"][key]
        assert len(r["all"]) == 2 and r["min"] <= r["median"] <= r["max"] and r["min"] > 0
    loop = saved["lightning_loop"]
    assert loop["window_steps"] == 2 and len(loop["lightning_each_step_s"]) == 3
    assert loop["ratio_amortised"]["median"] >= loop["ratio"]["median"] > 0
    lm, hf = saved["results"]["lmlab"], saved["results"]["hf LlamaForCausalLM"]
    assert lm["params"] == hf["params"] and lm["peak_mem_mb"] > 0 and hf["peak_mem_mb"] > 0
    for r in (lm, hf):  # AdamW in fp32: two moments (8 bytes a parameter) + a 4-byte step per tensor (< 100 here)
        assert 8 * r["params"] < r["optim_state_bytes"] < 8 * r["params"] + 4 * 100
    # 6·N + 12·L·T·d with N = the Linear weights: 1 layer of (qkv 32·96 + o 32·32 + swiglu 32·2·86 + 86·32) + head 32·64
    # (swiglu hidden 86: the MLP's 128 matched within 1%, lmlab.model.ffn.matched_hidden)
    n = 32 * 96 + 32 * 32 + 3 * 32 * 86 + 32 * 64
    assert saved["matmul_params"] == n
    assert saved["flops_per_token"] == {"train": 6 * n + 12 * 1 * 16 * 32, "eval": 2 * n + 4 * 1 * 16 * 32}
    assert math.isclose(lm["train_tok_s"], 2 * 16 / lm["train_step_s"])
    assert {t["target"].split(" ")[0] for t in saved["targets"]} >= {"train", "eval", "Lightning"}
    assert out["ratios"] == saved["ratios"]
    for name, b in saved["breakdown"].items():  # one profiled step per model, split over the four classes
        assert b["seconds"].keys() == {"matmul", "attention", "optimizer", "other"}
        assert math.isclose(sum(b["seconds"].values()), saved["results"][name]["train_step_s"], rel_tol=1e-9)
        assert b["seconds"]["matmul"] > 0 and b["seconds"]["attention"] > 0 and b["seconds"]["optimizer"] > 0
        assert math.isclose(b["matmul_gflops"], 6 * n * 2 * 16 / b["seconds"]["matmul"] / 1e9)


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "amos", "lamb", "lion", "schedulefree", "muon"])
def test_bench_optimizer_state_bytes(optim: str) -> None:
    """The bench's optimizer-state figure after one step: AdamW = 2 fp32 moments per parameter + a 4-byte step per
    tensor (LAMB the same); Lion one moment; schedule-free z and v (no step tensor); Muon one momentum buffer on the
    hidden matrices and AdamW's on the rest; Adafactor's factored second moment and Amos's step, v and b (one per
    matrix row, one per vector) are a small fraction of that."""
    from omegaconf import OmegaConf

    from lmlab import compose
    from lmlab.bench.timing import Contestant
    from lmlab.run.lit import configure_optimization

    spec = OmegaConf.to_container(compose([f"optim={optim}"]).optim)  # its YAML and the loop's keys (conf/optim_base)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, max_seq_len=16))
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)

    def loss(batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    c = Contestant(optim, model, loss, configure_optimization(model, spec, {"name": "constant"}, 10), 1.0,
                   contextlib.nullcontext)
    assert c.optimizer_state_bytes() == 0  # no state before the first step
    c.train_step((torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))))
    got = c.optimizer_state_bytes()
    hidden = [m.weight for block in model.h for m in block.modules() if isinstance(m, torch.nn.Linear)]
    rest = [p for p in params if all(p is not h for h in hidden)]
    if optim in ("adamw", "lamb"):
        assert got == 8 * n + 4 * len(params)
    elif optim == "lion":
        assert got == 4 * n
    elif optim == "schedulefree":
        assert got == 8 * n
    elif optim == "muon":
        assert got == 4 * sum(h.numel() for h in hidden) + 8 * sum(p.numel() for p in rest) + 4 * len(rest)
    elif optim == "amos":
        assert got == 4 * sum(1 + 2 * (p.numel() // p.shape[-1] if p.dim() >= 2 else 1) for p in params)
        assert got < 0.1 * 8 * n
    else:
        assert 0 < got < 0.1 * 8 * n  # 5,176 vs 214,328 bytes here


def test_bench_breakdown_classes() -> None:
    from lmlab.bench.breakdown import classify

    assert [classify(n) for n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")] == ["matmul"] * 3 + ["other"]
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert classify("aten::_fused_adamw_") == classify("aten::_foreach_norm") == "optimizer"
    assert classify("aten::_log_softmax") == classify("aten::gelu") == "other"


def test_bench_keeps_its_timings_when_the_profiler_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    import lmlab.bench.cli as cli
    from lmlab.bench.report import render

    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(cli, "step_breakdown", broken)
    out = cli.main(["--config", "small", "--threads", "1", "--set", "model.n_layer=1", "model.d_model=32",
                    "model.n_head=2", "model.max_seq_len=16", "model.vocab_size=64", "--batch", "2", "--repeats", "1",
                    "--steps", "1", "--eval-steps", "1", "--warmup", "1", "--loop-repeats", "0", "--mm-size", "128",
                    "--no-memory"])
    assert "breakdown" not in out and "CUPTI_ERROR_NOT_INITIALIZED" in out["breakdown_error"]
    assert out["ratios"]["train_vs_gpt2"]["median"] > 0
    assert "profiler failed" in render(out)
