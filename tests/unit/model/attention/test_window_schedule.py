"""The GPT-2 speedrun's attention-window schedules (lmlab.model.attention.parts.window): the window at every step against
the records' own rules written out (13's linear warm-up, 16's in blocks, 29's thirds, 72's stages per layer kind);
the block-causal sliding mask against record 16's built pair by pair, and the attention under it against the dense
masked softmax on every path (banded, explicit, FlexAttention, the KV cache); eval_window when not training; the
window a function of the step alone (a resume's); refusals by key."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention import flex
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import BlockWindow, allowed, banded_sdpa, doc_allowed, documents, key_counts
from lmlab.model.attention.score import SCORES, attend
from lmlab.model.attention.parts.window import layer_windows, windowed
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS

TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _model(**kw) -> GPT:
    base = dict(vocab_size=30, n_layer=1, d_model=32, n_head=4, max_seq_len=24, position={"name": "rope"})
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**{**base, **kw})))


def _windows(model: GPT) -> list[int | None]:
    return [b.attn.window for b in model.h]


# --- (1) the window at each step, against the records' rules ----------------------------------------------------


def _record13(step: int, N: int) -> int:
    """2024-11-24_WindowWarmup: attn_blocksize = 64*((step/num_iterations * (1792 - 64) + 64)//64), a token mask."""
    return int(64 * ((step / N * (1792 - 64) + 64) // 64))


def _record16_blocks(step: int, N: int) -> int:
    """2024-12-10_MFUTweaks: sw_num_blocks = int(((1 - frac_done) * 64 + frac_done * 1792 + 64) // 128)."""
    f = step / N
    return int(((1 - f) * 64 + f * 1792 + 64) // 128)


def _record20(step: int, N: int) -> int:
    """2025-01-16_Sub3Min: window_size = next_multiple_of_n(1728 * step / train_steps, n=128)."""
    v = 1728 * step / N
    return next(x for x in range(128, int(v) + 1 + 128, 128) if x >= v)


def test_the_linear_warm_up_is_the_records_rule_at_every_step() -> None:
    N = 1750
    w = layer_windows(1792, None, 0, 1, 2048, window_schedule={"start": 64, "end": 1792, "multiple": 64})
    assert [w.at(s, N, True) for s in range(N + 1)] == [_record13(s, N) for s in range(N + 1)]
    assert (w.at(0, N, True), w.at(N, N, True), w.at(None, None, True)) == (64, 1792, 1792)  # no step: the model's
    N = 1480
    w = layer_windows(1792, None, 0, 1, 2048, window_block=128,
                      window_schedule={"start": 64, "end": 1792, "multiple": 128, "round": "nearest"})
    got = [w.at(s, N, True) for s in range(N + 1)]
    assert all(isinstance(x, BlockWindow) and x.block == 128 for x in got)
    assert [x // 128 for x in got] == [_record16_blocks(s, N) for s in range(N + 1)]
    assert (got[0], got[-1]) == (128, 1792)  # 1 block -> 14
    N = 1393
    w = layer_windows(1792, None, 0, 1, 2048, window_block=128,
                      window_schedule={"start": 0, "end": 1728, "multiple": 128, "round": "up"})
    assert [w.at(s, N, True) for s in range(N + 1)] == [_record20(s, N) for s in range(N + 1)]


def test_stages_are_record_29s_thirds_on_long_and_short_layers() -> None:
    """2025-09-03_FA3: ws = (3, 7, 11)[int(3·step/(N + 1))] blocks of 128; long layers ws·128, short (ws // 2)·128
    (bm_sizes; FlashAttention's window_size=(bm, 0) reads bm + 1 keys, the sizes compared here). A number per stage:
    the long layers' window, the short ones scale with it (built 11 and 5 blocks)."""
    N, ws_schedule = 1670, (3, 7, 11)
    stages = [[k * (N + 1) / (3 * N), ws * 128] for k, ws in enumerate(ws_schedule)]  # ⌊3s/(N + 1)⌋ = k from there
    pattern = ["local", 640, 640, 640, "local", 640, 640, "local", 640, 640, 640, "local"]  # record 29's layers
    layers = [layer_windows(1408, pattern, i, 12, 2048, window_block=128, window_schedule=stages) for i in range(12)]
    for s in range(N + 1):
        ws = ws_schedule[int(len(ws_schedule) * s / (1 + N))]
        want = [ws * 128 if e == "local" else ws // 2 * 128 for e in pattern]
        assert [w.at(s, N, True) for w in layers] == want, s


def test_the_mapping_spelling_of_stages_is_the_list_and_replaces_a_linear_warm_up() -> None:
    """{stages: [...]} with the linear keys null (what a config laid over a linear warm-up composes to) gives the
    windows the list gives, step by step; with a linear key still set it is refused, naming both."""
    stages = [[0, 32], [0.3333, 64], [0.6667, 96]]
    spelled = {"stages": stages, "start": None, "end": None, "multiple": None, "round": None}
    a, b = (layer_windows(96, None, 0, 1, 128, window_block=16, window_schedule=w) for w in (stages, spelled))
    assert [a.at(s, 300, True) for s in range(301)] == [b.at(s, 300, True) for s in range(301)]
    assert {int(b.at(s, 300, True)) for s in (0, 100, 200, 299)} == {32, 64, 96}
    with pytest.raises(ValueError, match=r"gives stages and a linear warm-up's \['start'\]: one or the other"):
        layer_windows(96, None, 0, 1, 128, window_block=16, window_schedule={**spelled, "start": 16})


def test_stages_per_pattern_entry_are_record_72s_windows() -> None:
    """2026-02-10_ShortWindow: (short, long) blocks (1, 3), (3, 7), (5, 11), (6, 13) over thirds of 1515 scheduled
    steps and 40 more; short forced to 2 in stage 3 (steps 1010 .. 1514). A list per stage: each entry's window."""
    stages_rec, ends = [(1, 3), (3, 7), (5, 11), (6, 13)], [0, round(1515 / 3), round(2 * 1515 / 3), 1515, 1555]

    def record(step: int) -> tuple[int, int]:  # TrainingSchedule.lookup, then advance_schedule's stage-3 cut
        short, long = stages_rec[next((i for i in range(4) if step < ends[i + 1]), 3)]
        return (2 if 1010 <= step < 1515 else short) * 128, long * 128

    stages = [[0, [128, 384]], [505 / 1555, [384, 896]], [1010 / 1555, [256, 1408]], [1515 / 1555, [768, 1664]]]
    layers = [layer_windows(1664, [768, "local"], i, 2, 2048, window_block=128, window_schedule=stages)
              for i in range(2)]
    for s in range(1556):
        assert (layers[0].at(s, 1555, True), layers[1].at(s, 1555, True)) == record(s), s
    # records 33 and 35: validation-only windows (35: long layers 20 blocks, short 13 // 2 = 6), at any step
    ev = [layer_windows(1664, [768, "local"], i, 2, 4096, window_block=128, window_schedule=stages,
                        eval_window=[768, 2560]) for i in range(2)]
    assert [w.at(s, 1555, False) for s in (0, 900, 1555) for w in ev] == [768, 2560] * 3


# --- (2) the block-causal sliding mask and the attention under it --------------------------------------------------


def _record16_mask(T: int, offset: int, S: int, n_blocks: int, g: int) -> torch.Tensor:
    """Record 16's mask (create_doc_swc_block_mask, one document) pair by pair: block pair (Q, K) is computed when
    Q >= K and Q - K < n, whole when Q > K; a partly computed block applies the token-causal mask_mod."""
    out = torch.zeros(T, S, dtype=torch.bool)
    for i in range(T):
        for j in range(S):
            p, k = offset + i, offset + T - S + j
            Q, K = p // g, k // g
            out[i, j] = (Q > K and Q - K < n_blocks) or (Q >= K and Q - K < n_blocks and k <= p)
    return out


def test_the_block_mask_is_record_16s_built_pair_by_pair() -> None:
    rng = random.Random(0)
    for _ in range(150):
        g, n = rng.choice([1, 2, 3, 4]), rng.randint(1, 4)
        T, offset = rng.randint(1, 14), rng.randint(0, 14)
        S = rng.randint(T, offset + T)
        window = BlockWindow(n * g, g)
        mask = allowed(T, offset, S, window, torch.device("cpu"))
        assert torch.equal(mask, _record16_mask(T, offset, S, n, g)), (g, n, T, offset, S)
        counts = key_counts(T, offset, torch.device("cpu"), window)
        assert counts.tolist() == _record16_mask(T, offset, offset + T, n, g).sum(-1).float().tolist()


def _dense(q, k, v, scale, mask):
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return ((q @ k.transpose(-2, -1)) * scale).masked_fill(~mask, float("-inf")).softmax(-1) @ v


@torch.no_grad()
def test_attention_under_a_block_window_is_the_dense_masked_softmax(monkeypatch) -> None:
    """Banded SDPA (any query chunk), attend's paths, relu² (which divides by the keys read), documents, and
    FlexAttention (its forward on the CPU), each against the dense softmax under record 16's mask."""
    rng = random.Random(1)
    nope = POSITIONS["none"](16, 8, 4, 64, 64, {"name": "none"})
    for case in range(12):
        g, n = rng.choice([2, 4]), rng.randint(1, 3)
        T, offset = rng.randint(2, 20), rng.choice([0, rng.randint(1, 9)])
        S = rng.randint(T, offset + T)
        window = BlockWindow(n * g, g)
        q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
        mask = _record16_mask(T, offset, S, n, g)
        want = _dense(q, k, v, 0.3, mask)
        for chunk in (None, 1, 3):
            got = banded_sdpa(q, k, v, scale=0.3, window=window, offset=offset, block=chunk)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"case {case} chunk {chunk}: {m}")
        torch.testing.assert_close(attend(q, k, v, SCORES["softmax"](64), 0.3, nope, offset, window=window), want,
                                   **TOL)
        kf, vf = torch.randn(2, 4, offset + T, 8), torch.randn(2, 4, offset + T, 8)  # every key (relu²'s n counts them)
        full = _record16_mask(T, offset, offset + T, n, g)
        a = torch.relu((q @ kf.transpose(-2, -1)) * 0.3).square().masked_fill(~full, 0.0)
        torch.testing.assert_close(attend(q, kf, vf, SCORES["relu2"](64), 0.3, nope, offset, window=window),
                                   a / full.sum(-1, keepdim=True) @ vf, **TOL)
        tokens = torch.randint(0, 4, (2, offset + T), generator=torch.Generator().manual_seed(case))
        doc = documents(tokens, 0)
        docs = (doc[:, offset:], doc[:, doc.size(1) - S:])
        want_doc = _dense(q, k, v, 0.3, doc_allowed(mask, docs))
        torch.testing.assert_close(banded_sdpa(q, k, v, scale=0.3, window=window, offset=offset, doc=docs),
                                   want_doc, **TOL)
        if case not in (1, 2):  # FlexAttention on the CPU compiles each shape: two cases (2: a cached prefix)
            continue
        monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})
        for d, w in ((None, want), (docs, want_doc)):
            torch.testing.assert_close(flex.flex_attend(q, k, v, scale=0.3, offset=offset, window=window, doc=d), w,
                                       **TOL)
        monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda"})


@torch.no_grad()
def test_a_block_windowed_model_generates_with_its_cache_as_its_full_forward() -> None:
    """window 8 in blocks of 4: token 5 (block 1) reads tokens 0..5, token 8 (block 2) 4..8; a token-by-token KV cache
    keeps W - 1 = 7 keys and gives the full forward's logits."""
    model = _model(n_layer=2, attention={"name": "mha", "window": 8, "window_block": 4}).eval()
    assert _windows(model) == [BlockWindow(8, 4)] * 2
    idx = torch.randint(0, 30, (1, 20), generator=torch.Generator().manual_seed(0))
    full = model(idx)
    cache = KVCache(2)
    steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    assert cache.layers[0].k.size(-2) == 7
    one_layer = _model(attention={"name": "mha", "window": 8, "window_block": 4}).eval()
    for t, reads in ((5, range(0, 6)), (8, range(4, 9)), (11, range(4, 12))):  # changing a key it reads changes it
        for j in range(t + 1):
            other = idx.clone()
            other[0, j] = (idx[0, j] + 1) % 30
            moved = (one_layer(other)[0, t] - one_layer(idx)[0, t]).abs().max() > 1e-6
            assert moved == (j in reads), (t, j)


# --- (3) eval_window when not training, the schedule's window in training -----------------------------------------


def test_validation_reads_the_eval_window_and_training_the_schedule() -> None:
    attention = {"name": "mha", "window": 16, "pattern": ["local", 8], "window_schedule": [[0, 8], [0.5, 16]],
                 "eval_window": [24, "global"]}
    model = _model(n_layer=2, attention=attention)
    assert _windows(model) == [16, 8]  # no step: the model's own windows
    for b in model.h:
        b.attn.set_step(1, 4)
    assert _windows(model) == [8, 4]  # stage 0: the long layer 8, the short one half of it
    assert _windows(model.eval()) == [24, None] and _windows(model.train()) == [8, 4]
    for b in model.h:
        b.attn.set_step(2, 4)
    assert _windows(model) == [16, 8] and _windows(model.eval()) == [24, None]
    plain = _model(n_layer=2, attention={"name": "mha", "window": 24, "pattern": ["local", "global"]}).eval()
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the forward reads the window in force
        torch.testing.assert_close(model(idx), plain(idx), **TOL)
        cache = KVCache(2)  # generation (eval): the eval window's cache
        model(idx[:, :20], cache=cache)
        assert [c.k.size(-2) for c in cache.layers] == [20, 20]
        model(idx[:, 20:], cache=cache)
        assert [c.k.size(-2) for c in cache.layers] == [23, 24]


def test_the_training_loop_sets_the_window_before_each_step_and_validation() -> None:
    from lmlab.run.lit import LitGPT

    cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=32, n_head=4, max_seq_len=24,
                    attention={"name": "mha", "window": 16, "window_schedule": {"start": 4, "end": 16, "multiple": 4},
                               "eval_window": 20})
    lit = LitGPT(model=cfg.to_dict(), optim={"name": "adamw"}, schedule={"name": "constant"}, max_steps=6)
    assert len(windowed(lit.model)) == 2
    for step, want in ((0, 4), (3, 8), (5, 12), (6, 16)):  # 4 + 12·s/6, down to a multiple of 4
        lit._trainer = SimpleNamespace(global_step=step, optimizers=[])
        lit.on_train_batch_start(None, 0)
        assert _windows(lit.model) == [want] * 2
        lit.model.eval()
        lit.on_validation_start()
        assert _windows(lit.model) == [20] * 2
        lit.model.train()
        assert _windows(lit.model) == [want] * 2


# --- (4) the window is a function of the step alone (what a resume needs) ----------------------------------------


def test_the_window_is_a_function_of_the_step_alone() -> None:
    """A layer that went through steps 0..N, or any order of them, reads at step s the window of a fresh one set
    to s; nothing about it is in the weights (a resumed run rebuilds it from global_step)."""
    attention = {"name": "mha", "window": 16, "window_block": 4, "window_schedule": [[0, 4], [0.4, 8], [0.8, 16]]}
    ran = _model(attention=attention)
    order = list(range(11)) + random.Random(0).sample(range(11), 11)
    seen = []
    for s in order:
        ran.h[0].attn.set_step(s, 10)
        seen.append((s, ran.h[0].attn.window))
    for s, w in seen:
        fresh = _model(attention=attention)
        fresh.h[0].attn.set_step(s, 10)
        assert fresh.h[0].attn.window is w  # the same interned window
    assert [w for s, w in seen[:11]] == [4] * 4 + [8] * 4 + [16] * 3
    assert ran.state_dict().keys() == _model(attention={"name": "mha", "window": 16}).state_dict().keys()


# --- (5) refusals, by key, before training -----------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["attention.window=64", "attention.window_schedule=[[0,32],[0.5,256]]"],
     "attention.window_schedule[1]'s window=256 is larger than the context (model.max_seq_len=128)"),
    (["attention.window_schedule=[[0,32],[1,64]]"],
     "attention.window_schedule=[[0,32],[1,64]] needs windowed layers, and attention.window=null"),
])
def test_bad_schedules_are_refused_by_key_before_training(overrides, message) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError) as err:
        check_config(compose(overrides))
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("attention,message", [
    ({"window_schedule": [[0, 8], [1.5, 16]]}, "attention.window_schedule[1]'s fraction 1.5 must be a fraction of "
                                               "trainer.max_steps in [0, 1]"),
    ({"window_schedule": [[0.1, 8], [0.5, 16]]}, "attention.window_schedule starts at fraction 0.1"),
    ({"window_schedule": [[0, 4], [0.5, 8], [0.5, 16]]}, "attention.window_schedule[2]'s fraction 0.5 must be larger "
                                                         "than the stage before's (0.5)"),
    ({"window": 12, "window_block": 8}, "attention.window=12 is not a multiple of attention.window_block=8"),
    ({"window_schedule": [[0, 8], [0.5, 12]]}, "attention.window_schedule's last stage [0.5,12] gives the layers "
                                               "the windows [12], but attention.window / pattern give [16]"),
    ({"window_schedule": [8, 16]}, "must be a list of [fraction, window] stages"),
    ({"window_schedule": {"start": 4, "end": 12}}, "ends at a window of 12 at trainer.max_steps, but the model's "
                                                    "longest window (attention.window / pattern) is 16"),
    ({"window_schedule": {"start": 4, "end": 16, "every": 4}}, "it does not take ['every']"),
    ({"window_schedule": {"start": 4, "end": 16, "round": "half"}}, "attention.window_schedule's round='half' must be "
                                                                    "one of ['down', 'nearest', 'up']"),
    ({"window_block": 8, "window_schedule": [[0, 4], [0.5, 16]]}, "attention.window_schedule[0]'s window=4 is not "
                                                                  "a multiple of attention.window_block=8"),
    ({"window_block": 8, "window_schedule": {"start": 4, "end": 16, "multiple": 4}},
     "attention.window_schedule's multiple=4 is not a multiple of attention.window_block=8"),
    ({"eval_window": 32}, "attention.eval_window=32 is larger than the context (model.max_seq_len=24)"),
    ({"eval_window": [8, 16]}, "attention.eval_window=[8,16] gives a window per attention.pattern entry, but "
                               "attention.pattern is null"),
    ({"window": None, "pattern": ["global"], "window_block": 4}, "attention.window_block=4 needs windowed layers"),
])
def test_bad_window_keys_are_refused_by_key(attention, message) -> None:
    with pytest.raises(ValueError) as err:
        _model(attention={"name": "mha", "window": 16, **attention})
    assert message in str(err.value), str(err.value)


def test_transformers_export_refuses_block_and_eval_windows() -> None:
    from lmlab.interop.hf import NotRepresentable, family

    llama = dict(norm={"name": "rms"}, ffn={"name": "swiglu"})
    assert family(_model(**llama, attention={"name": "mha", "window": 8, "window_schedule": [[0, 4], [0.5, 8]]}).cfg)
    for key, value in (("window_block", 4), ("eval_window", 16)):
        with pytest.raises(NotRepresentable, match=f"^attention.{key}={value}"):
            family(_model(**llama, attention={"name": "mha", "window": 8, key: value}).cfg)
