"""Golden files: what the default corpus tokenizes to and what a tiny run on it logs, pinned so a silent change to
the data pipeline or the training numbers fails a test (torchtitan's tests/assets/losses/ is the model).

    python -m tests.golden.regenerate        # rewrite tests/golden/*.json on purpose (say why in the commit)

`tests/unit/project/test_golden.py` computes the same figures with the same functions and compares them with the files.
"""

from __future__ import annotations

import csv
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TOKENS, LOSSES = HERE / "tokens.json", HERE / "losses.json"
FAST, SLICE = HERE / "fast.json", HERE / "slice.npy"  # the unit tier's check: a few steps on a checked-in slice
# The tiny run: the default `python train.py` (model=tiny, data=shakespeare, char tokens) cut to 50 steps, one thread;
# its warmup the default's 100 steps, set on purpose (a run this short otherwise caps it at 10: lmlab.warmup), so the
# pinned losses are those of the numbers they were pinned with
RUN = ["trainer.max_steps=50", "trainer.val_check_interval=25", "trainer.log_every_n_steps=1", "logger=none",
       "threads=1", "trainer.enable_progress_bar=false", "schedule.warmup_steps=100"]
DIGITS = 6  # the losses are pinned to this many decimals


def _sha256(tokens: Any) -> str:
    return hashlib.sha256(np.asarray(tokens).astype("<u4").tobytes()).hexdigest()


def token_hashes() -> dict[str, Any]:
    """For the default corpus with `data.tokenizer=char` and `=bpe`: the vocabulary size, the number of train and
    val tokens and the sha256 of each stream's ids (as little-endian uint32), and of the tokenizer."""
    from omegaconf import OmegaConf

    from lmlab import compose
    from lmlab.data import TextDataModule

    out = {}
    for tokenizer in ("char", "bpe"):
        cfg = compose([f"data.tokenizer={tokenizer}"])
        dm = TextDataModule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len,
                            seed=cfg.seed)
        dm.setup("fit")
        out[tokenizer] = {"vocab_size": dm.vocab_size, "train_tokens": len(dm.train_tokens),
                          "val_tokens": len(dm.val_tokens), "train_sha256": _sha256(dm.train_tokens),
                          "val_sha256": _sha256(dm.val_tokens), "tokenizer_sha256": dm.tokenizer_sha256}
    return out


def tiny_run_losses() -> dict[str, Any]:
    """train/loss at each of the first 50 steps and val/loss at each validation of the tiny run (RUN)."""
    from lmlab import compose
    from lmlab.run.training import train

    with tempfile.TemporaryDirectory() as tmp:
        train(compose(RUN), Path(tmp) / "run", overrides=RUN)
        with open(Path(tmp) / "run" / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    pick = {name: {r["step"]: round(float(r[name]), DIGITS) for r in rows if r.get(name)}
            for name in ("train/loss", "val/loss")}
    return {"overrides": RUN, **pick}


# The fast check: the default run's model, optimizer, schedule and clipping (no Lightning, no corpus), FAST_STEPS
# steps of batch 8 on the first tokens of the default corpus's char stream, read in order from SLICE
FAST_RUN = ["threads=1", "data.batch_size=8"]
FAST_STEPS = 10


def corpus_slice() -> np.ndarray:
    """The tokens the fast check reads: FAST_STEPS batches of windows of the default corpus's train stream, in order."""
    from omegaconf import OmegaConf

    from lmlab import compose
    from lmlab.data import TextDataModule

    cfg = compose(FAST_RUN)
    dm = TextDataModule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len, seed=cfg.seed)
    dm.setup("fit")
    n = FAST_STEPS * cfg.data.batch_size * cfg.model.max_seq_len + 1
    return np.asarray(dm.train_tokens[:n]).astype(np.uint8)


def fast_losses(tokens: np.ndarray) -> list[float]:
    """The train loss of each of FAST_STEPS optimizer steps of the default model (seeded as train.py seeds it) on
    `tokens`, with the default optimizer, lr schedule and gradient clipping."""
    import torch
    from lightning.pytorch import seed_everything
    from omegaconf import OmegaConf

    from lmlab import build_model, compose
    from lmlab.run.lit import configure_optimization

    torch.set_num_threads(1)
    cfg = compose(FAST_RUN)
    seed_everything(cfg.seed, verbose=False)
    model = build_model(cfg, vocab_size=85)
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    opt = configure_optimization(model, optim, OmegaConf.to_container(cfg.schedule, resolve=True),
                                 cfg.trainer.max_steps)
    optimizer, schedule = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    b, t = cfg.data.batch_size, cfg.model.max_seq_len
    ids = torch.from_numpy(tokens.astype(np.int64))
    losses = []
    for step in range(FAST_STEPS):
        block = ids[step * b * t: (step + 1) * b * t + 1]
        x, y = block[:-1].view(b, t), block[1:].view(b, t)
        loss = model(x, y)
        loss.backward()
        if optim.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(round(loss.item(), DIGITS))
    return losses


def main() -> None:
    TOKENS.write_text(json.dumps(token_hashes(), indent=1) + "\n")
    LOSSES.write_text(json.dumps(tiny_run_losses(), indent=1) + "\n")
    tokens = corpus_slice()
    np.save(SLICE, tokens)
    FAST.write_text(json.dumps({"overrides": FAST_RUN, "train/loss": fast_losses(tokens)}, indent=1) + "\n")
    print(f"wrote {TOKENS}, {LOSSES}, {SLICE} and {FAST}")


if __name__ == "__main__":
    main()
