"""The GPT-2 speedrun's heads that score the next token's logits on other targets too. head=prefix (lmlab.model.prefix,
record 88's prefix-token loss): the prefix table of hand-made vocabularies (plain, a GPT-2-style byte-level BPE
tokenizer.json, a character tokenizer), the loss against the record's computation written out by hand, weight 0 as
head=next's path, the fade, and the refusals before training. head=mtp_logits (lmlab.model.mtp_logits, record 53's
parameter-free MTP): the record's weighted sum over the next tokens and its fade, by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lmlab import names
from lmlab.config import GPTConfig
from lmlab.data.tokenizer import train_char
from lmlab.model.gpt import GPT, validate
from lmlab.model.head import fit_vocabulary
from lmlab.model.loss import cross_entropy
from lmlab.model.prefix import PREFIX_LOSS, prefix_loss, prefix_table, tokenizer_prefixes
from tests.unit.model.options import trunk

# A vocabulary with its prefix tokens written out by hand: the longest proper prefix that is a token, skipping
# prefixes that are not ("tex" -> "t": "te" is not a token), special tokens neither given one nor taken as one.
VOCAB = {"t": 0, "h": 1, "e": 2, " ": 3, " t": 4, " th": 5, " the": 6, "th": 7, "the": 8, "then": 9, "tex": 10,
         "<": 11, "<eod>": 12, "<eod>!": 13}
EXPECTED = [-1, -1, -1, -1, 3, 4, 5, 0, 7, 8, 0, -1, -1, 11]
V = len(EXPECTED)
SPEEDRUN_CAP = dict(logit_softcap=11.5, logit_softcap_width=15.0, logit_softcap_offset=5.0)  # 23·σ((z + 5) / 7.5)


def _model(head: dict, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=16, head=head, **kw)))


def _batch(T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def test_the_table_is_each_tokens_longest_proper_prefix_token() -> None:
    assert prefix_table(VOCAB, V, skip=[12]) == EXPECTED
    assert prefix_table(VOCAB, V + 2, skip=[12]) == [*EXPECTED, -1, -1]  # ids past the tokenizer's (padding): none
    assert prefix_table(VOCAB, V)[12:] == [11, 12]  # unskipped, "<eod>" would be a token like any other


def test_a_byte_level_bpe_tokenizer_json_gives_the_bytes_prefixes() -> None:
    """GPT-2's layout (a byte-level BPE, "Ġ" for the space byte, <|endoftext|> in the vocabulary and added as a special
    token), through tokenizer.json: " the" -> " th" -> " t" -> " ", the special token skipped."""
    vocab = {"t": 0, "h": 1, "e": 2, "Ġ": 3, "Ġt": 4, "Ġth": 5, "Ġthe": 6, "<|endoftext|>": 7}
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok = Tokenizer.from_str(tok.to_str())  # as read from a tokenizer.json
    assert tok.encode(" the").ids == [6]
    assert tokenizer_prefixes(tok, 8) == [-1, -1, -1, -1, 3, 4, 5, -1]
    # character-level: one character per token, and "<unk>" / the end-of-document token are not "<"'s extensions
    char = train_char(["a<b ab"], vocab_size=0, eod="<eod>")
    assert tokenizer_prefixes(char, char.get_vocab_size(), char.token_to_id("<eod>")) == [-1] * char.get_vocab_size()


def test_the_loss_is_the_records_sum_over_targets_by_hand() -> None:
    """Logits z (4 positions, V = 4) read as they are: L = (1/N) Σ_i [P(t_i) ≥ 0] CE(z_i, P(t_i)), N the counted
    targets (the padded one left out), a target without a prefix adding 0."""
    z = torch.tensor([[[2.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 3.0], [1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 3, 1, -100]])
    table = torch.tensor([-1, 0, 1, -1])  # 2 -> 1, 1 -> 0, 3 and 0: none
    got = prefix_loss(z, targets, table, lambda h, t: cross_entropy(h, t))
    ce_0 = math.log(math.exp(2) + 1 + math.exp(1) + 1) - 0.0  # position 0: target 2, prefix 1
    ce_2 = math.log(4 * math.e) - 1.0  # position 2: target 1, prefix 0
    torch.testing.assert_close(got, torch.tensor((ce_0 + 0.0 + ce_2) / 3))


def test_the_model_objective_is_the_records_loss_per_token() -> None:
    """The record's per-token loss on its softcapped logits 23·σ((z + 5) / 7.5): CE(t) + w·[P(t) ≥ 0]·CE(P(t)),
    here averaged over the tokens; value and gradient."""
    model = _model({"name": "prefix", "weight": 0.25, "prefixes": EXPECTED}, **SPEEDRUN_CAP).train()
    idx, targets = _batch()
    objective, ce, _ = model(idx, targets, parts=True)
    objective.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = 23 * torch.sigmoid((model.ln_f(trunk(model, idx)) @ model.head_weight.T + 5) / 7.5)  # (B, T, V)
    flat, t = logits.flatten(0, 1), targets.flatten()
    p = torch.tensor(EXPECTED)[t]
    per_token = F.cross_entropy(flat, t, reduction="none")
    has = p >= 0
    per_token = per_token + 0.25 * torch.where(has, F.cross_entropy(flat, p.clamp(min=0), reduction="none"), 0.0)
    expected = per_token.mean()
    expected.backward()
    assert 0 < int(has.sum()) < t.numel()  # both kinds of target in the batch
    torch.testing.assert_close(objective, expected)
    torch.testing.assert_close(ce, F.cross_entropy(flat, t).detach())
    torch.testing.assert_close(model.figures("train")[PREFIX_LOSS], (objective - ce).detach() / 0.25)
    for a, b in zip(got, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b)
    assert model.extra_losses and model.side() == {"train": [PREFIX_LOSS], "val": [], "figures": []}
    assert names.TRAIN_PREFIX_LOSS == f"train/{PREFIX_LOSS}"


def test_weight_zero_and_evaluation_are_the_plain_next_token_path() -> None:
    idx, targets = _batch()
    plain = _model({"name": "next"}).train()
    zero = _model({"name": "prefix", "weight": 0.0, "prefixes": EXPECTED}).train()
    assert torch.equal(zero(idx, targets), plain(idx, targets))
    assert not zero.extra_losses and zero.figures("train") == {} and zero.side()["train"] == []
    prefix = _model({"name": "prefix", "prefixes": EXPECTED})
    plain.eval(), prefix.eval()
    assert torch.equal(prefix(idx, targets), plain(idx, targets)) and prefix.figures("val") == {}
    # a batch whose targets have no prefix token: L_prefix = 0, the objective the next token's, gradients finite
    prefix.train()
    none = torch.zeros_like(targets)  # token 0: "t"
    objective, ce, _ = prefix(idx, none, parts=True)
    objective.backward()
    assert torch.equal(objective.detach(), ce) and prefix.figures("train")[PREFIX_LOSS] == 0
    assert all(torch.isfinite(p.grad).all() for p in prefix.parameters() if p.grad is not None)


@pytest.mark.parametrize(("head", "message"), [
    ({"weight": -0.1}, r"head.weight=-0.1 must be a float >= 0"),
    ({"prefixes": EXPECTED[:-1]}, r"head.prefixes has 13 entries; it needs one per token .*model.vocab_size=14"),
    ({"prefixes": [*EXPECTED[:-1], 13]}, r"head.prefixes\[13\]=13 must be -1 \(no prefix\) or the id of another"),
    ({"prefixes": [*EXPECTED[:-1], 14]}, r"head.prefixes\[13\]=14 must be -1"),
])
def test_bad_keys_are_refused_by_name(head: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(GPTConfig(vocab_size=V, n_layer=1, d_model=16, n_head=2, max_seq_len=8,
                           head={"name": "prefix", **head}))


def test_a_vocabulary_without_prefixes_or_a_table_is_refused_before_training() -> None:
    char = train_char(["to be or not"], vocab_size=0)
    with pytest.raises(ValueError, match=r"head=prefix: no token of data=shakespeare's vocabulary .* head=next"):
        fit_vocabulary({"name": "prefix", "weight": 0.25, "prefixes": None}, char, 10, None, "shakespeare")
    assert fit_vocabulary({"name": "prefix", "weight": 0.0}, char, 10, None, "x")["prefixes"] == [-1] * 10
    with pytest.raises(ValueError, match=r"head=prefix reads the tokenizer's vocabulary .* data=mqar has no tokenizer"):
        fit_vocabulary({"name": "prefix", "prefixes": None}, None, 10, None, "mqar")
    assert fit_vocabulary({"name": "next"}, None, 10, None, "mqar") == {"name": "next"}
    model = _model({"name": "prefix", "prefixes": None}).train()  # built from Python without the data's table
    idx, targets = _batch()
    assert model(idx).shape == (2, 12, V)  # logits, generation: no table needed
    with pytest.raises(ValueError, match=r"head=prefix has no prefix table \(head.prefixes=null\)"):
        model(idx, targets)


def test_the_fade_is_the_records_schedule_of_the_weight() -> None:
    """head.fade=[1/3, 2/3] (record 88): the objective's prefix part is w·L_prefix until a third of max_steps, then
    falls linearly to 0 at two thirds and stays 0; the factor is a function of the step (a resume's is the same)."""
    idx, targets = _batch()
    plain = _model({"name": "prefix", "weight": 0.25, "prefixes": EXPECTED}).train()
    faded = _model({"name": "prefix", "weight": 0.25, "prefixes": EXPECTED, "fade": [1 / 3, 2 / 3]}).train()
    full_obj, ce, _ = plain(idx, targets, parts=True)
    for step, factor in ((0, 1.0), (30, 1.0), (45, 0.5), (54, 0.2), (60, 0.0), (90, 0.0)):  # 2 - step/30
        faded.head.set_step(step, 90)
        objective, ce_f, _ = faded(idx, targets, parts=True)
        torch.testing.assert_close(ce_f, ce)
        torch.testing.assert_close(objective - ce_f, factor * (full_obj - ce), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"head.fade=\[0.6, 0.3\] must be \[a, b\] with 0 <= a < b <= 1"):
        _model({"name": "prefix", "prefixes": EXPECTED, "fade": [0.6, 0.3]})


# ---- head=mtp_logits (record 53): the same logits on the tokens after the next ---------------------------------


def test_mtp_logits_is_the_records_weighted_sum_over_the_next_k_tokens() -> None:
    """objective = (1/N) Σ_i Σ_k w_k·CE(z_i, t_{i+k}), w_1 = 1, the entries past a sequence's end zero (the record's
    loss, by hand from the logits); the record's fade: [1, .5, .25 → 0] → [1, .5 → 0] → [1] in thirds."""
    from lmlab.model.mtp_logits import MTP_LOGITS_LOSS, faded

    model = _model({"name": "mtp_logits", "weights": [0.5, 0.25], "fade": True}, **SPEEDRUN_CAP).train()
    idx, targets = _batch()
    B, T = targets.shape
    for step, w in ((0, [0.5, 0.25]), (15, [0.5, 0.125]), (30, [0.5, 0.0]), (45, [0.25, 0.0]), (60, [0.0, 0.0])):
        assert faded([0.5, 0.25], step, 90) == pytest.approx(w)
        model.head.set_step(step, 90)
        objective, ce, _ = model(idx, targets, parts=True)
        with torch.no_grad():
            logits = 23 * torch.sigmoid((model.ln_f(trunk(model, idx)) @ model.head_weight.T + 5) / 7.5)
            lse = torch.logsumexp(logits, -1)  # (B, T)
            total = torch.zeros(())
            for k, wk in enumerate([1.0, *w], start=1):
                later = torch.full((B, T), -1)
                later[:, :T - k + 1] = targets[:, k - 1:]  # t_{i+k}
                hit = later >= 0
                picked = logits.gather(-1, later.clamp(min=0)[..., None])[..., 0]
                total = total + wk * torch.where(hit, lse - picked, 0.0).sum()
        torch.testing.assert_close(objective.detach(), total / (B * T), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.figures("train")[MTP_LOGITS_LOSS], (objective - ce).detach())
    model.eval()
    with torch.no_grad():  # evaluation: the next token only
        torch.testing.assert_close(model(idx, targets), F.cross_entropy(
            (23 * torch.sigmoid((model.ln_f(trunk(model, idx)) @ model.head_weight.T + 5) / 7.5)).flatten(0, 1),
            targets.flatten()))
    with pytest.raises(ValueError, match=r"head.weights=\[-0.5\] are w_2 .. w_K"):
        _model({"name": "mtp_logits", "weights": [-0.5]})
