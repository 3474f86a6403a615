"""Size bounds from the config's arithmetic, before anything is built: the parameter estimate is a lower bound within
1% of the built model's count for every block, FFN and attention; a model or a generation the machine cannot hold is
refused in seconds with the estimate (a million layers took 6 minutes and 7.5 GB of meta-device objects to fail)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.block import BLOCKS
from lmlab.model.ffn import FFNS
from lmlab.model.gpt import GPT, validate
from lmlab.model.memory import GiB, check_generation_fits, check_model_fits, model_bytes
from lmlab.model.resolve import n_params_estimate


@pytest.mark.parametrize(("block", "ffn"), sorted(itertools.product(BLOCKS, FFNS)))
@pytest.mark.parametrize(("bias", "tie", "attention"), [(False, True, "mha"), (True, False, "gqa"),
                                                         (False, False, "mqa")])
def test_the_parameter_estimate_is_a_lower_bound_within_one_percent(block: str, ffn: str, bias: bool, tie: bool,
                                                                    attention: str) -> None:
    cfg = GPTConfig(vocab_size=100, n_layer=3, d_model=64, n_head=4, n_kv_head=2, block={"name": block},
                    ffn={"name": ffn}, bias=bias, tie_embeddings=tie, attention={"name": attention})
    estimate = n_params_estimate(cfg)  # from the sizes alone
    with torch.device("meta"):
        built = GPT(cfg).num_params()
    assert estimate <= built <= 1.01 * estimate  # norms and gains aside


@pytest.mark.parametrize("position", ["learned", "rope", "none"])
def test_the_estimate_counts_a_learned_position_table(position: str) -> None:
    """The HF size bound missed the learned table: a config of n_positions=10^9 passed it (10^9 x n_embd weights)."""
    cfg = GPTConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, max_seq_len=8192, position={"name": position})
    with torch.device("meta"):
        built = GPT(validate(cfg)).num_params()
    assert n_params_estimate(cfg) <= built and n_params_estimate(cfg) == pytest.approx(built, rel=0.01)
    if position == "learned":  # the table is most of this model
        assert n_params_estimate(cfg) > 8192 * 32
    huge = GPTConfig(vocab_size=64, n_layer=1, d_model=1024, n_head=2, max_seq_len=10**9, position={"name": "learned"})
    with pytest.raises(ValueError, match=r"needs at least ~381\d\.\d GiB to build"):
        check_model_fits(huge, what="config.json")


def test_cache_width_is_what_the_cache_holds(tiny_cfg) -> None:
    from lmlab.model.attention.cache import KVCache

    for cfg in (tiny_cfg(attention={"name": "gqa"}, n_kv_head=2), tiny_cfg(block={"name": "gau", "s": 8})):
        model, cache = GPT(validate(cfg)).eval(), KVCache(cfg.n_layer)
        with torch.no_grad():
            model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
        per_token = sum(t.numel() for layer in cache.layers for t in (layer.k, layer.v)) / (2 * 5)
        assert per_token == cfg.n_layer * cfg.cache_width


def test_a_model_too_large_for_the_machine_is_refused_before_training_in_seconds() -> None:
    from lmlab.run.training import check_config

    for overrides in (["model.n_layer=1000000"], ["model.n_layer=1000000", "model.d_model=8", "model.n_head=2"],
                      ["model.d_model=2000000", "model.n_head=1"]):
        started = time.monotonic()
        with pytest.raises(ValueError, match=r"model: model\.n_layer=\d+ model\.d_model=\d+ .*needs at least ~[\d.]+ "
                                             r"GiB to build .*available memory is ~[\d.]+ GiB"):
            check_config(compose(overrides))
        assert time.monotonic() - started < 30, overrides


def test_the_bounds_compare_the_estimate_with_free_memory(tiny_cfg, monkeypatch) -> None:
    import lmlab.model.memory as memory

    cfg = tiny_cfg()
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": model_bytes(cfg))
    check_model_fits(cfg)  # exactly what is free: accepted
    with pytest.raises(ValueError, match="needs at least"):
        check_model_fits(cfg, bytes_per_param=16)
    per_token = 2 * 4 * cfg.n_layer * 3 * cfg.cache_width
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": per_token * 100)
    check_generation_fits(cfg, 10, 90, 3)
    with pytest.raises(ValueError, match=r"max_new_tokens=91 .*room for ~100 tokens"):
        check_generation_fits(cfg, 10, 91, 3)
    alibi = tiny_cfg(position={"name": "alibi"})
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1 * GiB)
    with pytest.raises(ValueError, match=r"the prompt \(20000 tokens, n=1\) with position=alibi"):
        check_generation_fits(alibi, 20000, 1, 1)


def test_the_flop_count_follows_the_blocks_own_attention_width(tiny_cfg) -> None:
    """A transformer layer's scores cost the usual 12·L·T·d per trained token; a GAU's one head of key size s weighs
    values of width e = 2·d, so its attention term is 6·L·T·(s + e), not the transformer's n_head·head_dim."""
    from lmlab.model.flops import flops_per_token, matmul_params

    for cfg, width in ((tiny_cfg(), 2 * 32), (tiny_cfg(block={"name": "gau", "s": 8}), 8 + 2 * 32)):
        model = GPT(cfg)
        assert cfg.attn_width == width
        n, T = matmul_params(model), 16
        assert flops_per_token(model, T) == {"train": 6 * n + 6 * cfg.n_layer * T * width,
                                             "eval": 2 * n + 2 * cfg.n_layer * T * width}
    transformer = GPT(tiny_cfg())
    assert flops_per_token(transformer, 16)["train"] == 6 * matmul_params(transformer) + 12 * 2 * 16 * 32  # 12·L·T·d
