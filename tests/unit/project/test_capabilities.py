"""Typed capabilities (lmlab.model.capabilities): the attribute probes (`hasattr`, 3-argument `getattr`) outside
interop/ and bench/ cannot grow back, and softmax attention and every recurrent mixer satisfy the `SequenceMixer`
protocol, built on model=tiny."""

from __future__ import annotations

import ast

import pytest

from lmlab.model.mixer import ATTENTION, MIXERS
from tests.runs import ROOT

PACKAGE = ROOT / "lmlab"
OUTSIDE = ("interop", "bench")  # the faces of other libraries: probing their objects is their job
MAX_PROBES = 33  # lower it as probes go (issue 61: at most 40; 69 when the capabilities landed)


def _probes() -> list[str]:
    """`file:line` of every call of `hasattr(...)` or `getattr(obj, name, default)` in lmlab/ outside OUTSIDE."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in OUTSIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_attribute_probes_do_not_grow() -> None:
    probes = _probes()
    assert len(probes) <= MAX_PROBES, (f"{len(probes)} attribute probes (at most {MAX_PROBES}): declare the capability "
                                       f"in lmlab.model.capabilities instead\n" + "\n".join(probes))


def test_the_probe_count_sees_both_forms() -> None:
    tree = ast.parse("hasattr(a, 'b'); getattr(a, 'b', None); getattr(a, 'b')")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert sum(n.func.id == "hasattr" or len(n.args) == 3 for n in calls) == 2


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_every_mixer_is_a_sequence_mixer(mixer: str) -> None:
    from lmlab import build_model, compose
    from lmlab.model.capabilities import AttentionWeights, RecurrentMixer, SequenceMixer, TokenMixer

    model = build_model(compose(["model=tiny", f"mixer={mixer}"]), vocab_size=64)
    layers = [getattr(block, name) for block in model.h for name in block.sublayer_names]
    mixing = [m for m in layers if isinstance(m, TokenMixer)]
    assert mixing and all(isinstance(m, SequenceMixer) for m in mixing)
    if mixer == ATTENTION:
        assert all(isinstance(m, AttentionWeights) and not isinstance(m, RecurrentMixer) for m in mixing)
    else:
        assert all(isinstance(m, RecurrentMixer) for m in mixing)
        assert type(mixing[0]).geometry(model.cfg).n_params > 0  # from the sizes alone
    assert not any(isinstance(m, SequenceMixer) for m in layers if m not in mixing)  # the FFNs are not


def test_a_sequence_mixer_needs_the_whole_contract() -> None:
    from torch import nn

    from lmlab.model.capabilities import SequenceMixer, TokenMixer

    class Half(nn.Module):
        mixes_tokens = True

    assert isinstance(Half(), TokenMixer) and not isinstance(Half(), SequenceMixer)


def test_marks_read_their_defaults_and_refuse_unknown_names() -> None:
    from torch import nn

    from lmlab.model.capabilities import Marks, mark, marks

    linear = nn.Linear(4, 6)
    assert marks(linear) == Marks()
    mark(linear, fused=(2, 2, 2), value_parts=(False, False, True))
    assert marks(linear).fused == (2, 2, 2) and marks(linear).head_rows == 0
    with pytest.raises(TypeError):
        mark(linear, fussed=(6,))


def test_optimizer_capabilities_are_declared_by_name() -> None:
    from lmlab.optim import OPTIMIZERS
    from lmlab.optim.capabilities import OptimizerCaps, capabilities, declare

    assert capabilities(OPTIMIZERS["sgd"]) == OptimizerCaps()
    assert capabilities(OPTIMIZERS["muon"]).roles and capabilities(OPTIMIZERS["muon"]).layouts
    assert capabilities(OPTIMIZERS["schedulefree"]).averages
    with pytest.raises(TypeError):
        declare(lambda groups: None, mupp=True)
