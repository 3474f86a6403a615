"""The attention-wide features as parts (lmlab.model.attention.parts): every key of conf/attention_base/shared.yaml
is an option's own or one part's, every attention option takes them all without re-listing them, what a part needs of
the other keys (its `requires` and `excludes`) is refused by key before anything is built, an option that computes a
hook's step its own way refuses a part that fills it, and the weights the parts build keep the names and the order
the state dict and an optimizer's saved state are indexed by."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS, MHA
from lmlab.model.attention.parts import PARTS, Part, part_keys
from lmlab.model.gpt import GPT, validate
from lmlab.registry import _parameters, option_defaults

SHARED = Path(__file__).resolve().parents[4] / "lmlab" / "conf" / "attention_base" / "shared.yaml"
OWN = ("score", "logn_scaling", "temperature", "softcap", "doc_mask")  # MHA's own keys, the rest are its parts'
# a setting that turns on each part that needs something of the other keys (a new such part adds its line: the
# test below fails until it does)
ON = {"sinks": {"sinks": True}, "mem_kv": {"mem_kv": 2}, "forget_gate": {"forget_gate": True},
      "paired_heads": {"paired_heads": True}, "block_select": {"select_blocks": 2},
      "window": {"window": 4}, "pattern": {"pattern": [4, "global"]}}


def _attn(**attention) -> torch.nn.Module:
    cfg = GPTConfig(vocab_size=32, n_layer=2, d_model=16, n_head=4, max_seq_len=16, position={"name": "rope"},
                    attention={"name": "mha", **attention})
    torch.manual_seed(0)
    return GPT(validate(cfg)).h[0].attn


def test_every_shared_key_is_mhas_own_or_one_parts() -> None:
    shared = yaml.safe_load(SHARED.read_text())
    shared.pop("defaults", None)
    owners = [name for name, part in PARTS.items() for _ in part.keys()]
    assert len(owners) == len(part_keys())  # no key in two parts
    assert set(shared) == set(OWN) | set(part_keys())
    assert {k: shared[k] for k in part_keys()} == part_keys()  # the YAML's defaults are the parts'


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_no_option_relists_an_mha_key(name: str) -> None:
    """Each option takes every MHA key (its own and its parts') through the registry, declaring at most 3 itself."""
    cls = ATTENTIONS[name]
    assert set(option_defaults(MHA)) <= set(option_defaults(cls))
    own = [p.name for p, owner in _parameters(cls) if owner is cls and p.kind.name == "KEYWORD_ONLY"]
    assert len(set(own) & set(option_defaults(MHA))) <= (len(OWN) if cls is MHA else 3)


@pytest.mark.parametrize("name", sorted(n for n, p in PARTS.items() if p.requires or p.excludes))
def test_what_a_part_needs_of_the_other_keys_is_refused_by_key(name: str) -> None:
    part = PARTS[name]
    assert name in ON, f"parts/{name}.py declares requires/excludes: add a setting that turns it on to ON"
    assert all(other in ON for other in part.excludes), "add a setting of each key a part excludes to ON"
    for other, (allowed, why) in part.requires.items():
        wrong = next(v for v in ("relu2", "softmax_plus", True, 3) if v not in allowed)
        with pytest.raises(ValueError, match=rf"attention\.{next(iter(ON[name]))}=.* needs attention\.{other}=.*"
                                             rf"\(got {wrong!r}\): {why[:20]}"):
            _attn(**ON[name], **{other: wrong})
    for other, why in part.excludes.items():
        setting = ON[other]
        with pytest.raises(ValueError, match=rf"attention\.{next(iter(ON[name]))}=.* with attention\.{other}=.*: "
                                             rf"{why[:20]}"):
            _attn(**ON[name], **setting)


def test_an_option_refuses_by_key_the_parts_it_has_no_form_for() -> None:
    """MLA rotates its own latents: pairing (which rotates at the heads' slots) is refused by its `refuses`, and its
    `runs_hooks` leaves the rotation hooks out (a part that fills one is refused by key)."""
    assert not {"before_rotation", "rotation", "after_rotation"} & ATTENTIONS["mla"].runs_hooks
    with pytest.raises(ValueError, match=r"attention=mla caches a latent .*: attention\.paired_heads=true does not "
                                         r"apply; leave it at false"):
        _attn(name="mla", paired_heads=True)


def test_the_parts_weights_keep_their_names_and_order() -> None:
    """The names the state dict keeps and their order (an optimizer's saved state is indexed by it; the seeded init
    draws in it): as before the parts, whatever order their files are read in."""
    attn = _attn(gate="elementwise", sinks=False, qk_norm=True, forget_gate=True, mem_kv=2, xsa="gated")
    assert [n for n, _ in attn.named_parameters()] == [
        "q_norm", "k_norm", "forget_bias", "mem_k", "mem_v", "c_attn.weight", "c_proj.weight", "gate.weight",
        "forget.weight", "xsa.alpha"]
    assert list(PARTS)[:8] == ["window", "gate", "sinks", "qk_norm", "forget_gate", "mem_kv", "xsa", "key_offset"]
    assert all(issubclass(p, Part) for p in PARTS.values())
    assert [type(p).__name__ for p in attn.parts.on] == ["Windows", "Gate", "QKNorm", "ForgetGate", "MemoryKV",
                                                         "XSAPart"]
