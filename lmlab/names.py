"""What lmlab logs, by name: one vocabulary for the training loop, the stability monitor, the throughput callback,
compare, plots and tracking (metrics.csv columns and W&B keys; the slashes group them into W&B panels). A figure's
name is written once, here; every module that logs or reads one imports it."""

from __future__ import annotations

TRAIN_LOSS = "train/loss"
TRAIN_Z_LOSS = "train/z_loss"  # mean (log Z)² of the output logits, under optim.z_loss (the objective adds λ times it)
# An MoE's balancing losses before their coefficients, summed over its layers (lmlab.model.moe; the objective adds them)
TRAIN_AUX = {"balance": "train/moe_balance_loss", "router_z": "train/router_z_loss"}
TRAIN_PREFIX_LOSS = "train/prefix_loss"  # head=prefix's auxiliary loss, before its weight (lmlab.model.prefix)
TRAIN_MTP_LOGITS_LOSS = "train/mtp_logits_loss"  # head=mtp_logits': Σ w_k·L_k at the step's weights
VAL_LOSS = "val/loss"
VAL_PPL = "val/ppl"
# Bits per byte beside the loss (a next-token head on text only; lmlab.data.token_bytes): the nats summed over the
# target tokens / (ln 2 x the UTF-8 bytes of text they stand for), comparable across tokenizers (nats per token are not)
TRAIN_BPB, VAL_BPB = "train/bpb", "val/bpb"
VAL_EMA_LOSS = "val/ema_loss"  # val/loss of the weight EMA (optim.ema > 0; lmlab.optim.ema), at every validation
TOKENS = "tokens"  # tokens trained on so far
GRAD_NORM = "grad/norm"  # global, before clipping; per part: grad_norm(part)
SKIPPED_STEP = "train/skipped_step"  # 1 when spike_skip skipped the step's update, else 0 (lmlab.run.spikes)
LOSS_VS_UNIGRAM = "train/loss_vs_unigram"  # the train loss minus the unigram entropy of the training split
OUTPUT_CHANGE = "update/output_change"  # ||f(x; θ_t+1) − f(x; θ_t)|| / ||f(x; θ_t)|| on the monitor's probe
PERF = "perf/"  # the machine's figures (differ between any two runs): tokens/s, MFU, memory
TOKENS_PER_S, MFU, MAX_MEMORY = f"{PERF}tokens_per_s", f"{PERF}mfu", f"{PERF}max_memory"

# Per-layer figures: <prefix>/layer_XX[/<sublayer>]
PARAM_NORM, UPDATE_RATIO, ACT_RMS, ACT_RATIO = "param/norm", "update/ratio", "act/rms", "act/ratio"
ATTN_ENTROPY, ATTN_MAX_LOGIT, ATTN_SINK_MASS = "attn/entropy", "attn/max_logit", "attn/sink_mass"
MIXER = "mixer"  # mixer/<figure>/layer_XX: a recurrent mixer layer's state_norm, gate_mean, ... (lmlab.model.mixer)
MOE = "moe"  # moe/<figure>/layer_XX: load_max_over_mean, load_cv, router_entropy, dropped, balance_loss, ...
QK_CLIPPED_HEADS = "attn/qk_clipped_heads"  # heads whose W_q, W_k optim.qk_clip rescaled this step (optim/qk_clip.py)
QK_MAX_LOGIT = "attn/qk_max_logit"  # the largest per-head max logit of the step, before the clip
ATTN_FIRST_MASS = "attn/first_token_mass"  # the weight queries after the first put on the first token (a sink)
JAC_NORM = "jac/norm"  # ‖∂x_{l+1}/∂x_l‖_F / √n per block (lmlab.run.jacobian)
DOWNSTREAM = "downstream"  # downstream/<task>/<metric>: an lm-eval task scored at validation (lmlab.run.downstream)


def layer(i: int) -> str:
    """A block's name in the figures: layer_00, layer_01, ..."""
    return f"layer_{i:02d}"


def per_layer(prefix: str, i: int, sublayer: str | None = None) -> str:
    """`<prefix>/layer_XX`, or `<prefix>/layer_XX/<sublayer>` (attn, ffn, gau)."""
    return f"{prefix}/{layer(i)}" + (f"/{sublayer}" if sublayer else "")


def mtp_loss(split: str, k: int) -> str:
    """train/mtp_loss_<k>, val/mtp_loss_<k>: head=mtp's cross-entropy for the token k + 1 ahead (k = 1 .. depth), before
    its weight (the objective adds weight · it; train/loss and val/loss stay the next token's)."""
    return f"{split}/mtp_loss_{k}"


def grad_norm(part: str) -> str:
    """grad/norm/<part>: a layer (layer_03, layer_03/attn), embed or head."""
    return f"{GRAD_NORM}/{part}"


def val_loss(source: str) -> str:
    """val/loss/<source>: a data=mixture source's validation loss, the mean over its own validation blocks (val/loss
    pools every source's; lmlab.data.mixture)."""
    return f"{VAL_LOSS}/{source}"


def downstream(task: str, metric: str) -> str:
    """downstream/<task>/<metric>: lm-eval's `metric` (acc, acc_norm, word_perplexity, ...) of `task` at a validation
    (downstream.tasks; lmlab.run.downstream)."""
    return f"{DOWNSTREAM}/{task}/{metric}"
