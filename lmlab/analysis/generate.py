"""Text generation: sampling with temperature, top-k and top-p, one token at a time through the KV cache.

Each new token costs one position's forward. The cache is rebuilt from the whole text when the position scheme's
frequencies change with the length (dynamic RoPE scalings past the trained length: `Position.cache_key`), and
when a learned position table is full (the text is cropped to its last max_seq_len tokens), so every token is
drawn from the logits a full forward over the text so far would give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TextIO

import torch

from lmlab import env
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT
from lmlab.model.memory import check_generation_fits
from lmlab.record.rundir import RunDir, load_model
from lmlab.registry import NonNegativeFloat, PositiveInt, Range, check_values, parameter_types


def sample(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B,) from last-position logits (B, V): temperature 0 is greedy; top_k keeps the k likeliest;
    top_p keeps the smallest set of likeliest tokens whose probability reaches p (Holtzman et al., 2020)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # tokens after the set already reached p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
             on_token: Callable[[torch.Tensor, torch.Tensor], None] | None = None, use_cache: bool = True
             ) -> torch.Tensor:
    """idx (B, T) prompt ids -> (B, T + max_new_tokens). `on_token(tokens, logits)` sees each step's new tokens
    (B,) and the logits they were drawn from (B, V), e.g. to stream them; `use_cache=False` runs a full forward over
    the text at every step (the reference the cache is tested against)."""
    if not model.head.predicts_next:
        raise ValueError(f"head={model.cfg.head['name']} does not predict the next token (a bidirectional encoder's "
                         f"objective): there is nothing to generate with; generate from a head=next or head=mtp run")
    model.eval()
    context = model.cfg.max_seq_len if type(model.pos).table_bound else None
    tokens, cache = idx, None
    for _ in range(max_new_tokens):
        total = tokens.size(1)
        key = model.pos.cache_key(total)
        if not use_cache or cache is None or cache.key != key or (context is not None and total > context):
            window = tokens if context is None else tokens[:, -context:]
            cache = KVCache(len(model.h)) if use_cache else None
            if cache is not None:
                cache.key = key
            logits = model(window, cache=cache)[:, -1]  # (B, V)
        else:
            logits = model(tokens[:, -1:], cache=cache)[:, -1]
        nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
        if on_token is not None:
            on_token(nxt, logits)
    return tokens


def generate_text(run: str, prompt: str, *, max_new_tokens: PositiveInt = 200, temperature: NonNegativeFloat = 0.8,
                  top_k: PositiveInt | None = None, top_p: Annotated[float, Range(gt=0, le=1)] | None = None,
                  seed: int = 0, n: PositiveInt = 1, stream: TextIO | None = None) -> list[str]:
    """`n` continuations of `prompt` by the model of a run directory (its last checkpoint and tokenizer); the first
    is written to `stream` token by token as it is drawn. Returns the texts, prompt included."""
    from lmlab.data.tokenizer import load_tokenizer

    if temperature == 0 and n > 1:
        raise ValueError(f"temperature=0 is greedy: n={n} would print the same text {n} times; use n=1, or "
                         f"temperature > 0 for {n} different samples")
    run_dir = RunDir(run)
    model = load_model(run_dir.path, what="run")
    tok = load_tokenizer(run_dir.tokenizer, model.cfg.vocab_size)  # a path's and the vocabulary's refusal
    ids = tok.encode(prompt).ids
    if not ids:
        raise ValueError("prompt='' has no tokens to continue; give a prompt (the default is a newline)")
    check_generation_fits(model.cfg, len(ids), max_new_tokens, n)
    generator = torch.Generator().manual_seed(seed)
    written: list[int] = []
    shown = ""

    def show(nxt: torch.Tensor, logits: torch.Tensor) -> None:
        nonlocal shown
        written.append(int(nxt[0]))
        text = tok.decode(written)
        if stream is not None and not text.endswith("\ufffd"):  # a byte-level token may end mid-character
            stream.write(text[len(shown):])
            stream.flush()
            shown = text

    if stream is not None:
        stream.write(prompt)
    out = generate(model, torch.tensor([ids] * n), max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, generator=generator, on_token=show)
    if stream is not None:
        stream.write(tok.decode(written)[len(shown):] + "\n")
    return [prompt + tok.decode(row[len(ids):].tolist()) for row in out]


def run_generate(cfg: Any) -> None:
    """generate.py: check the arguments by type and range before anything is loaded, then stream a sample."""
    import sys


    if not cfg.run:
        raise SystemExit("generate.py needs run=<run dir>")
    args = {k: cfg[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "n")}
    check_values("", args, parameter_types(generate_text))
    env.set_threads(cfg.threads)
    texts = generate_text(str(cfg.run), str(cfg.prompt), **args, stream=sys.stdout)
    for i, text in enumerate(texts[1:], start=2):
        print(f"\n--- sample {i} ---\n{text}")
