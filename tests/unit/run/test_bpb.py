"""LitGPT's bits per byte (names.VAL_BPB, TRAIN_BPB): the table set up from the data's tokenizer only for a head that
predicts the next token on text, and a batch's (nats, bytes) leaving out the targets the loss leaves out (IGNORE:
padding, a task's unscored positions)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmlab import compose
from lmlab.config import arch_config
from lmlab.data.token_bin import stand_in_tokenizer
from lmlab.data.tokenizer import train_char
from lmlab.model.encoder import IGNORE
from lmlab.model.gpt import validate
from lmlab.run.lit import LitGPT

EOD = "<|endoftext|>"


def _lit(*overrides: str, vocab: int = 12) -> LitGPT:
    cfg = compose(["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.max_seq_len=8", "position=rope",
                   *overrides])
    return LitGPT(model=validate(arch_config(cfg, vocab_size=vocab)).to_dict(), optim=dict(cfg.optim),
                  schedule=dict(cfg.schedule), max_steps=1)


def _set_up(lit: LitGPT, tokenizer, eod_id: int | None = None) -> LitGPT:
    data = SimpleNamespace(tokenizer=tokenizer, eod_id=eod_id)
    lit._trainer = SimpleNamespace(datamodule=SimpleNamespace(data=data), world_size=1)  # lmlab.run.lit_data's face
    lit.setup("fit")
    return lit


def test_a_next_token_head_on_text_gets_the_table() -> None:
    tok = train_char(["aé€😀"], vocab_size=0, eod=EOD)  # a é € 😀 <unk> eod: ids 0..5
    lit = _set_up(_lit(vocab=8), tok, tok.token_to_id(EOD))
    assert lit.bytes_per_token.tolist() == [1, 2, 3, 4, 1, 0, 0, 0]


@pytest.mark.parametrize("case", ["mlm", "stand-in", "no tokenizer"])
def test_no_bpb_without_next_token_predictions_or_text(case: str) -> None:
    if case == "mlm":  # head=mlm predicts masked tokens: its loss is over other positions, not a text's next bytes
        lit = _set_up(_lit("head=mlm", vocab=6), train_char(["aé€😀"], vocab_size=0))
    else:
        lit = _set_up(_lit(vocab=12), stand_in_tokenizer(12) if case == "stand-in" else None)
    assert lit.bytes_per_token is None


def test_a_batch_counts_the_nats_and_bytes_of_the_targets_the_loss_counts() -> None:
    lit = _set_up(_lit(vocab=8), train_char(["aé€😀"], vocab_size=0))  # bytes per id: 1 2 3 4 1 (unk), then 0
    targets = torch.tensor([[0, 1, 2, IGNORE], [3, IGNORE, IGNORE, 4]])
    nats, n_bytes = lit._bpb_sums(torch.tensor(2.5), targets).tolist()
    assert nats == pytest.approx(2.5 * 5)  # the mean over the 5 counted targets, times them
    assert n_bytes == 1 + 2 + 3 + 4 + 1
    assert lit._bits_per_byte(torch.tensor([nats, n_bytes], dtype=torch.float64)).item() == pytest.approx(
        2.5 * 5 / (math.log(2) * 11))
