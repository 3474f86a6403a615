"""ffn=moe: the router's choice and weights against a hand computation; dropless routing equals a per-token loop over
the chosen experts (grouped matmul and the padded batched matmul alike); capacity drops the late assignments and counts them;
the balance loss, router z-loss, the loss-free bias update and the monitor's figures against their formulas; the
parameter counts (total, active, per expert matched as its kind) and active FLOPs; bad input refused by key;
compile=true trains as eager does (slow)."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.resolve import resolve

MOE = ["ffn=moe", "ffn.n_experts=4", "ffn.top_k=2", "ffn.hidden_mult=2", "ffn.balance_loss=0.01",
       "ffn.router_z_loss=0.001", "ffn.bias_update_rate=0.01"]


def _rows(run) -> dict[int, dict[str, str]]:
    import csv

    with open(run / "metrics.csv") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


def test_a_resumed_run_with_bias_balancing_reproduces_the_uninterrupted_metrics(corpus, tmp_path) -> None:
    """Ctrl-C at step 17, resume: every figure of metrics.csv (losses, gradients, routing figures) is the
    uninterrupted run's; the bias in the last checkpoint is the one the uninterrupted run ends with."""
    from tests.runs import straight_and_resumed

    straight, resumed = straight_and_resumed(corpus, tmp_path, *MOE)
    a, b = _rows(straight), _rows(resumed)
    assert sorted(a) == sorted(b) == list(range(30))
    columns = [c for c in a[0] if not c.startswith("perf/")]
    assert {"moe/load_cv/layer_01", "moe/router_entropy/layer_00", "train/moe_balance_loss",
            "train/router_z_loss"} <= set(columns)
    for step in a:
        for c in columns:
            if a[step][c] or b[step][c]:
                assert float(b[step][c]) == pytest.approx(float(a[step][c]), rel=1e-4, abs=1e-6), (step, c)
    biases = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
              for run in (straight, resumed)]
    key = "model.h.0.mlp.expert_bias"
    assert biases[0][key].abs().sum() > 0 and torch.equal(biases[0][key], biases[1][key])


def test_ddp_and_fsdp2_routing_figures_equal_one_process_on_the_same_global_batch(corpus, tmp_path) -> None:
    """2 ranks of 4 sequences (DDP, and FSDP2 with the experts sharded) vs 1 process of 8 (rank r holds the global
    batch's rows 4r .. 4r + 3): the routing figures, summed over the ranks before they are formed, are the one
    process's, at every step. (The balance loss is left out of this objective: like Switch's, each rank's is its own
    batch's, a product of two means that the averaged gradients do not make global; the z-loss, a mean, and the bias,
    from the summed load, are.)"""
    from tests.runs import ROOT, cli, one_and_two_ranks, tiny

    moe = [a for a in MOE if not a.startswith("ffn.balance_loss")]
    common = [a for a in tiny(corpus, tmp_path / "cache", *moe) if not a.startswith(("trainer.max_steps",
                                                                                      "data.batch"))]
    common += ["trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.precision=32-true", "logger=csv"]
    one, two = one_and_two_ranks(common, tmp_path)
    sharded = tmp_path / "fsdp2"  # the experts sharded with their block (torch's fully_shard, gloo)
    res = cli(str(ROOT / "train.py"), *common, "data.batch_size=4", "trainer=fsdp2", "trainer.accelerator=cpu",
              "trainer.devices=2", f"hydra.run.dir={sharded}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    a = _rows(one)
    figs = [c for c in a[0] if c.startswith("moe/")]
    assert len(figs) == 2 * 6  # 2 layers x 6 figures
    for b in (_rows(two), _rows(sharded)):
        for step in range(0, 6, 5):
            for c in figs:
                assert float(b[step][c]) == pytest.approx(float(a[step][c]), rel=1e-4, abs=1e-6), (step, c)


def _train_steps(compile: bool, steps: int = 4) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    """LitGPT as train.py builds it with compile=true/false: `steps` AdamW steps on one batch of a tiny ffn=moe model
    with both balancing losses and the loss-free bias on; (LM losses, aux losses, layer 0's bias)."""
    from lmlab.run.lit import LitGPT

    torch.manual_seed(0)
    ffn = {"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 16, "n_shared": 1,
           "score": "sigmoid", "balance_loss": 0.01, "router_z_loss": 0.001, "bias_update_rate": 0.01}
    model = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16, ffn=ffn)).to_dict()
    lit = LitGPT(model=model, optim={"name": "adamw"}, schedule={"name": "constant"}, max_steps=steps,
                 compile=compile).train()
    opt = torch.optim.AdamW(lit.model.parameters(), lr=1e-2)
    x, y = torch.randint(0, 50, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    losses, auxes = [], []
    for _ in range(steps):
        objective, loss, _ = lit(x, y, parts=True)  # what LitGPT.training_step runs for a routed model
        auxes.append((objective - loss).detach())
        objective.backward()
        opt.step()
        opt.zero_grad()
        lit.model.update_balancing()  # LitGPT's on_before_optimizer_step: the bias steers the next forward alike
        losses.append(loss.item())
    return losses, auxes, lit.model.h[0].mlp.expert_bias.clone()


@pytest.mark.slow  # ~35 s on one CPU thread, nearly all of it compiling
def test_compile_true_trains_an_moe_as_eager_does() -> None:
    """torch.compile (compile=true) around the routed model: the same losses, balancing terms (the aux reaches the
    objective through the compiled graph) and bias updates (the load recorded in the forward) as eager, and the
    loss falls. The grouped matmul stays eager inside the graph (torch.compiler.disable)."""
    import torch._dynamo

    torch._dynamo.reset()
    eager = _train_steps(compile=False)
    compiled = _train_steps(compile=True)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-6)
    assert all(a > 0 for a in eager[1])  # the balancing losses are in the objective
    torch.testing.assert_close(compiled[2], eager[2], rtol=0, atol=0)  # ±rate steps: exact
    assert compiled[2].abs().sum() > 0 and compiled[0][-1] < compiled[0][0]
