"""LitGPT: the Lightning side of training. Thin: it builds the GPT from plain dicts, computes the loss,
sets up the optimizer and schedule, and logs. Stability instrumentation lives in `lmlab.run.monitor`.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as L
import torch

from lmlab import names
from lmlab.config import GPTConfig
from lmlab.data import stages as data_stages
from lmlab.data.token_bytes import token_bytes
from lmlab.model.attention.parts.window import windowed
from lmlab.model.capabilities import StepFollower
from lmlab.model.encoder import IGNORE, TRAIN_KEY, VAL_KEY
from lmlab.model.gpt import GPT
from lmlab.optim import (  # noqa: F401  (OPTIM_LOOP_KEYS, optimizer_spec, validate_optim: importable here, as before)
    OPTIM_LOOP_KEYS,
    OPTIMIZERS,
    SCHEDULES,
    optimizer_spec,
    overrides,
    param_groups,
    validate_optim,
)
from lmlab.optim.capabilities import EvalWeights, FollowsHorizon, WarmupOnly, capabilities
from lmlab.optim.ema import WeightEMA
from lmlab.record.tracking import log_at
from lmlab.registry import build, option_params
from lmlab.run.monitor import Divergence, local, sum_over_shards
from lmlab.run.spikes import SpikeSkip, restore_groups, skip_update


# Read here, not by the optimizer constructor; typed like an option's own keys (grad_clip 0 or null: off).
def configure_optimization(model: torch.nn.Module, optim: dict, schedule: dict, max_steps: int,
                           stages: dict | None = None) -> dict:
    """The optimizer over lmlab's parameter groups and its per-step LR schedule, in Lightning's form.

    The groups are split by role when the optimizer asks for it (Muon) or the parametrisation sets per-role learning
    rates (µP: `model.param.lr_mult(role)`, applied to the group's lr before the schedule reads it). An optimizer
    that is `warmup_only` (schedule-free) runs the constant schedule with the schedule group's warmup_steps."""
    opt_name, _ = option_params("optim", OPTIMIZERS, optimizer_spec(optim))
    param = getattr(model, "param", None)
    caps = capabilities(OPTIMIZERS[opt_name])
    by_role = caps.roles or bool(param is not None and param.per_role)
    groups = param_groups(model, optim.get("weight_decay", 0.0), by_role=by_role, layouts=caps.layouts)
    groups = overrides.split(model, groups, optim.get("groups"))  # optim.groups: settings per tensor
    optimizer = build("optim", OPTIMIZERS, optimizer_spec(optim), groups)
    for g in optimizer.param_groups:  # optim.groups' lr_mult, before the schedule reads the lr
        g["lr"] = g["lr"] * g.get("lr_mult", 1.0)
    if isinstance(optimizer, FollowsHorizon):  # Muon's momentum cool-down
        optimizer.set_max_steps(max_steps)
    if param is not None and param.per_role:  # an option may set its own per-group rule (Muon's spectral one)
        rule = caps.mup_lr_mult
        _, opt_params = option_params("optim", OPTIMIZERS, optimizer_spec(optim))
        for g in optimizer.param_groups:
            mult = rule(g, opt_params, param.width_mult) if rule is not None else None
            g["lr"] = g["lr"] * (param.lr_mult(g["role"]) if mult is None else mult)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optimizer, schedule, max_steps, stages))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def lr_lambda(optimizer: torch.optim.Optimizer, schedule: dict, max_steps: int, stages: dict | None = None):
    """step -> the schedule's LR factor over `max_steps` (data.batch_lr_power's factor under a batch schedule); an
    optimizer that is `warmup_only` (schedule-free) gets the constant schedule with the group's warmup_steps. What the
    LambdaLR reads, and what budget.wall's fitted horizon rebuilds (lmlab.run.wall)."""
    name, params = option_params("schedule", SCHEDULES, schedule)
    if isinstance(optimizer, WarmupOnly) and optimizer.warmup_only:
        name, params = "constant", {"warmup_steps": params.get("warmup_steps", 0)}
    fn, factor = SCHEDULES[name], batch_lr_factor(stages, max_steps)
    return lambda step: fn(step, max_steps, **params) * factor(step)


COMPILE_MODES = ("reduce-overhead", "max-autotune")  # compile=<mode>: torch.compile's modes beside true (its default)


def compile_mode(compile: bool | str) -> dict[str, str]:
    """torch.compile's arguments for `compile`: true, its default; `reduce-overhead`, CUDA graphs (the step replayed
    from a recorded graph: no kernel-launch cost per op, for a step whose shapes never change); `max-autotune`, that
    and Inductor's autotuned kernels."""
    return {"mode": compile} if isinstance(compile, str) else {}


def batch_lr_factor(stages: dict | None, max_steps: int):
    """step -> (B(step)/B₀)^p under data.batch_schedule with data.batch_lr_power p (lmlab.data.stages); 1 otherwise."""
    batch, power = (stages or {}).get("batch"), float((stages or {}).get("batch_lr_power") or 0.0)
    if not batch or not power:
        return lambda step: 1.0
    return lambda step: (data_stages.at(batch, step, max_steps, batch[0][1]) / batch[0][1]) ** power


class LitGPT(L.LightningModule):
    def __init__(self, model: dict[str, Any], optim: dict[str, Any], schedule: dict[str, Any], max_steps: int,
                 compile: bool | str = False, divergence: dict[str, Any] | None = None,
                 spike_skip: dict[str, Any] | None = None, seed: int = 0, stages: dict[str, Any] | None = None
                 ) -> None:
        """`stages`: data.batch_schedule, data.seq_schedule and data.batch_lr_power (lmlab.data.stages), checked;
        None: one batch size and length throughout."""
        super().__init__()
        self.save_hyperparameters(logger=False)  # the loggers get the whole run config from lmlab.record.tracking
        self.model = GPT(GPTConfig(**model))
        self._windowed = windowed(self.model)  # attention layers whose window moves (attention.window_schedule, ...)
        self.divergence = Divergence(**(divergence or {}))
        self._unjudged: list[tuple[int, torch.Tensor]] = []  # (step, loss) the divergence rule has not read yet
        # spike_skip.enabled (lmlab.run.spikes): a spiking step's update is skipped; None: off, the loop as before
        self.spikes = SpikeSkip(**spike_skip) if (spike_skip or {}).get("enabled") else None
        self.update_skipped = False  # this step's update is skipped (spike_skip, or the divergence rule under it)
        self._groups_kept: tuple[Any, list] | None = None  # (optimizer, its group settings) while skipping
        self.val_history: list[tuple[int, float]] = []  # (step, val loss) of every validation
        self.val_bpb_history: list[tuple[int, float]] = []  # (step, val bits per byte) of every validation (text only)
        # (vocab_size,) the UTF-8 bytes of text each id stands for (lmlab.data.token_bytes), set up from the data's
        # tokenizer; None: no bits per byte (a head that does not predict the next token, data that is not text)
        self.bytes_per_token: torch.Tensor | None = None
        self._val_bpb: torch.Tensor | None = None  # (nats, bytes) summed over this validation's batches so far
        self._window_bpb: torch.Tensor | None = None  # ... over the accumulation window's micro-batches so far
        self._peak_grad = torch.zeros(())  # running max of the global grad norm (on the device once it has one)
        self._grad_norm: torch.Tensor | None = None  # this step's, before clipping
        # Not a submodule attribute: the compiled wrapper would add a second copy of every key to the state dict.
        object.__setattr__(self, "forward_fn", torch.compile(self.model, **compile_mode(compile)) if compile else
                           self.model)
        self.tokens_seen = 0
        self.ema: WeightEMA | None = None  # optim.ema > 0: built when training starts (after a resume's weights)
        self.ema_val_history: list[tuple[int, float]] = []  # (step, the EMA's val loss) of every validation
        self._ema_saved: dict[str, torch.Tensor] | None = None  # a resumed checkpoint's, until the EMA is built
        self._val_seen = 0  # validation windows read so far in this validation (the head's keys: head=mlm's masks)

    def configure_model(self) -> None:
        """Under trainer=fsdp2 (lmlab.run.distributed.FSDP2Strategy): fully_shard each block and the root, with
        checkpointing and compile applied per block first; other strategies take the model as it is."""
        shard = getattr(self.trainer.strategy, "shard", None)
        if shard is not None:
            shard(self.model, checkpointing=self.model.cfg.checkpointing, compile=self.hparams.compile)
            object.__setattr__(self, "forward_fn", self.model)  # compiled per block, inside FSDP's hooks

    def setup(self, stage: str) -> None:
        """Bits per byte (names.VAL_BPB, TRAIN_BPB): the table of bytes per token, once, from the data's tokenizer, for
        a head that predicts the next token (head=mlm, classify: none)."""
        if self.bytes_per_token is not None or not self.model.head.predicts_next or self._trainer is None:
            return
        data = getattr(self.trainer.datamodule, "data", self.trainer.datamodule)  # lmlab.run.lit_data's face: its data
        if (tok := getattr(data, "tokenizer", None)) is not None:
            table = token_bytes(tok, self.model.cfg.vocab_size, data.eod_id)  # every data module declares it
            self.bytes_per_token = None if table is None else torch.from_numpy(table)

    def _bpb_sums(self, loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(nats, bytes), float64: the mean `loss` times the targets it counts (not IGNORE: padding, a task's
        unscored positions), and the bytes of text those targets stand for, gathered on the device (no host read)."""
        if self.bytes_per_token.device != targets.device:
            self.bytes_per_token = self.bytes_per_token.to(targets.device)  # once
        counted = targets != IGNORE
        n_bytes = torch.where(counted, self.bytes_per_token[torch.where(counted, targets, 0)], 0).sum()
        return torch.stack([loss.detach().double() * counted.sum(), n_bytes.double()])

    def _bits_per_byte(self, sums: torch.Tensor) -> torch.Tensor:
        """Σ nats / (ln 2 · Σ bytes) over every rank's sums (in validation every rank reads the same windows: the ratio
        stays as it is)."""
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        return sums[0] / (math.log(2) * sums[1])

    @property
    def peak_grad_norm(self) -> float:
        """The largest global gradient norm (before clipping) of the run so far, resumed runs included."""
        return float(self._peak_grad)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, **loss: Any) -> Any:
        return self.forward_fn(idx, targets, **loss)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T) each
        return self(x, y)  # the model's own loss: fp32 whatever the logits' dtype, chunked if configured

    def prepare(self, batch: tuple[torch.Tensor, ...], split: str, batch_idx: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as the head's objective reads it (head=mlm masks it; the others take it as it is). Sequence r of
        it is keyed by its global index, what the data order is a function of too: in training (the run's seed, the
        sample's index in the stream the step sampler reads, lmlab.data), so a resume masks as the uninterrupted run
        did, on any launch at the same global batch; in validation (a fixed seed, the window's index), so runs of any
        seed read the same masked windows."""
        x, y, head = batch[0], batch[1], self.model.head
        if not head.draws:
            return head.prepare(x, y, ())
        if split == "train":
            t = self.trainer
            accumulate, world = int(t.accumulate_grad_batches), int(t.world_size)
            micro = batch_idx % accumulate
            first = ((self.global_step * accumulate + micro) * world + int(t.global_rank)) * x.size(0)
            stream = (int(self.hparams.seed), TRAIN_KEY)
        else:
            stream, first, self._val_seen = (0, VAL_KEY), self._val_seen, self._val_seen + x.size(0)
        return head.prepare(x, y, [(*stream, first + r) for r in range(x.size(0))])

    def on_validation_epoch_start(self) -> None:
        self._val_seen, self._val_bpb = 0, None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = self.prepare(batch, "train", batch_idx)
        if seq := (self.hparams.get("stages") or {}).get("seq"):  # data.seq_schedule: the blocks cut shorter
            length = data_stages.at(seq, self.global_step, self.hparams.max_steps, x.size(1))
            x, y = x.reshape(-1, length), y.reshape(-1, length)  # piece j: inputs j·s .. and their next tokens
        z_loss = float(self.hparams.optim.get("z_loss") or 0.0)
        if (step := self.model.cfg.untie_at_step) is not None and self.global_step >= step:
            self.model.untie()  # model.untie_at_step: the head trains apart from here (a resumed run: already untied)
        extra = self.model.extra_losses  # an MoE's balancing losses, MTP's depths join the objective, logged apart
        if z_loss or extra:  # the objective adds PaLM's z-loss; the loss logged and watched is the cross-entropy
            objective, loss, _ = self(x, y, z_loss=z_loss, parts=True)
        else:
            objective = loss = self(x, y)
        if self.spikes is None and self._diverged(loss):  # (spike_skip: judged before each update, see _judge)
            self.trainer.should_stop = True  # a result, not a crash: stop cleanly, skip this update
            return None
        self.tokens_seen += batch[0].numel() * self.trainer.world_size
        window = int(self.trainer.accumulate_grad_batches)
        # bits per byte's (nats, bytes) of the batch, where it is logged or joins a window (train/bpb: the window's)
        bpb = self._bpb_sums(loss, y) if self.bytes_per_token is not None and (window > 1 or self.logs_now()) else None
        if window > 1:  # the window's mean so far: its last
            at = batch_idx % window  # micro-batch logs the loss of the step's whole global batch, as without
            self._window_loss = loss.detach() if at == 0 else self._window_loss + loss.detach()
            loss = self._window_loss / (at + 1)
            if bpb is not None:
                self._window_bpb = bpb = bpb if at == 0 else self._window_bpb + bpb
        if self.spikes is not None:
            self._step_loss = loss.detach()  # the step's (the window's at its last micro-batch), judged in _judge
        if self.logs_now():
            self.log(names.TRAIN_LOSS, loss, prog_bar=True, sync_dist=True)  # the global batch's loss under DDP
            if bpb is not None:  # the global batch's bits per byte: its ranks' nats over their bytes
                self.log(names.TRAIN_BPB, self._bits_per_byte(bpb))
            # the side channel (lmlab.model.side): z-loss, an MoE's balancing losses summed over its layers, MTP's
            # depths, each before its coefficient
            for metric, value in self.model.figures("train").items():
                self.log(f"train/{metric}", value, sync_dist=True)
            # Host numbers go in as CPU tensors: Lightning copies a Python float to the model's device, and on a
            # GPU that blocking copy waits for all queued work.
            groups = self.trainer.optimizers[0].param_groups
            if self.model.param.per_role:  # µP: the hidden group's lr is optim.lr·base/d; log optim.lr's schedule
                groups = [g for g in groups if g.get("role") == "rest"] or groups
            self.log("lr", torch.tensor(groups[0]["lr"], dtype=torch.float64))
            self.log(names.TOKENS, torch.tensor(self.tokens_seen, dtype=torch.float64))
        return objective

    def _diverged(self, loss: torch.Tensor) -> bool:
        """The divergence rule (lmlab.run.monitor.Divergence) over every step's loss, read to the host at the steps
        that log (and before a validation or a checkpoint) in one read: a read at every step would make a GPU wait for
        its queue at every step. The rule judges the steps in order, so it names the step a read per step names; a
        run that diverges between two logging steps stops at the next one, its updates in between done."""
        self._unjudged.append((self.global_step, loss.detach()))
        return self.logs_now() and self.judge_losses()

    def judge_losses(self) -> bool:
        """The divergence rule over the losses not read yet, in step order; whether the run has failed."""
        if self._unjudged:
            steps, losses = zip(*self._unjudged)
            self._unjudged = []
            for step, value in zip(steps, torch.stack(losses).float().tolist()):
                if self.divergence.check(step, value):
                    break
        return self.divergence.step is not None

    def logs_now(self) -> bool:
        """Whether Lightning hands this step's metrics to the loggers (every trainer.log_every_n_steps, and the last
        step). Values logged on other steps are never written, and each self.log costs ~0.6 ms of Python: 5% of a
        step at 4 layers x d 128."""
        return self.trainer._logger_connector.should_update_logs

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Logs val/loss; returns it for the data's callbacks (data=mixture's batches carry their source as a third
        element: lmlab.data.mixture logs val/loss/<source> by it)."""
        batch, n = self.prepare(batch, "val"), batch[0].size(0)  # the EMA below reads the same (masked) batch
        loss = self.loss(batch)
        self.log(names.VAL_LOSS, loss, prog_bar=True, sync_dist=True, batch_size=n)  # the head's (next token's)
        if self.bytes_per_token is not None:  # the validation's bits per byte: its nats over its bytes, at its end
            sums = self._bpb_sums(loss, batch[1])
            self._val_bpb = sums if self._val_bpb is None else self._val_bpb + sums
        for metric, value in self.model.figures("val").items():  # head=mtp: the extra depths', apart
            self.log(f"val/{metric}", value, sync_dist=True, batch_size=n)
        if self.ema is not None:  # the same batch through the EMA's weights (lmlab.optim.ema), the live ones after
            with self.ema.applied(self.model):
                self.log(names.VAL_EMA_LOSS, self.loss(batch), sync_dist=True, batch_size=n)
        return loss

    def on_validation_epoch_end(self) -> None:
        if (loss := self.trainer.callback_metrics.get(names.VAL_LOSS)) is not None and not self.trainer.sanity_checking:
            self.log(names.VAL_PPL, math.exp(min(float(loss), 50.0)), sync_dist=True)  # equal on every rank
            self.val_history.append((self.global_step, float(loss)))
            if self.ema is not None and (ema := self.trainer.callback_metrics.get(names.VAL_EMA_LOSS)) is not None:
                self.ema_val_history.append((self.global_step, float(ema)))
        if self._val_bpb is not None and not self.trainer.sanity_checking:
            bpb = self._bits_per_byte(self._val_bpb)
            self.log(names.VAL_BPB, bpb, sync_dist=True)  # equal on every rank
            self.val_bpb_history.append((self.global_step, float(bpb)))

    # --- the weight EMA (optim.ema, lmlab.optim.ema): an evaluation readout, updated after each optimizer step ----

    def on_train_start(self) -> None:
        if decay := float(self.hparams.optim.get("ema") or 0.0):
            self.ema = WeightEMA(self.model, decay, start=int(self.hparams.optim.get("ema_start") or 0))
            if self._ema_saved is not None:  # a resume: the checkpoint's average goes on
                self.ema.load_state_dict(self._ema_saved)
            self._ema_saved = None

    def on_train_end(self) -> None:
        self.judge_losses()  # a run stopped between two logging steps (a wall-time budget, a signal): its last losses

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._groups_kept is not None:  # a skipped update: the optimizer's own step counters as they were, no EMA
            restore_groups(*self._groups_kept)
            self._groups_kept = None
            return
        self.model.normalize_weights()  # what the norm keeps true of the weights (norm=ngpt: back on the sphere)
        if self.ema is not None:  # Lightning counts the step after this hook: this one makes global_step + 1 done
            self.ema.update(self.model, step=self.global_step + 1)

    # --- optimizers with train/eval modes (schedule-free: lmlab.optim.schedule_free): evaluate x, train at y ---------

    def _modal_optimizer(self):
        opts = self._trainer.optimizers if self._trainer is not None else []
        return opts[0] if opts and isinstance(opts[0], EvalWeights) else None

    def on_validation_start(self) -> None:
        if self.judge_losses():  # the losses since the last logging step, before this validation's checkpoint
            self.trainer.should_stop = True
        self._set_step()  # validation reads the schedule's window at this step, or attention.eval_window
        if (opt := self._modal_optimizer()) is not None:
            opt.eval()  # after the callbacks' on_validation_start, before any batch

    def on_validation_end(self) -> None:
        if (opt := self._modal_optimizer()) is not None:
            opt.train()  # after the callbacks' on_validation_end: ModelCheckpoint has written the eval weights

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.update_skipped = False
        self._set_step()
        if (opt := self._modal_optimizer()) is not None:
            opt.train()  # a no-op in train mode; after a resume from a checkpoint written at validation, y again

    def _set_step(self) -> None:
        """attention.window_schedule: each scheduled layer's window at this step of max_steps, before its forward (and
        a head's own schedule: head=prefix's fade); a function of the step alone, so a resumed run reads at step s
        what the uninterrupted one read."""
        for m in self._windowed:
            m.set_step(self.global_step, self.hparams.max_steps)
        if isinstance(self.model.head, StepFollower):
            self.model.head.set_step(self.global_step, self.hparams.max_steps)

    def on_before_optimizer_step(self, optimizer) -> None:
        # The global gradient norm before clipping (Lightning clips after this hook).
        grads = [local(p.grad).detach() for p in self.model.parameters() if p.grad is not None]  # FSDP2: own shard
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
        norm = sum_over_shards(self.trainer, norm.square()).sqrt()  # the whole model's under FSDP
        self._peak_grad = torch.fmax(self._peak_grad, norm)  # no GPU sync; a NaN norm never counts
        self._grad_norm = norm  # clipping reuses it
        if self.spikes is not None and self._judge(norm):
            self.update_skipped = True
            self._groups_kept = optimizer, skip_update(optimizer)
        if self.model.routes:  # loss-free balancing: each MoE's bias moves by the step's load, summed over ranks
            strategy = self.trainer.strategy
            kept = [b.clone() for b in self.model.buffers()] if self.update_skipped else None
            self.model.update_balancing(
                (lambda t: strategy.reduce(t, reduce_op="sum")) if self.trainer.world_size > 1 else None)
            if kept is not None:  # a skipped step: its load is dropped, the balancing bias stays as it was
                torch._foreach_copy_(list(self.model.buffers()), kept)
        if self.logs_now():
            self.log(names.GRAD_NORM, norm)

    def _judge(self, norm: torch.Tensor) -> bool:
        """spike_skip: whether this step's update is skipped, from its loss and gradient norm averaged over ranks (every
        rank decides alike). A spike is skipped (recorded, logged as train/skipped_step) and the divergence rule never
        sees it; any other step goes to the divergence rule, here instead of in training_step: a non-finite loss, or
        a loss past its spike_factor, ends the run as diverged, its update skipped (not recorded as a skip)."""
        values = torch.stack([self._step_loss.float(), norm.float().to(self._step_loss.device)])
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        loss, grad_norm = values.tolist()
        step = self.global_step
        skip = math.isfinite(loss) and self.spikes.check(step, loss=loss, grad_norm=grad_norm)
        if self.logs_now():
            self.log(names.SKIPPED_STEP, torch.tensor(float(skip)))
        elif skip:  # between logging steps: the row of a skipped step is written all the same
            log_at(self.trainer, {names.SKIPPED_STEP: 1.0}, step)
        if not skip and self.divergence.check(step, loss):
            self.trainer.should_stop = True  # a result, not a crash: stop cleanly, skip this update
            return True
        return skip

    def configure_optimizers(self) -> dict:
        optim = dict(self.hparams.optim)
        if "fused" in optim and optim["fused"] is None and self._trainer is not None and getattr(
                self.trainer.precision_plugin, "scaler", None) is not None:
            optim["fused"] = False  # fp16's loss scaler: Lightning unscales before clipping only when unfused
        return configure_optimization(self.model, optim, dict(self.hparams.schedule), self.hparams.max_steps,
                                      self.hparams.get("stages"))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if not (clip := self.hparams.optim.get("grad_clip", 0.0)) or self.update_skipped:
            return
        root = self.trainer.strategy.model
        if hasattr(root, "clip_grad_norm_"):  # FSDP: the norm over every rank's shards (Lightning's plugin refuses)
            root.clip_grad_norm_(clip)
        elif getattr(self.trainer.precision_plugin, "scaler", None) is None and self._grad_norm is not None:
            # No loss scaler (fp32, bf16): these are the true gradients, whose global norm on_before_optimizer_step
            # has just taken. (Lightning's mixed-precision plugin would also refuse any fused optimizer, a rule
            # meant for fp16's scaled gradients.)
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), clip, self._grad_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.judge_losses()  # the rule's state saved with every loss so far judged
        # Lightning adds one to its logging step when it restarts, because its own mid-epoch checkpoints are
        # written before that counter moves. Checkpoints written after fit() returns or on Ctrl-C are written
        # after it moved; store every checkpoint in the mid-epoch form so a resumed run logs the next step.
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        loop = fit_loop.get("epoch_loop.state_dict", {})
        progress = fit_loop.get("epoch_loop.batch_progress", {})
        total = progress.get("total", {})
        if total.get("ready", 0) > total.get("completed", 0):
            # Written inside a step: as it is about to start (an interruption, lmlab.run.interrupt: its batch is
            # counted as fetched), or anywhere in it (Ctrl-C pressed twice), after its optimizer step perhaps.
            # On restart Lightning rewinds the epoch's counters to the finished batches but not the run's total,
            # which decides when validation runs, and it would train a batch again whose optimizer step the weights
            # already hold. The weights and the data's position (lmlab.data) are those of the optimizer steps done:
            # count the batches they took as finished, everywhere; with every counter equal Lightning restores the
            # logging step as it is, so store the step the next row is logged at.
            done = self.global_step * int(self.trainer.accumulate_grad_batches)
            moved = done - total["completed"]
            for counts in (total, progress.get("current", {})):
                finished = counts["completed"] + moved
                counts.update({k: finished for k in ("ready", "started", "processed", "completed") if k in counts})
            if "_batches_that_stepped" in loop:
                # Restarting, Lightning asks whether validation is due at the last finished batch; if so it takes the
                # checkpoint for one written by validation, before the logging step moved, and moves it itself.
                loop["_batches_that_stepped"] = self.global_step - 1 if self._val_due(progress) else self.global_step
        elif "_batches_that_stepped" in loop:
            loop["_batches_that_stepped"] = self.global_step - 1
        checkpoint["lmlab"] = {"tokens_seen": self.tokens_seen, "val_history": self.val_history,
                                "val_bpb_history": self.val_bpb_history,
                                "peak_grad_norm": self.peak_grad_norm, "divergence": self.divergence.state_dict(),
                                "launch": self.launch()}
        if self.spikes is not None:  # the windows and the skipped steps: a resume judges as the run would have
            checkpoint["lmlab"]["spike_skip"] = self.spikes.state_dict()
        if self.ema is not None:  # beside the live weights, which eval.py, export and init_from read as before
            checkpoint["lmlab"].update(ema_weights=self.ema.state_dict(), ema_val_history=self.ema_val_history)
        opt = self._modal_optimizer()
        if opt is not None and opt.training and "state_dict" in checkpoint:
            # Written while training: the weights are the evaluation weights x (what eval.py, init_from and generation
            # read), the training weights y beside them, exactly, for a resume.
            x = opt.eval_weights()
            weights = checkpoint["state_dict"]
            checkpoint["lmlab"]["train_weights"] = {k: v for k, v in weights.items() if v.data_ptr() in x}
            checkpoint["state_dict"] = {k: x[v.data_ptr()].clone() if v.data_ptr() in x else v
                                        for k, v in weights.items()}

    def launch(self) -> dict[str, Any] | None:
        """What decides the global batch of a step, as a checkpoint records it: a resume is checked against it
        (lmlab.run.plan.check_same_launch)."""
        if self._trainer is None:
            return None
        t = self.trainer
        world, nodes = int(t.world_size), int(t.num_nodes)
        return {"world_size": world, "num_nodes": nodes, "devices": world // nodes,
                "strategy": type(t.strategy).__name__, "accumulate_grad_batches": int(t.accumulate_grad_batches),
                "batch_size": getattr(getattr(t.datamodule, "data", None), "batch_size", None)}  # lmlab.run.lit_data

    def _val_due(self, progress: dict) -> bool:
        """Whether Lightning's batch-based validation check fires after the last finished batch (its rule)."""
        every = self.trainer.val_check_batch
        if not isinstance(every, int) or every < 1:
            return False
        counts = progress["total"] if self.trainer.check_val_every_n_epoch is None else progress["current"]
        return counts["completed"] % every == 0

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("lmlab", {})
        if state.get("train_weights") and "state_dict" in checkpoint:  # Lightning loads the weights after this hook
            checkpoint["state_dict"] = {**checkpoint["state_dict"], **state["train_weights"]}
        self.tokens_seen = state.get("tokens_seen", 0)
        self.val_history = [tuple(v) for v in state.get("val_history", [])]
        self.val_bpb_history = [tuple(v) for v in state.get("val_bpb_history", [])]
        self._peak_grad = torch.tensor(float(state.get("peak_grad_norm", 0.0)))
        self.divergence.load_state_dict(state.get("divergence", {}))
        if self.spikes is not None:
            self.spikes.load_state_dict(state.get("spike_skip", {}))
        self._ema_saved = state.get("ema_weights")  # on_train_start loads it into the EMA (optim.ema > 0)
        self.ema_val_history = [tuple(v) for v in state.get("ema_val_history", [])]
        was = (state.get("launch") or {}).get("accumulate_grad_batches")
        if was and self._trainer is not None and int(self.trainer.accumulate_grad_batches) != int(was):
            rescale_batches(checkpoint, int(was), int(self.trainer.accumulate_grad_batches))


def rescale_batches(checkpoint: dict, was: int, now: int) -> None:
    """A resume at another trainer.accumulate_grad_batches (the same global batch: lmlab.run.plan.check_same_launch):
    Lightning counts its loops in micro-batches (the accumulation window, validation), so the checkpoint's batch
    counts, `was` per optimizer step, become `now` per step; a window the weights do not hold is dropped (the data's
    position is the optimizer steps done, lmlab.data). The counts of optimizer steps are left as they are."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    for counts in (progress.get("total", {}), progress.get("current", {})):
        for k in ("ready", "started", "processed", "completed"):
            if k in counts:
                counts[k] = counts[k] // was * now
