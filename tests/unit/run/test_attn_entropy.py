"""Attention entropy at an evaluated length (lmlab.run.attn_entropy): flat logits give the mean of log n exactly; a
temperature that scales the logits up lowers it; scores without distributions have none."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.run.attn_entropy import attention_entropy


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=30, n_layer=2, d_model=16, n_head=2, max_seq_len=12, **kw)).eval()


def test_flat_logits_give_the_mean_log_of_the_keys_read() -> None:
    model = _model()
    for name, p in model.named_parameters():
        if "c_attn" in name:  # queries and keys (and values) 0: every logit 0, every row uniform
            torch.nn.init.zeros_(p)
    windows = torch.randint(0, 30, (3, 13))
    expected = sum(math.log(i + 1) for i in range(12)) / 12  # query i reads i + 1 keys
    assert attention_entropy(model, windows) == pytest.approx(expected, rel=1e-6)


def test_entropy_falls_as_the_temperature_sharpens_and_relu2_has_none() -> None:
    windows = torch.randint(0, 30, (3, 13), generator=torch.Generator().manual_seed(0))
    plain = attention_entropy(_model(), windows)
    sharp = attention_entropy(_model(attention={"name": "mha", "temperature": 0.25}), windows)
    assert 0 < sharp < plain < math.log(12)
    assert attention_entropy(_model(attention={"name": "mha", "score": "relu2"}), windows) is None


def test_the_monitor_reads_a_recorded_fp32_input_through_bf16_weights() -> None:
    """FSDP2's mixed precision gathers bf16 weights while the monitor's recorded attention input is fp32 (found on an
    H200: trainer=fsdp2 compile=true stopped at the first attention figures): the input is read in the weights'
    dtype, and the maps are the fp32 model's to bf16's precision."""
    from lmlab.run.monitor import in_weights_dtype

    model = _model()
    attn, x = model.h[0].attn, torch.randn(2, 12, 16)
    p32, max32 = attn.probs(x, model.pos, None)
    attn.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        attn.probs(x, model.pos, None)
    p16, max16 = attn.probs(in_weights_dtype(attn, x), model.pos, None)
    assert p16.dtype == torch.bfloat16
    torch.testing.assert_close(p16.float(), p32, atol=2e-2, rtol=0)
    torch.testing.assert_close(max16.float(), max32, atol=5e-2, rtol=5e-2)
    assert in_weights_dtype(attn, x.long()).dtype == torch.long  # token ids pass as they are
