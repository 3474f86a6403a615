"""The GPT: token embeddings -> position scheme -> blocks -> (final norm) -> LM head (and the `head` axis's extra
predictions in training: multi-token prediction; or its other objectives: a bidirectional masked LM, a classifier).

Every part comes from its axis's registry through `build`; this file never asks which option it has. `validate`
checks a config before anything else happens: its options resolved, its size against the machine, the model built on
the meta device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.attention.flex import mask_plan
from lmlab.model.capabilities import MakesModel, ReadsPositions, SequenceMixer, SideChannel, UpdatesBias
from lmlab.model.head import HEADS, MTP_LOSS
from lmlab.model.init import INITS
from lmlab.model.layers import layer_plan
from lmlab.model.loss import Z_LOSS, Softcap, cross_entropy, linear_cross_entropy
from lmlab.model.mask import documents
from lmlab.model.memory import check_model_fits
from lmlab.model.norm import NORMS, NoNorm
from lmlab.model.param import PARAMS
from lmlab.model.placement import PLACEMENTS
from lmlab.model.position import POSITIONS
from lmlab.model.residual import Connections
from lmlab.model.resolve import resolve
from lmlab.model.side import SPLITS, Term, figures, objective_part
from lmlab.registry import build, option_params


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg = resolve(cfg)  # the derived sizes, once (a resolved record is only checked)
        self.plan = layer_plan(cfg)  # each layer's record (lmlab.model.layers): what FLOPs, monitor, residuals read
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.d_model)  # model.vocab_pad's rows past vocab_size: never read
        self.pos = build("position", POSITIONS, cfg.position, cfg.d_model, cfg.attn_head_dim, cfg.attn_heads,
                         cfg.max_seq_len, cfg.train_len, cfg.rope_scaling)
        if self.pos.per_document and cfg.eod_id is None:
            raise ValueError("position.per_document=true needs an end-of-document token to find the documents by: "
                             "set data.eod (e.g. data.eod='<|endoftext|>'), which ends each packed document (data=token_bin: "
                             "data.doc_sep, the separator's id)")
        scale = cfg.d_model ** 0.5 if cfg.embed_scale == "sqrt_d" else cfg.embed_scale
        if cfg.embed_scale_learned and scale is None:
            raise ValueError("model.embed_scale_learned=true learns the factor model.embed_scale starts from, which is "
                             "null: set model.embed_scale (a number, or sqrt_d), or model.embed_scale_learned=false")
        self.embed_scale = nn.Parameter(torch.tensor(scale)) if cfg.embed_scale_learned else scale  # None: × 1
        self.drop = nn.Dropout(cfg.dropout)
        self.ln_e = build("norm", NORMS, cfg.norm, cfg.d_model) if cfg.embed_norm else None  # on the embedding output
        self.h = nn.ModuleList(build("placement", PLACEMENTS, cfg.placement, cfg, i) for i in range(cfg.n_layer))
        if self.pos.logit_bias and any(True for _ in self.pos.parameters()) and not any(
                isinstance(m, ReadsPositions) and m.reads_positions for m in self.h.modules()):
            raise ValueError(f"position={cfg.position['name']} adds learned biases to attention logits, and no layer "
                             f"of this model attends (every layer a recurrent mixer: mixer.pattern): its weights would "
                             f"get no gradient (DDP stops on the unused parameters); use position=none or rope, or put "
                             f"attention layers in mixer.pattern (e.g. mixer.pattern=[gdn,gdn,gdn,attention])")
        # the attention windows, for a scheme that follows them (RoPE's window_yarn; the others: a no-op)
        self.pos.follow([getattr(getattr(b, "attn", None), "windows", None) for b in self.h])
        self.residual = Connections(cfg)  # how the blocks connect beyond the placement (lmlab.model.residual)
        self.residual.attach(self)
        self.param = build("param", PARAMS, cfg.param, cfg)  # how scales follow the width (sp: as built)
        self.param.scale_attention(self)
        block = type(self.h[0])
        self.ln_f = build("norm", NORMS, cfg.norm, cfg.d_model) if block.final_norm else NoNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.lm_head.is_readout = True  # the output layer: lmlab.optim's `readout` role (AdamW under Muon, µP)
        self.lm_head.active_share = cfg.vocab_size / cfg.padded_vocab  # model FLOPs count the real vocabulary's rows
        if cfg.untie_at_step is not None and not cfg.tie_embeddings:
            raise ValueError(f"model.untie_at_step={cfg.untie_at_step} unties a tied head; model.tie_embeddings=false "
                             f"has none: set model.tie_embeddings=true, or model.untie_at_step=null")
        if cfg.tie_embeddings and cfg.untie_at_step is None:
            self.lm_head.weight = self.wte.weight  # one matrix for reading and writing tokens (Press & Wolf, 2017)
        # model.untie_at_step: the head has its own matrix from the start, unused (no gradient, so no optimizer
        # update or decay) while tied; `untie()` copies the embedding into it. The state is saved with the weights.
        self._untied = cfg.untie_at_step is None and not cfg.tie_embeddings  # read by forward: no device sync
        if cfg.untie_at_step is not None:  # saved in the state dict (only then: other records keep their keys)
            self.register_buffer("untied", torch.tensor(self._untied))
            self.register_load_state_dict_post_hook(lambda module, _: setattr(module, "_untied", bool(module.untied)))
        self.head = build("head", HEADS, cfg.head, cfg)  # extra predictions (head=mtp); next: none
        self.pos.causal = self.head.causal  # the direction every attention path reads (head=mlm: both ways)
        if not self.causal and (why := self._causal_only()):
            raise ValueError(f"head={cfg.head['name']} reads the whole text in every layer (bidirectional attention), "
                             f"which this model cannot: {'; '.join(why)}")
        self.terms: list[Term] = []  # the last forward's side channel (lmlab.model.side)
        # A norm that makes the model around it (norm=ngpt, lmlab.model.ngpt: its own update in every block, its
        # scales in the sublayers) attaches itself to the built model; its model-wide part (the logits' scale, the
        # sphere the weights are kept on) is `norm_model`. The other norms live in the blocks: None.
        norm, params = option_params("norm", NORMS, cfg.norm)
        self.norm_model = NORMS[norm].attach(self, **params) if isinstance(NORMS[norm], MakesModel) else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        build("init", INITS, self.cfg.init, self)
        self.param.rescale_init(self)
        self.normalize_weights()

    def normalize_weights(self) -> None:
        """What the norm keeps true of the weights, at init and after every optimizer step (the training loop calls
        it): under norm=ngpt every matrix along its d_model dimension on the unit sphere; nothing for the others."""
        if self.norm_model is not None:
            self.norm_model.normalize_weights(self)

    @property
    def decays(self) -> bool:
        """Whether weight decay applies to its matrices (norm=ngpt: no, they are renormalised after every step)."""
        return self.norm_model is None or self.norm_model.decays

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                z_loss: float = 0.0, parts: bool = False) -> Any:
        """`_forward` (below), with each distinct FlexAttention block mask built once for all its layers
        (lmlab.model.attention.flex.mask_plan); a compiled graph builds its masks inside itself."""
        if torch.compiler.is_compiling():
            return self._forward(idx, targets, cache, z_loss, parts)
        with mask_plan():
            return self._forward(idx, targets, cache, z_loss, parts)

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor | None, cache: KVCache | None, z_loss: float,
                 parts: bool) -> Any:
        """idx (B, T) token ids -> logits (B, T, vocab) (softcapped under `logit_softcap`); given targets (B, T), the
        mean token cross-entropy instead (fp32; with `chunked_loss` the logits are never held whole), plus `z_loss` ·
        mean(log Z)² when given, plus in training the sublayers' auxiliary losses (an MoE's balancing terms, `aux`);
        `parts=True`: (objective, cross-entropy, z-loss), the last two detached (lmlab.model.loss).
        With a `cache` (generation), the tokens continue the cached ones and their keys and values are added to
        it."""
        offset = 0
        if cache is not None:
            if not self.causal:
                raise ValueError(f"head={self.cfg.head['name']} is bidirectional: a token's output reads the tokens "
                                 f"after it, so a KV cache (generation, one token at a time) cannot give it")
            cache.start()
            offset = cache.length
        doc = self.documents(idx, cache)  # (B, offset + T) document numbers (doc_mask, per_document), else None
        tokens = self.wte(idx) if self.embed_scale is None else self.wte(idx) * self.embed_scale
        x = self.drop(self.pos.embed(tokens, offset, doc))  # (B, T, C)
        x = self.residual.embed(x, idx, cache, doc)  # options that read the tokens (a look-back, a bigram table)
        if self.ln_e is not None:
            x = self.ln_e(x)
        recompute = self.cfg.checkpointing and self.training and torch.is_grad_enabled()
        self.residual.start(x, idx)
        for i, block in enumerate(self.h):
            x = self.residual.before(i, x)
            # Checkpointing keeps only each block's input and reruns the block in backward (same RNG state, so
            # dropout draws the same mask): L saved inputs instead of every block's intermediates.
            if recompute:
                x = checkpoint(block, x, self.pos, None, doc, use_reentrant=False)
            else:
                x = block(x, self.pos, None if cache is None else cache.layers[i], doc)
            x = self.residual.after(i, x)
        if cache is not None:
            cache.length += idx.size(1)
        if targets is None:  # the output head's logits (head=classify: the labels')
            return self.head.logits(self.ln_f(x), idx, self.lm_logits)
        out = self.head.loss(self.ln_f(x), idx, targets, self.lm_loss, z_loss=z_loss, parts=parts)
        # The side channel (lmlab.model.side): the sublayers' terms (an MoE's balancing losses), the head's (MTP's
        # depths, a classifier's accuracy), the loss's own z-loss; the objective adds those it lacks, in training only.
        terms = [t for m in self._sources for t in m.terms]
        terms += self.head.terms(x, idx, targets, doc, self.wte, self.pos, self.lm_loss)
        if parts and z_loss:
            terms.append(Term(Z_LOSS, out[2], z_loss, in_loss=True))
        self.terms = terms
        total = objective_part(terms) if self.training and torch.is_grad_enabled() else None
        if total is not None:
            out = (out[0] + total, *out[1:]) if parts else out + total
        return out

    def figures(self, split: str) -> dict[str, torch.Tensor]:
        """The last forward's side-channel figures for `split` (train, val), by metric name, detached: what the
        loggers show beside the LM loss (summed over an MoE's layers, before their coefficients)."""
        return figures(self.terms, split)

    def side(self, z_loss: float = 0.0) -> dict[str, list[str]]:
        """What this model's side channel holds, as the summary records it: the metrics its terms are logged as, per
        split (`z_loss`: the objective's PaLM z-loss coefficient, a training setting), and the figure groups its
        sources log (`moe`: the routing figures of each layer)."""
        declared = {**{k: v for m in self._sources for k, v in m.declared.items()}, **self.head.declared}
        if z_loss:
            declared[Z_LOSS] = ("train",)
        return {**{split: sorted(k for k, where in declared.items() if split in where) for split in SPLITS},
                "figures": sorted({g for m in self._sources for g in m.figure_groups})}

    @property
    def head_losses(self) -> list[torch.Tensor]:
        """The last forward's extra-depth losses (head=mtp), detached, depth 1 first."""
        return [t.value.detach() for t in self.terms if t.metric.startswith(MTP_LOSS)]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output head's logits (B, T, vocab) of normed hidden states h: µP's readout multiplier, the softcap."""
        if self.param.output_mult != 1.0:  # µP's readout multiplier, on h: (αW)h = W(αh)
            h = h * self.param.output_mult
        logits = self.vocab_logits(F.linear(h, self.head_weight))
        return logits if self.softcap is None else self.softcap(logits)

    def vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the vocabulary's ids: model.vocab_pad's extra columns left out (a view, no copy), so neither
        the softmax nor the loss ever sees them."""
        return logits if self.cfg.vocab_pad == 1 else logits[..., :self.cfg.vocab_size]

    @property
    def causal(self) -> bool:
        """Whether each token reads only the tokens at or before it (False under head=mlm and head=classify)."""
        return self.pos.causal

    def _causal_only(self) -> list[str]:
        """What in this model has no bidirectional form, each part's own sentence naming its key: the position scheme,
        the token mixers of every layer (a window, a forget gate, a recurrent mixer)."""
        mixers = (getattr(block, name) for block in self.h for name in block.sublayer_names)
        found = [self.pos.causal_only, *(m.causal_only if isinstance(m, SequenceMixer) else None for m in mixers)]
        return list(dict.fromkeys(w for w in found if w))  # each sentence once (every layer says the same)

    def lm_loss(self, h: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, parts: bool = False) -> Any:
        """The output head's mean token cross-entropy on normed hidden states h (B, T, d) (lmlab.model.loss): µP's
        readout
        multiplier, the logit softcap, chunked when `chunked_loss`; shared by the extra heads (head=mtp)."""
        if self.param.output_mult != 1.0:  # µP's readout multiplier, on h: (αW)h = W(αh), chunked loss included
            h = h * self.param.output_mult
        cap = self.softcap
        if self.cfg.chunked_loss:  # the vocabulary's rows of the head (model.vocab_pad's are left out)
            return linear_cross_entropy(h, self.head_weight[:self.cfg.vocab_size], targets, softcap=cap,
                                        z_loss=z_loss, parts=parts)
        return cross_entropy(self.vocab_logits(F.linear(h, self.head_weight)), targets, softcap=cap, z_loss=z_loss,
                             parts=parts)

    @property
    def softcap(self) -> Softcap | None:
        """The final-logit softcap (model.logit_softcap, its width and offset; lmlab.model.loss.Softcap), or None."""
        c = self.cfg.logit_softcap
        return None if c is None else Softcap(c, self.cfg.logit_softcap_width, self.cfg.logit_softcap_offset)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's matrix: the embedding's while tied (model.untie_at_step before its step), else its own;
        under norm=ngpt its rows times the logits' scale s_z (s_z ⊙ (W h) = (s_z ⊙ W) h, on every loss path)."""
        w = self.lm_head.weight if self._untied else self.wte.weight
        return w if self.norm_model is None else self.norm_model.head_weight(w)

    @property
    def vocab_rows(self) -> dict[str, int]:
        """The state-dict entries with a row per vocabulary id (padded to model.vocab_pad), and the vocabulary's
        rows of them."""
        rows = () if self.norm_model is None else self.norm_model.vocab_rows  # norm=ngpt's s_z
        names = ["wte.weight", "lm_head.weight", *(f"norm_model.{n}" for n in rows)]
        return dict.fromkeys(names, self.cfg.vocab_size)

    @property
    def tied(self) -> bool:
        """Whether the head reads the embedding's matrix now."""
        return not self._untied

    def untie(self) -> None:
        """model.untie_at_step: the head takes a copy of the embedding and trains apart from now on."""
        if self._untied:
            return
        with torch.no_grad():
            self.lm_head.weight.copy_(self.wte.weight)
        self.untied.fill_(True)
        self._untied = True

    def next_token_model(self) -> GPT:
        """This model without what only training reads, computing the same logits: head=mtp's modules left out, a
        model.untie_at_step head as it is now (tied before the step, its own matrix after). What export writes."""
        cfg = self.cfg
        if not self.head.predicts_next:
            raise ValueError(f"head={cfg.head['name']} does not predict the next token (a bidirectional encoder's "
                             f"objective), so it has no next-token model to export or generate with")
        if cfg.head.get("name") == "next" and cfg.untie_at_step is None and cfg.vocab_pad == 1:
            return self
        plain = dataclasses.replace(cfg, head={"name": "next"}, untie_at_step=None, tie_embeddings=self.tied,
                                    vocab_pad=1)
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("head.") and k != "untied"}
        for name, rows in self.vocab_rows.items():  # model.vocab_pad's extra rows: not exported
            state[name] = state[name][:rows]
        if self.tied:  # the embedding is the head (the head's own matrix is a copy to come)
            state["lm_head.weight"] = state["wte.weight"]
        with torch.device(self.wte.weight.device):
            model = GPT(plain)
        model.load_state_dict(state)
        return model.train(self.training)

    @property
    def extra_losses(self) -> bool:
        """Whether training adds losses to the cross-entropy (an MoE's balancing terms, MTP's depths, head=prefix's)."""
        return self.routes or bool(self.head.depth) or any(self.head.weights)

    @property
    def routes(self) -> bool:
        """Whether any sublayer routes tokens (ffn=moe)."""
        return bool(self._routed)

    @property
    def _routed(self) -> list[nn.Module]:
        """The sublayers that route tokens (an MoE): they keep routing statistics and a balancing bias. (No walrus in
        the comprehension: its cell variable is a graph break torch.compile cannot resume from, which cut the compiled
        training forward short.)"""
        sublayers = (getattr(block, name) for block in self.h for name in block.sublayer_names)
        return [m for m in sublayers if isinstance(m, UpdatesBias)]

    @property
    def _sources(self) -> list[nn.Module]:
        """The sublayers with side-channel terms (lmlab.model.side): each records its `terms` in its forward."""
        sublayers = (getattr(block, name) for block in self.h for name in block.sublayer_names)
        return [m for m in sublayers if isinstance(m, SideChannel)]

    def update_balancing(self, reduce: Any = None) -> None:
        """After an optimizer step: each routing sublayer's loss-free balancing bias moves by its load since the last
        step (`reduce` sums a tensor over ranks under DDP/FSDP, so every rank moves alike)."""
        for m in self._routed:
            m.update_bias(reduce)

    def documents(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor | None:
        """Every position's document number (B, offset + T) when the model has a document separator (`cfg.eod_id`,
        recorded for attention.doc_mask and position.per_document): a document ends with it, or under
        `cfg.doc_sep_role` bos starts with it; the cache's come first."""
        if self.cfg.eod_id is None:
            return None
        opens = self.cfg.doc_sep_role == "bos"
        first = None if cache is None or cache.doc is None else cache.doc_next
        doc = documents(idx, self.cfg.eod_id, first, opens)
        if cache is not None:
            cache.doc = doc if cache.doc is None else torch.cat((cache.doc, doc), dim=1)
            cache.doc_next = doc[:, -1] if opens else doc[:, -1] + (idx[:, -1] == self.cfg.eod_id).long()
            doc = cache.doc
        return doc

    def num_params(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """The weights; `active`: those one token uses (an MoE's unchosen experts left out)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            n -= sum(m.inactive_params() for m in self._routed)
        pad = (self.cfg.padded_vocab - self.cfg.vocab_size) * self.cfg.d_model  # model.vocab_pad's rows: not weights
        n -= pad * len({id(self.wte.weight), id(self.lm_head.weight)})  # of the model, only of its matmuls' shapes
        return n - self.cfg.vocab_size * self.cfg.d_model if exclude_embeddings else n


def validate(cfg: GPTConfig) -> GPTConfig:
    """Resolve every option and build the model on the meta device; raise ValueError naming the bad key. Returns
    `cfg`, resolved."""
    meta_model(cfg)
    return cfg


def meta_model(cfg: GPTConfig) -> GPT:
    """`validate`'s checks, and the model they build: on the meta device (its shapes and options, no memory), for
    the checks that read the built model (lmlab.run.checks). `cfg` is resolved in place."""
    resolve(cfg)
    pos_name, _ = option_params("position", POSITIONS, cfg.position)
    if cfg.rope_scaling.get("name", "none") != "none" and not POSITIONS[pos_name].accepts_scaling:
        raise ValueError(f"rope_scaling={cfg.rope_scaling['name']!r} needs position=rope (got position="
                         f"{pos_name!r}); use rope_scaling=none with this scheme")
    check_model_fits(cfg)  # before the meta build, which itself holds tens of kB of Python objects per layer
    with torch.device("meta"):
        return GPT(cfg)
