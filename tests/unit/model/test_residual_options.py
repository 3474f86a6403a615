"""The checks the token-reading residual options share (bigram_hash, smear, canon, backout: each reads tokens or
streams of other positions), parametrised over the options instead of copied into each option's file: the whole
model causal, to the bit, each change reaching the next position; a packed document read as it would be alone under
attention.doc_mask (full forward and cached) and not without the option's document cut; training forward and
backward. Each option's model and tokens are its own file's (`_model`, `_idx`: its sizes and settings); what is the
option's alone (its formula, cache contents, refusals) stays in that file. test_model.py's loop over every residual
option checks causality at one position to 1e-5, on default settings."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmlab.model.attention.cache import KVCache
from tests.unit.model import test_backout, test_bigram_hash, test_canon, test_smear
from tests.unit.model.options import assert_trains

V, EOD = 40, 0
assert test_backout.V == test_bigram_hash.V == test_canon.V == test_smear.V == V
assert test_bigram_hash.EOD == test_canon.EOD == test_smear.EOD == EOD

# option: (its model, its tokens); the settings each file's own causality check used
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., torch.Tensor]]] = {
    "backout": (lambda: test_backout._model(), test_backout._idx),
    "bigram_hash": (lambda: test_bigram_hash._model({"signs": 16}), test_bigram_hash._idx),
    "canon": (lambda: test_canon._model({"kernel": 5}), test_canon._idx),  # a window wider than the default 4
    "smear": (lambda: test_smear._model(), test_smear._idx),
}


@pytest.mark.parametrize("t", [0, 5, 11])
@pytest.mark.parametrize("option", sorted(MODELS))
def test_the_whole_model_is_causal(option: str, t: int) -> None:
    build, draw = MODELS[option]
    model = build()
    idx = draw(T=16)
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % (V - 1) + 1  # every later token changed (and none made EOD)
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=0)
    assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-6  # the change reaches the next position


DOC_MASK = dict(eod_id=EOD, attention={"name": "mha", "doc_mask": True})


def _uncut_canon(model) -> None:
    for block in model.h:  # the attention still masked, the convolutions reading across the start
        block.canon.doc_reset = False


# option: (its model under doc_mask for a separator role, what reads across a document start without the cut)
PACKED: dict[str, tuple[Callable[[str], torch.nn.Module], Callable[[torch.nn.Module], None]]] = {
    "bigram_hash": (lambda role: test_bigram_hash._model({"signs": 16}, doc_sep_role=role, **DOC_MASK),
                    lambda model: setattr(model.residual.options["bigram_hash"], "cut", False)),
    "smear": (lambda role: test_smear._model(doc_sep_role=role, **DOC_MASK),
              lambda model: setattr(model.residual.options["smear"], "cut", False)),
    "canon": (lambda role: test_canon._model({}, **DOC_MASK), _uncut_canon),  # the default role, eod
}


@pytest.mark.parametrize("prompt", [14, 8])
@pytest.mark.parametrize("option,role", [("bigram_hash", "eod"), ("bigram_hash", "bos"), ("smear", "eod"),
                                         ("smear", "bos"), ("canon", "eod")])
def test_a_packed_document_reads_as_it_would_alone(option: str, role: str, prompt: int) -> None:
    """Under attention.doc_mask the second document's logits are its own alone, in a full forward and cached (its
    start inside the prompt, or among the tokens generated one at a time); with the option reading across the start
    (the record's packed batch) they are not."""
    build, uncut = PACKED[option]
    draw = MODELS[option][1]
    a, b = draw(T=11, B=1, seed=2), draw(T=9, B=1, seed=3)
    if role == "eod":  # the first document ends with its separator
        packed = torch.cat((a, torch.tensor([[EOD]]), b), dim=1)
    else:  # each opens with it (data=token_bin's [50256, *doc]): the record reads across at b's separator
        a, b = (torch.cat((torch.tensor([[EOD]]), t[:, 1:]), dim=1) for t in (a, b))
        packed = torch.cat((a, b), dim=1)
    model = build(role)
    with torch.no_grad():
        alone = model(b)
        torch.testing.assert_close(model(packed)[:, -9:], alone, rtol=1e-10, atol=1e-10)
        cache = KVCache(len(model.h))
        steps = [model(packed[:, :prompt], cache=cache)]
        steps += [model(packed[:, t:t + 1], cache=cache) for t in range(prompt, packed.size(1))]
        torch.testing.assert_close(torch.cat(steps, dim=1)[:, -9:], alone, rtol=1e-10, atol=1e-10)
        uncut(model)
        assert (model(packed)[:, -9:] - alone).abs().max() > 1e-3


# option: its model for training (the plain option) and the names of its own parameters
TRAINS = {"backout": (lambda: test_backout._model(), "backout"),
          "bigram_hash": (lambda: test_bigram_hash._model({"signs": 16}), ".bigram_hash."),
          "canon": (lambda: test_canon._model({}), ".canon."),
          "smear": (lambda: test_smear._model(), ".smear.")}


@pytest.mark.parametrize("option", sorted(TRAINS))
def test_it_trains_forward_and_backward(option: str) -> None:
    build, owned = TRAINS[option]
    assert_trains(build().float().train(), MODELS[option][1](T=16, B=4), owned=owned)
