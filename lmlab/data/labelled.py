"""`data=labelled`: a local labelled set, one JSON object a line, {"text": ..., "label": ...}, for a sequence classifier
(head=classify, lmlab.model.encoder), e.g. fine-tuned from a head=mlm run: `init_from=<run> head=classify
data=labelled data.path=train.jsonl data.val_path=val.jsonl`.

Each text is tokenized (`data.tokenizer`: char or bpe trained on the training texts, or a tokenizer.json; init_from
takes the source run's), cut to its first model.max_seq_len tokens and padded to that length with [MASK] (the first id
past the tokenizer's, which head=classify and head=mlm read: lmlab.model.encoder), so an example is the same row in
every batch. The label names are the distinct labels of the training file, sorted (numbers by value), and head=classify
takes them as head.labels; a validation label not among them is refused. Training order is a pure function of (seed,
sample index) as for a corpus (lmlab.data.datamodule.TrainBlocks, the step sampler), so a resume reads the same
batches. At every validation the accuracy on the validation set, per label and overall, its confusion matrix and the
majority label's share (the accuracy of always answering it) are written to <run>/classify.json; summary.json records
`val_accuracy` and `majority_accuracy`; `eval.py compare=` tabulates them (compare_classify.{md,csv}).

No CLUE data (GAU-α's benchmark) can be fetched on this machine; `python -m lmlab.data.labelled OUT_DIR` builds the
project's own set from Shakespeare's plays (`genre_set`): each speech of a play, its speaker's name left out, labelled
with the play's genre in the First Folio (1623) — comedy, history or tragedy — balanced by label, split by speech.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lmlab.data.datamodule import StepSampler, TrainBlocks
from lmlab.data.synthetic import check_split, variants
from lmlab.data.tokenizer import TOKENIZERS, build_tokenizer, check_tokenizer, load_tokenizer, save_tokenizer
from lmlab.record.tables import write_table

if TYPE_CHECKING:
    import lightning.pytorch as pl

NAME = "labelled"
FIGURES_FILE = "classify.json"
_DEFAULTS: dict[str, Any] = {"path": None, "val_path": None, "val_fraction": 0.1, "tokenizer": "char",
                             "vocab_size": 4096, "batch_size": 32, "num_workers": 0, "cache_dir": None}


def read_jsonl(path: str | Path) -> tuple[list[str], list[str]]:
    """The texts and labels (as strings) of a JSONL file, refusing a line without both, naming the line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.path: {str(path)!r} does not exist (a JSONL file of {{\"text\", \"label\"}} "
                                f"lines; python -m lmlab.data.labelled builds one)")
    texts, labels = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or row.get("label") is None:
            raise ValueError(f"{path}:{n}: each line is a JSON object with a string \"text\" and a \"label\"")
        texts.append(row["text"])
        labels.append(str(row["label"]))
    if not texts:
        raise ValueError(f"{path} holds no examples")
    return texts, labels


def label_names(labels: Sequence[str]) -> list[str]:
    """The distinct labels, sorted: by value when every one is a number, else as strings."""
    distinct = set(labels)
    numeric = all(re.fullmatch(r"-?\d+(\.\d+)?", x) for x in distinct)
    return sorted(distinct, key=float) if numeric else sorted(distinct)


def encode(tok: Any, texts: Sequence[str], seq_len: int, pad: int) -> np.ndarray:
    """(n, seq_len) int64: each text's first seq_len token ids, padded with `pad`."""
    rows = np.full((len(texts), seq_len), pad, dtype=np.int64)
    for i, enc in enumerate(tok.encode_batch(list(texts))):
        ids = enc.ids[:seq_len]
        rows[i, : len(ids)] = ids
    return rows


class _Examples(TrainBlocks):
    """Item i: example perm_e[i % n] (TrainBlocks' order), as (tokens (T,), label ())."""

    def __init__(self, x: np.ndarray, y: np.ndarray, seed: int) -> None:
        super().__init__(x, seed)
        self.y = y

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.block_index(i)
        return torch.from_numpy(self.blocks[j]), torch.tensor(self.y[j])


class LabelledDataModule:
    """The labelled set with the surface the training loop reads from a data module (lmlab.run.training; the task
    protocol of lmlab.data.tasks): `labels` (head=classify's), vocab_size, the loaders, unigram_entropy (here the
    labels' entropy, the loss of always answering their frequencies), the tokenizer, its figures."""

    trainer: Any = None  # the Lightning trainer while one runs this data (lmlab.run.lit_data): the step, the ranks
    eod_id: int | None = None  # the task protocol's (lmlab.data.tasks): None until the data gives one
    labels: list[str] | None = None  # set by `setup` (head=classify's)
    tokenizer: Any = None  # its tokenizer once it has one
    shards: Mapping[str, Any] = MappingProxyType({})  # what a resume checks (lmlab.run.plan.check_same_data)
    corpus_sha256: str | None = None  # a text corpus's fingerprint (the same check): none here
    evaluable = False  # eval.py's loss per length is a corpus's figure; a classifier's are in classify.json
    figures_file = FIGURES_FILE
    logged: dict[str, str] = {}  # val/accuracy is the head's own figure (lmlab.model.encoder), logged by the loop

    def __init__(self, data: Mapping[str, Any], *, seq_len: int, seed: int) -> None:
        spec = {**_DEFAULTS, **{k: v for k, v in dict(data).items() if k != "name"}}
        if unknown := sorted(set(spec) - set(_DEFAULTS)):
            raise ValueError(f"data={NAME} does not take {unknown}; it takes {sorted(_DEFAULTS)}")
        if spec["path"] is None:
            raise ValueError(f"data={NAME} needs data.path=<a JSONL file of {{\"text\", \"label\"}} lines> "
                             f"(python -m lmlab.data.labelled OUT_DIR builds one from Shakespeare's plays)")
        if not 0 < float(spec["val_fraction"]) < 1:
            raise ValueError(f"data.val_fraction={spec['val_fraction']} must be strictly between 0 and 1")
        self.path, self.val_path = Path(spec["path"]).expanduser(), spec["val_path"]
        self.val_fraction = float(spec["val_fraction"])
        self.tokenizer_kind, self.bpe_vocab_size = str(spec["tokenizer"]), int(spec["vocab_size"])
        check_tokenizer(self.tokenizer_kind, vocab_size=self.bpe_vocab_size)
        self.batch_size, self.num_workers = int(spec["batch_size"]), int(spec["num_workers"])
        self.cache_dir = Path(spec["cache_dir"] or "~/.cache/lmlab").expanduser()
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.tokenizer = None
        self.last: dict[str, Any] | None = None  # the latest measurement (classify.json)

    def prepare_data(self) -> None:
        self._build()

    def setup(self, stage: str | None = None) -> None:
        self._build()

    def _build(self) -> None:
        if self.tokenizer is not None:
            return
        texts, labels = read_jsonl(self.path)
        if self.val_path is not None:
            val_texts, val_labels = read_jsonl(self.val_path)
        else:  # the file's last val_fraction, as a corpus splits its stream
            cut = int(len(texts) * (1 - self.val_fraction))
            texts, labels, val_texts, val_labels = texts[:cut], labels[:cut], texts[cut:], labels[cut:]
        if not texts or not val_texts:
            raise ValueError(f"data.val_fraction={self.val_fraction} leaves {len(texts)} / {len(val_texts)} training "
                             f"/ validation examples of {self.path}; change it or give data.val_path")
        self.labels = label_names(labels)
        if len(self.labels) < 2:
            raise ValueError(f"{self.path} has one label ({self.labels[0]!r}): a classifier needs two or more")
        if unseen := sorted(set(val_labels) - set(self.labels)):
            raise ValueError(f"the validation set has labels the training set lacks: {unseen}")
        if self.tokenizer_kind in TOKENIZERS:
            tok = build_tokenizer(self.tokenizer_kind, texts, vocab_size=self.bpe_vocab_size, cache_dir=self.cache_dir)
        else:
            tok = load_tokenizer(self.tokenizer_kind)
        self.vocab_size: int = tok.get_vocab_size()
        self.pad_id = self.vocab_size  # [MASK]: the first id past the tokenizer's (lmlab.model.encoder)
        index = {name: i for i, name in enumerate(self.labels)}
        self.train_x, self.val_x = (encode(tok, t, self.seq_len, self.pad_id) for t in (texts, val_texts))
        self.train_y, self.val_y = (np.array([index[x] for x in ls], dtype=np.int64) for ls in (labels, val_labels))
        self.train_dataset = _Examples(self.train_x, self.train_y, self.seed)
        self.tokenizer = tok
        self.tokenizer_sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()
        self.data_sha256 = hashlib.sha256(self.train_x.tobytes() + self.train_y.tobytes()).hexdigest()

    def _require_setup(self) -> None:
        if self.tokenizer is None:
            raise RuntimeError(f"data={NAME}: call setup() (or trainer.fit) before reading data")

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        t = self.trainer
        step, accumulate, world, rank = (0, 1, 1, 0) if t is None else (t.global_step, t.accumulate_grad_batches,
                                                                         t.world_size, t.global_rank)
        sampler = StepSampler(start=step * accumulate * self.batch_size * world, batch_size=self.batch_size,
                              rank=rank, world_size=world)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers)

    def val_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_setup()
        return torch.from_numpy(self.val_x), torch.from_numpy(self.val_y)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.val_inputs()), batch_size=self.batch_size, shuffle=False)

    def unigram_entropy(self, split: str = "val") -> float:
        """The entropy of the split's labels (nats): the loss of a classifier that answers their frequencies."""
        self._require_setup()
        check_split(split)
        counts = np.bincount(self.train_y if split == "train" else self.val_y, minlength=len(self.labels))
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def save_tokenizer(self, path: str | Path) -> None:
        self._require_setup()
        save_tokenizer(self.tokenizer, path)

    def callbacks(self, run_dir: str | Path) -> list[Any]:
        from lmlab.data.callbacks import TaskFigures  # Lightning's: training imports it, eval.py does not

        return [TaskFigures(self, Path(run_dir) / FIGURES_FILE)]

    @torch.no_grad()
    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The classifier on the validation set (classify.json): accuracy overall and per label, the confusion matrix
        (rows: the true label, columns: the predicted one), the majority label's share."""
        x, y = self.val_inputs()
        was = pl_module.training
        pl_module.eval()
        try:
            pred = torch.cat([pl_module(chunk.to(pl_module.device)).argmax(-1).cpu()
                              for chunk in x.split(self.batch_size)])
        finally:
            pl_module.train(was)
        n = len(self.labels)
        confusion = torch.bincount(y * n + pred, minlength=n * n).view(n, n)
        per_label = (confusion.diag() / confusion.sum(1).clamp_min(1)).tolist()
        return {"step": int(trainer.global_step), "labels": self.labels, "n_val": int(len(y)),
                "accuracy": float((pred == y).float().mean()), "per_label_accuracy": dict(zip(self.labels, per_label)),
                "majority_accuracy": float(confusion.sum(1).max() / len(y)), "confusion": confusion.tolist()}

    def figures(self) -> dict[str, Any]:
        """What summary.json records: the latest validation accuracy and the majority label's share (None before any
        validation)."""
        last = self.last or {}
        return {"val_accuracy": last.get("accuracy"), "majority_accuracy": last.get("majority_accuracy"),
                "n_labels": len(self.labels or ()) or None, "classify_step": last.get("step")}

    @staticmethod
    def compare_section(sweep_dir: Path, runs: Sequence[Path], overrides: dict[Path, dict[str, str]],
                        keys: Sequence[str]) -> str:
        """For the runs that hold a classify.json: compare_classify.{md,csv}, one row per variant (its seeds
        averaged): the validation accuracy and the majority label's share. "" when no run has one."""
        if not (groups := variants(runs, overrides, keys, FIGURES_FILE)):
            return ""
        rows = [{**values, "n": len(runs_), "step": runs_[0]["step"],
                 "accuracy": statistics.fmean(r["accuracy"] for r in runs_),
                 "majority_accuracy": runs_[0]["majority_accuracy"]} for values, runs_ in groups.values()]
        cols = [*keys, "n", "step", "accuracy", "majority_accuracy"]
        return "\nClassification (validation accuracy; majority: always its commonest label)\n\n" + write_table(
            rows, cols, sweep_dir / "compare_classify")

    def state_dict(self) -> dict[str, Any]:
        if self.tokenizer is None:
            return {}
        return {"tokenizer_sha256": self.tokenizer_sha256, "data_sha256": self.data_sha256, "labels": self.labels}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tokenizer is None or not state:
            return
        for key in ("tokenizer_sha256", "data_sha256", "labels"):
            if state.get(key) is not None and state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint was trained on another labelled set ({key} differs from "
                                 f"data.path={self.path}'s): resume with the run's own data")


# --- the project's own labelled set: Shakespeare's speeches by the play's genre in the First Folio -------------------

FOLIO = {  # the plays of each section of the First Folio (1623), by the file stems of the shakespeare corpus
    "comedy": ["tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
               "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
               "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"],
    "history": ["john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"],
    "tragedy": ["troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
                "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra",
                "cymbeline"],
}
_SPEAKER = re.compile(r"^[A-Z][A-Za-z' .-]{0,40}\.$")  # "Hor.", "FERDINAND.", "First Citizen."


def speeches(text: str, min_chars: int = 40) -> list[str]:
    """A play's speeches: each paragraph that opens with its speaker's line, without it and without stage directions
    ([...] lines), at least `min_chars` long."""
    from lmlab.data.paragraphs import paragraphs

    out = []
    for p in paragraphs(text):
        lines = p.strip().split("\n")
        if len(lines) < 2 or not _SPEAKER.match(lines[0].strip()):
            continue
        body = "\n".join(line.strip() for line in lines[1:] if not line.strip().startswith(("[", "{")))
        if len(body) >= min_chars:
            out.append(body)
    return out


def genre_set(files: Sequence[Path], per_label: int | None = None, val_fraction: float = 0.1, seed: int = 0
              ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, val) rows {"text", "label", "play"} of the plays among `files` (by stem, `FOLIO`): every speech,
    balanced to the rarest genre's count (or `per_label`) by a seeded draw, shuffled, the last val_fraction of each
    genre's for validation."""
    genre = {play: g for g, plays in FOLIO.items() for play in plays}
    by_label: dict[str, list[dict[str, str]]] = {g: [] for g in FOLIO}
    for f in sorted(files):
        play = Path(f).stem.removesuffix("_gut")
        if play in genre:
            by_label[genre[play]] += [{"text": s, "label": genre[play], "play": play}
                                      for s in speeches(Path(f).read_text(encoding="utf-8"))]
    if missing := [g for g, rows in by_label.items() if not rows]:
        raise ValueError(f"no speeches of the {missing} plays among the files (FOLIO names them by file stem)")
    n = min(len(rows) for rows in by_label.values()) if per_label is None else per_label
    rng = random.Random(seed)
    train, val = [], []
    for g, rows in by_label.items():
        rows = rng.sample(rows, min(n, len(rows)))
        cut = len(rows) - max(1, math.ceil(len(rows) * val_fraction))
        train += rows[:cut]
        val += rows[cut:]
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def main(argv: list[str] | None = None) -> None:
    from lmlab.data.corpus import shakespeare_files

    parser = argparse.ArgumentParser(prog="python -m lmlab.data.labelled",
                                     description="Write OUT_DIR/train.jsonl and val.jsonl: Shakespeare's speeches "
                                                 "labelled by their play's First Folio genre (comedy, history, "
                                                 "tragedy), balanced.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-label", type=int, default=None, help="speeches per genre (default: the rarest's count)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default="~/.cache/lmlab", help="where Shakespeare's texts are cached")
    args = parser.parse_args(argv)
    train, val = genre_set(shakespeare_files(args.cache_dir), args.per_label, args.val_fraction, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                encoding="utf-8")
    print(f"{len(train)} / {len(val)} train / val speeches, {len(FOLIO)} genres, in {args.out} (data=labelled "
          f"data.path={args.out / 'train.jsonl'} data.val_path={args.out / 'val.jsonl'})")


if __name__ == "__main__":
    main()
