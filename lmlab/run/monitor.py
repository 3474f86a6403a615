"""Stability instrumentation: the figures that show why one architecture trains and another doesn't.

`Divergence` decides when a run has failed (a result, not a crash). `StabilityMonitor` logs, with names that
group into W&B panels: per-layer gradient norms before clipping (split attn / ffn, plus embeddings and head),
parameter norms, update ratios ‖Δθ‖/‖θ‖, residual-stream RMS after each block, attention entropy and max
logit on a sampled batch, the loss above the unigram plateau, the gradient-norm profile at init
(Xiong et al., 2020, Fig. 3), and the two figures of "incremental explosion" (Admin, Liu et al., 2020; DeepNet,
Wang et al., 2022): how far one update moves the model's output, `update/output_change`, and how large each
sublayer's output is against its input, `act/ratio/layer_XX/<sublayer>`; for an MoE, each layer's expert load
(max/mean, coefficient of variation), router entropy, dropped share and balancing losses, `moe/<figure>/layer_XX`.
Under DDP the gradients are already all-reduced; under FSDP each rank holds a shard, so squared norms are summed
across ranks: either way the logged figures are the global ones (the routing counts are summed over ranks too).
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor

from lmlab import names
from lmlab.model.attention import attention_sublayer, distribution
from lmlab.model.capabilities import NamesParams, Routes, sublayer_name
from lmlab.record.tracking import log_at


class Divergence:
    """Decides when a run has failed.

    - diverged: a non-finite loss, or a loss above `spike_factor` × its running minimum after `min_steps`
      (0 disables the spike rule);
    - collapsed: at step `collapse_after` (null: off) the mean loss of the last `window` steps is still within
      `collapse_margin` nats of the unigram entropy — the model learnt token frequencies and nothing else.
    """

    def __init__(self, *, spike_factor: float = 3.0, min_steps: int = 20, collapse_after: int | None = None,
                 collapse_margin: float = 0.1, window: int = 20, unigram: float | None = None) -> None:
        self.spike_factor, self.min_steps = spike_factor, min_steps
        self.collapse_after, self.collapse_margin, self.unigram = collapse_after, collapse_margin, unigram
        self.recent: deque[float] = deque(maxlen=window)
        self.best = math.inf
        self.step: int | None = None  # the step at which the run failed
        self.status: str | None = None  # "diverged" or "collapsed"
        self.reason: str | None = None

    def check(self, step: int, loss: float) -> bool:
        if not math.isfinite(loss):
            self._fail(step, "diverged", f"non-finite loss ({loss})")
        elif self.spike_factor and step >= self.min_steps and loss > self.spike_factor * self.best:
            self._fail(step, "diverged", f"loss {loss:.4g} > {self.spike_factor} x running min {self.best:.4g}")
        else:
            self.best = min(self.best, loss)
            self.recent.append(loss)
            mean = sum(self.recent) / len(self.recent)
            if (self.collapse_after is not None and self.unigram is not None and step == self.collapse_after
                    and mean > self.unigram - self.collapse_margin):
                self._fail(step, "collapsed", f"mean loss {mean:.4g} at step {step} is on the unigram plateau "
                                              f"({self.unigram:.4g} nats)")
        return self.step is not None

    def _fail(self, step: int, status: str, reason: str) -> None:
        self.step, self.status, self.reason = step, status, reason

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's, in place of this rule's: a resume loads it twice (the module's hook, then the trainer's
        restore), and extending the window would count the saved losses twice in the collapse rule's mean."""
        self.best = state.get("best", math.inf)
        self.recent.clear()
        self.recent.extend(state.get("recent", []))


def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameter groups named as the metrics are: layer_XX/<sublayer> (each sublayer's own `sublayer` name: attn and
    ffn for a transformer layer, gau for a GAU), layer_XX/norm (the rest of the block), embed, head, and mtp (head=mtp's
    modules; head=classify's label layer: classify)."""
    groups: dict[str, list[nn.Parameter]] = {"embed": list(model.wte.parameters()) + list(model.pos.parameters())}
    for i, block in enumerate(model.h):
        taken: set[nn.Parameter] = set()
        for attr in block.sublayer_names:
            module = getattr(block, attr)
            params = list(module.parameters())
            groups[f"{names.layer(i)}/{sublayer_name(module, attr)}"] = params
            taken.update(params)
        groups[f"{names.layer(i)}/norm"] = [p for p in block.parameters() if p not in taken]
    embed = {id(p) for p in groups["embed"]}
    groups["head"] = [p for p in list(model.ln_f.parameters()) + list(model.lm_head.parameters())
                      if id(p) not in embed]  # a tied head is counted once, with the embeddings
    if own := list(model.head.parameters()):  # head=mtp's modules (head=classify's layer): a group beside the head
        groups[model.head.params_group if isinstance(model.head, NamesParams) else "mtp"] = own
    return groups


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter or gradient; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    return sum((local(t).detach().float().pow(2).sum() for t in tensors), torch.zeros(()))


def sum_over_shards(trainer, squares: torch.Tensor) -> torch.Tensor:
    """Squared norms summed across ranks when each rank holds a shard of the parameters (FSDP, FSDP2: each rank's
    `local` shard, every element on exactly one rank); under DDP every rank already has the whole (all-reduced)
    gradient."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)) and trainer.world_size > 1:
        return trainer.strategy.reduce(squares.to(trainer.strategy.root_device), reduce_op="sum")
    return squares


def in_weights_dtype(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype `module`'s weights compute in: the recorded input of a sublayer read again outside the
    forward, where FSDP2's mixed precision (bf16 weights once gathered) no longer casts it (an H200 run of
    trainer=fsdp2 compile=true stopped at the first attention figures on `mat1 and mat2 must have the same dtype`)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), x.dtype)
    return x if x.dtype == dtype or not x.is_floating_point() else x.to(dtype)


class StabilityMonitor(Callback):
    """Every `every_n_steps`, besides the gradient, parameter and update norms:

    - `update/output_change` = ‖f(x; θ_{t+1}) − f(x; θ_t)‖ / ‖f(x; θ_t)‖, f the logits, x a fixed probe: the first
      `probe_samples` sequences of the first training batch (rank 0's, i.e. the global batch's first rows; kept in
      the checkpoint, so a resumed run measures on the same sequences). DeepNet's measure of an update's size, the
      one that explodes in a deep Post-LN model. f(x; θ_t) is taken in `on_before_optimizer_step` (the gradients are
      in, the weights not yet changed) and f(x; θ_{t+1}) in `on_train_batch_end`: two forward passes on the probe,
      in eval mode (no dropout: only θ changes) under no_grad, in fp32 (a small change would drown in bf16's
      rounding). Costs two forwards of `probe_samples` sequences and one (probe, T, vocab) logits tensor held
      across the step.
    - `act/ratio/layer_XX/<sublayer>` = ‖F(x)‖ / ‖x‖ over the whole batch, F each module carrying a `sublayer`
      marker (attn, ffn, gau), x *the sublayer's own input*, both read by one forward hook on the training
      forward. Its own input rather than the residual stream: it is what the module sees under every placement,
      and under the post-norm placements (post, deepnorm, post_nonres) it *is* the stream, so the figure is Su's
      ‖GAU(x_l)‖/‖x_l‖ in x_{l+1} = LN(x_l + GAU(x_l)) and DeepNet's F(x)/x; under pre-norm it is the sublayer's
      gain on the normalised stream (the stream's own size is `act/rms/layer_XX`). Squared sums are added over
      ranks before the ratio: one process's figure on the global batch.
    """

    def __init__(self, *, every_n_steps: int = 10, attn_every_n_steps: int = 100, attn_samples: int = 4,
                 init_profile: bool = True, probe_samples: int = 2, unigram: float | None = None,
                 plot_dir: str | None = None) -> None:
        self.every, self.attn_every, self.attn_samples = every_n_steps, attn_every_n_steps, attn_samples
        self.init_profile, self.unigram, self.plot_dir = init_profile, unigram, plot_dir
        self.probe_samples = probe_samples
        self.probe: torch.Tensor | None = None  # (probe_samples, T) token ids, fixed for the whole run
        self._out_before: torch.Tensor | None = None  # f(probe; θ_t) while a measured step is under way
        self._ratio: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (‖F(x)‖², ‖x‖²)
        self._ratios_due = False
        self.profile: dict[str, float] | None = None  # layer -> grad norm at step 0
        self._act: dict[int, torch.Tensor] = {}
        self._attn_in: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # input, document numbers
        self._before: dict[str, list[torch.Tensor]] | None = None
        self._hooks: list = []

    # -- helpers ---------------------------------------------------------------------------------------------
    def _due(self, step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def _reduce_sq(self, trainer, values: torch.Tensor) -> torch.Tensor:
        return sum_over_shards(trainer, values).cpu()

    def _norms(self, trainer, groups: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        sq = self._reduce_sq(trainer, torch.stack([_sq(ts) for ts in groups.values()]))
        return dict(zip(groups, sq.sqrt().tolist()))

    def state_dict(self) -> dict[str, Any]:
        # a resumed run's summary keeps its gradient profile at init, and its output change the same probe
        return {"profile": self.profile, "probe": self.probe}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.profile = state_dict.get("profile", self.profile)
        self.probe = state_dict.get("probe", self.probe)

    @torch.no_grad()
    def _probe_logits(self, pl_module) -> torch.Tensor:
        """f(probe; θ) in eval mode, fp32, without recording (the hooks must not see the probe)."""
        model, recording, ratios = pl_module.model, self._recording, self._ratios_due
        self._recording = self._ratios_due = False
        was_training = model.training
        model.eval()
        try:
            with torch.autocast(device_type=pl_module.device.type, enabled=False):
                return model(self.probe.to(pl_module.device)).float()
        finally:
            model.train(was_training)
            self._recording, self._ratios_due = recording, ratios

    # -- hooks -------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        model = pl_module.model
        self.groups = layer_groups(model)
        for i, block in enumerate(model.h):
            self._hooks.append(block.register_forward_hook(self._act_hook(i)))
            if (attn := attention_sublayer(block)) is not None:
                self._hooks.append(attn.register_forward_pre_hook(self._attn_hook(i), with_kwargs=True))
            for attr in block.sublayer_names:
                module = getattr(block, attr)
                name = names.per_layer(names.ACT_RATIO, i, sublayer_name(module, attr))
                self._hooks.append(module.register_forward_hook(self._ratio_hook(name)))

    def on_fit_end(self, trainer, pl_module) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _act_hook(self, i: int):
        def hook(module, args, out):
            if self._recording:
                self._act[i] = out.detach().float().pow(2).mean()
        return hook

    def _ratio_hook(self, name: str):
        def hook(module, args, out):
            if self._ratios_due:
                self._ratio[name] = (out.detach().float().pow(2).sum(), args[0].detach().float().pow(2).sum())
        return hook

    def _attn_hook(self, i: int):
        def hook(module, args, kwargs):
            if self._recording:
                doc = kwargs.get("doc")  # the sequences' document numbers, under attention.doc_mask
                self._attn_in[i] = (args[0].detach()[: self._attn_k], None if doc is None else doc[: self._attn_k])
        return hook

    _recording = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._recording = self._due(trainer.global_step, self.every) or self._due(trainer.global_step, self.attn_every)
        # The attention figures use the first attn_samples sequences of the *global* batch (rank r holds global
        # rows r*B .. r*B+B-1), so a DDP run reports what one process would on the same global batch.
        local = batch[0].size(0)
        self._attn_k = max(0, min(local, self.attn_samples - trainer.global_rank * local))
        self._act, self._attn_in = {}, {}
        self._ratios_due, self._ratio = self._due(trainer.global_step, self.every), {}
        if self.probe is None and self.every > 0:
            # rank 0's first rows are the global batch's first: every rank probes the same sequences
            self.probe = trainer.strategy.broadcast(batch[0][: self.probe_samples].detach().cpu(), src=0)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        first = step == 0 and self.init_profile and self.profile is None
        if not (self._due(step, self.every) or first):
            return
        grads = {k: [p.grad for p in ps if p.grad is not None] for k, ps in self.groups.items()}
        norms = self._norms(trainer, grads)
        layers = sorted({k.split("/")[0] for k in norms if k.startswith("layer_")})
        per_layer = {layer: math.sqrt(sum(norms[k] ** 2 for k in norms if k.startswith(layer + "/")))
                     for layer in layers}
        metrics = {names.grad_norm(k): v for k, v in norms.items() if not k.endswith("/norm")}
        metrics.update({names.grad_norm(k): v for k, v in per_layer.items()})
        if first:
            self.profile = {"embed": norms["embed"], **per_layer, "head": norms["head"]}
            self._log_profile(trainer)
        if self._due(step, self.every):
            params = {k: [p for p in ps] for k, ps in self.groups.items()}
            pnorms = self._norms(trainer, params)
            for layer in layers:
                metrics[f"{names.PARAM_NORM}/{layer}"] = math.sqrt(sum(pnorms[k] ** 2 for k in pnorms
                                                               if k.startswith(layer + "/")))
            self._before = {layer: [p.detach().clone() for k in self.groups if k.startswith(layer + "/")
                                    for p in self.groups[k]] for layer in layers}
            if self.probe is not None:
                self._out_before = self._probe_logits(pl_module)
            log_at(trainer, metrics, step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the step just taken
        metrics: dict[str, float] = {}
        if outputs is None:  # training_step skipped the update (the divergence rule stopped the run): nothing moved
            self._before = self._out_before = None
        if self._before is not None:
            layers = list(self._before)
            num, den = [], []
            for layer in layers:
                now = [p for k in self.groups if k.startswith(layer + "/") for p in self.groups[k]]
                num.append(_sq([a.detach() - b for a, b in zip(now, self._before[layer])]))
                den.append(_sq(self._before[layer]))
            sq = self._reduce_sq(trainer, torch.stack(num + den))
            for j, layer in enumerate(layers):
                metrics[f"{names.UPDATE_RATIO}/{layer}"] = math.sqrt(sq[j] / max(float(sq[len(layers) + j]), 1e-30))
            self._before = None
        if self._out_before is not None:
            after = self._probe_logits(pl_module)
            change = (after - self._out_before).norm() / self._out_before.norm().clamp_min(1e-30)
            metrics[names.OUTPUT_CHANGE] = float(change)
            self._out_before = None
        if self._ratio:
            ratios = list(self._ratio)
            sq = torch.stack([torch.stack(self._ratio[k]) for k in ratios])  # (sublayers, 2): ‖F(x)‖², ‖x‖²
            sq = trainer.strategy.reduce(sq, reduce_op="sum") if trainer.world_size > 1 else sq
            metrics.update({k: math.sqrt(out / max(inp, 1e-30)) for k, (out, inp) in zip(ratios, sq.tolist())})
        if self._act:
            ms = torch.stack([self._act[i] for i in sorted(self._act)])
            ms = trainer.strategy.reduce(ms, reduce_op="mean") if trainer.world_size > 1 else ms
            metrics.update({names.per_layer(names.ACT_RMS, i): v for i, v in enumerate(ms.sqrt().tolist())})
        if self._attn_in and self._due(step, self.attn_every):
            metrics.update(self._attention_stats(trainer, pl_module))
        if self._due(step, self.every):
            metrics.update(self._routing_figures(trainer, pl_module))
            metrics.update(self._mixer_figures(trainer, pl_module))
        if self.unigram is not None and outputs and "loss" in outputs and self._due(step, self.every):
            loss = outputs["loss"].detach().float()
            loss = trainer.strategy.reduce(loss, reduce_op="mean") if trainer.world_size > 1 else loss  # the global
            metrics[names.LOSS_VS_UNIGRAM] = float(loss) - self.unigram  # batch's, as train/loss is (not rank 0's)
        self._recording, self._act, self._attn_in = False, {}, {}
        self._ratios_due, self._ratio = False, {}
        if metrics:
            log_at(trainer, metrics, step)

    @torch.no_grad()
    def _mixer_figures(self, trainer, pl_module) -> dict[str, float]:
        """Each recurrent mixer layer's `mixer/<figure>/layer_XX` from this step's forward (its `figures()`: the final
        state's norm, its gates' means; lmlab.model.mixer), averaged over ranks: what a linear layer has in place of
        attention weights."""
        model = pl_module.model
        layers = [(layer.index, model.h[layer.index].mix) for layer in model.plan if layer.recurrent]
        keys = [(i, fig, v) for i, m in layers for fig, v in m.figures().items()]
        if not keys:
            return {}
        values = torch.stack([v.float() for *_, v in keys]).to(trainer.strategy.root_device)
        values = trainer.strategy.reduce(values, reduce_op="mean") if trainer.world_size > 1 else values
        return {names.per_layer(f"{names.MIXER}/{fig}", i): v for (i, fig, _), v in zip(keys, values.tolist())}

    @torch.no_grad()
    def _routing_figures(self, trainer, pl_module) -> dict[str, float]:
        """Each MoE layer's `moe/<figure>/layer_XX` (lmlab.model.moe.figures) from its routing sums of this step's
        forward, summed over ranks first: the global batch's load, entropy, drops and balancing losses."""
        from lmlab.model.moe import figures

        layers = [(i, m) for i, block in enumerate(pl_module.model.h) for name in block.sublayer_names
                  if isinstance(m := getattr(block, name), Routes) and m.stats is not None]
        if not layers:
            return {}
        sums = torch.stack([m.stats for _, m in layers]).to(trainer.strategy.root_device)  # (layers, 2E + 4)
        sums = trainer.strategy.reduce(sums, reduce_op="sum") if trainer.world_size > 1 else sums
        return {names.per_layer(f"{names.MOE}/{fig}", i): v for (i, m), row in zip(layers, sums.cpu())
                for fig, v in figures(row, m.n_experts, m.top_k).items()}

    @torch.no_grad()
    def _attention_stats(self, trainer, pl_module) -> dict[str, float]:
        """Mean attention entropy (nats, over heads, queries and sampled sequences) and max logit per layer. The
        entropy only for scores whose rows are distributions (`score.sums_to_one`; relu²/n rows are not)."""
        from lmlab.run.distributed import gathered

        model, out = pl_module.model, {}
        sums, counts, maxes, sinks, firsts, first_counts = [], [], [], [], [], []
        for i in sorted(self._attn_in):
            x, doc = self._attn_in[i]
            with gathered(model.h[i], model):  # FSDP2: the block's and the root's (positions) full weights
                attn = attention_sublayer(model.h[i])
                stats = attn.probs(in_weights_dtype(attn, x), model.pos, doc) if x.size(0) else None
            if stats is not None:
                p, max_logit = (t.float() for t in stats)  # (B, nh, T, T), (B, nh); fp32 whatever the weights'
                sink = (1 - p.sum(-1)).clamp_min(0) if attn.sink_share else None  # (B, nh, T)
                sinks.append(torch.zeros(()) if sink is None else sink.sum().float())
                firsts.append(p[..., 1:, 0].sum().float())  # the weight later queries put on the first token
                first_counts.append(float(p[..., 1:, 0].numel()))
                if sink is not None:  # a row and its sink's weight make the distribution
                    p = torch.cat((p, sink[..., None]), dim=-1)
                if distribution(attn):
                    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, nh, T)
                    sums.append(entropy.sum().float()), counts.append(float(entropy.numel()))
                else:  # rows that are not distributions have no entropy: none is logged for this layer
                    sums.append(torch.zeros(())), counts.append(0.0)
                maxes.append(max_logit.max().float())
            else:  # this rank holds none of the sampled sequences
                sums.append(torch.zeros(())), counts.append(0.0), maxes.append(torch.tensor(float("-inf")))
                sinks.append(torch.zeros(())), firsts.append(torch.zeros(())), first_counts.append(0.0)
        device = trainer.strategy.root_device
        total, n, mx = torch.stack(sums).to(device), torch.tensor(counts, device=device), torch.stack(maxes).to(device)
        sink_total, first_total = torch.stack(sinks).to(device), torch.stack(firsts).to(device)
        if trainer.world_size > 1:
            sink_total = trainer.strategy.reduce(sink_total, reduce_op="sum")
            first_total = trainer.strategy.reduce(first_total, reduce_op="sum")
            total = trainer.strategy.reduce(total, reduce_op="sum")
            n = trainer.strategy.reduce(n, reduce_op="sum")
            mx = trainer.strategy.reduce(mx, reduce_op="max")
        layers = sorted(self._attn_in)  # the layers with attention weights (a hybrid stack's attention layers)
        distributions = [distribution(attention_sublayer(model.h[i])) for i in layers]
        with_sinks = [attention_sublayer(model.h[i]).sink_share for i in layers]
        sink_mass = (sink_total / n.clamp_min(1)).tolist()
        first_rows = torch.tensor(first_counts, device=device)
        if trainer.world_size > 1:
            first_rows = trainer.strategy.reduce(first_rows, reduce_op="sum")
        first_mass = (first_total / first_rows.clamp_min(1)).tolist()
        for j, (i, ent, m) in enumerate(zip(layers, (total / n.clamp_min(1)).tolist(), mx.tolist())):
            if distributions[j]:
                out[names.per_layer(names.ATTN_ENTROPY, i)] = ent
            out[names.per_layer(names.ATTN_MAX_LOGIT, i)] = m
            if with_sinks[j]:  # the weight the sink takes: attention to nothing
                out[names.per_layer(names.ATTN_SINK_MASS, i)] = sink_mass[j]
            out[names.per_layer(names.ATTN_FIRST_MASS, i)] = first_mass[j]  # the first token as an implicit sink
        return out

    def _log_profile(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        parts, values = list(self.profile), list(self.profile.values())
        for logger in trainer.loggers:
            if hasattr(logger, "log_table"):  # W&B
                logger.log_table("grad_norm_at_init", columns=["part", "grad_norm"], data=list(zip(parts, values)))
        if self.plot_dir:
            from lmlab.record.plots import plot_init_profile

            plot_init_profile({"this run": self.profile}, Path(self.plot_dir) / "grad_norm_at_init.png")
