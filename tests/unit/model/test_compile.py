"""torch.compile sees the training forward (model + loss) as one graph, for every position, RoPE scaling, attention,
dense FFN and block: a graph break splits the compiled step into pieces the compiler cannot fuse across (found on
the CPU for the GPU issue: RoPE's table cache asked torch.is_inference_mode_enabled(), a break in every layer of
every RoPE model, and GPT._routed's walrus cell, a break after the loss). `ffn=moe` is the exception by design: its
routing has data-dependent shapes (bincount, the dropless expert split) and runs outside the graph."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.block import BLOCKS
from lmlab.model.ffn import FFNS
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS
from lmlab.model.rope_scaling import ROPE_SCALINGS

# dynamic RoPE scaling's frequencies read the registry's lru_cache'd signature check while dynamo traces them
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
SIZES = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=16)


def _breaks(**axes) -> tuple[int, int, list[str]]:
    """(graphs, graph breaks, reasons) of dynamo's trace of a training forward with targets."""
    model = GPT(validate(GPTConfig(**{**SIZES, **axes}))).train()
    x = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(x, x)
    return ex.graph_count, ex.graph_break_count, [str(b.reason).splitlines()[0] for b in ex.break_reasons]


CASES = ([{"position": {"name": p}} for p in sorted(POSITIONS)]
         + [{"position": {"name": "rope"}, "rope_scaling": {"name": s}} for s in sorted(ROPE_SCALINGS)]
         + [{"attention": {"name": a}} for a in sorted(ATTENTIONS)]
         + [{"ffn": {"name": f}} for f in sorted(FFNS) if f != "moe"]
         + [{"block": {"name": b}} for b in sorted(BLOCKS)]
         + [{"attention": {"name": "mha", "window": 4}, "position": {"name": "rope"}}]
         + [{"head": {"name": "mtp", "depth": 2}, "position": {"name": "rope"}}, {"untie_at_step": 3},
            {"residual": {"scaled": {"stream": True}, "x0": {}, "unet": {}, "value_embed": {}}, "n_layer": 6}])
# In the default run: the default model and a llama-like one (RoPE, RMSNorm, SwiGLU); every case (~1-2 s each) is slow.
FAST = [{}, {"position": {"name": "rope"}, "norm": {"name": "rms"}, "ffn": {"name": "swiglu"}}]


def _id(axes: dict) -> str:
    return ",".join(f"{k}={v['name'] if 'name' in v else '+'.join(v)}" if isinstance(v, dict) else f"{k}={v}"
                    for k, v in axes.items()) or "default"


@pytest.mark.parametrize("axes", FAST + [pytest.param(a, marks=pytest.mark.slow) for a in CASES], ids=_id)
def test_the_training_forward_compiles_to_one_graph(axes: dict) -> None:
    graphs, breaks, reasons = _breaks(**axes)
    assert (graphs, breaks, reasons) == (1, 0, [])  # a break dynamo cannot resume from is a reason, not a count


@pytest.mark.parametrize("scaling", ["none", "dynamic_ntk"])
def test_compiled_rope_tables_are_the_cached_ones(scaling: str) -> None:
    """Under torch.compile RoPE builds its tables in the graph instead of reading its cache: the same loss and
    gradients (dynamo's own `eager` backend: the traced graph, run op by op)."""
    model = GPT(validate(GPTConfig(**SIZES, position={"name": "rope"}, rope_scaling={"name": scaling}))).train()
    x = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    want = model(x, x)
    (grad,) = torch.autograd.grad(want, [model.h[0].attn.c_attn.weight])
    got = torch.compile(model, backend="eager")(x, x)
    (got_grad,) = torch.autograd.grad(got, [model.h[0].attn.c_attn.weight])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, grad, rtol=1e-6, atol=1e-7)
