"""python -m lmlab.bench: lmlab's training step against Hugging Face `transformers`, side by side in one process.

    python -m lmlab.bench                          # llama-like vs LlamaForCausalLM, fp32, the config's threads
    python -m lmlab.bench --config gpt2 --threads 1 --json bench.json
    python -m lmlab.bench --precision bf16 --set model.n_layer=4 model.d_model=256

lmlab goes through the real path: `compose(overrides)` -> GPTConfig -> `LitGPT` (whose `loss` and
`configure_optimizers` are what Lightning runs), then the step: forward, cross-entropy on float logits, backward,
grad-norm clipping, AdamW over lmlab's parameter groups, LR schedule. The peer (LlamaForCausalLM for pre/rms/swiglu/
rope, GPT2LMHeadModel for pre/layer/mlp+gelu_tanh/learned) is built at the same sizes, with SDPA attention, and runs
the very same loop. Shared machines are noisy, so only ratios of blocks timed next to each other mean anything:
each repeat times one block per contestant (order alternating, A B then B A), a matmul ceiling, and the ratios of
that repeat; the table gives medians and min-max over repeats. Needs the `bench` extra (transformers).
"""

from __future__ import annotations

from lmlab.bench.cli import main, run
from lmlab.bench.peers import CONFIGS, PEER_ARCH, describe, hf_peer
from lmlab.model.flops import matmul_params

__all__ = ["CONFIGS", "PEER_ARCH", "describe", "hf_peer", "main", "matmul_params", "run"]
