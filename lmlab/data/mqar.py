"""`data=mqar`: multi-query associative recall (MQAR), Zoology's synthetic recall task.

Arora et al. (2023, "Zoology: Measuring and Improving Recall in Efficient Language Models", arXiv:2312.04927): a
sequence first lists `n_pairs` key-value pairs `k1 v1 k2 v2 ... kN vN`, then asks keys again further on; at each
query the next token must be the value that key was paired with. Attention answers it with one lookup; a fixed-size
recurrent state (linear attention, state-space mixers) must hold every pair at once, so pure linear mixers fall
behind as `n_pairs` grows while a hybrid with one attention layer recovers — the gap Zoology measures.

An example, as Zoology's generator (`multiquery_ar`) builds it, of length T = `model.max_seq_len`:

- the vocabulary V = `data.vocab_size` is split as Zoology splits it: keys are ids 1 .. V//2 − 1, values
  V//2 .. V − 1 (disjoint); id 0 is Zoology's placeholder for the filler and never a key or a value;
- positions 0 .. 2N − 1 hold the pairs: N distinct keys and N distinct values, drawn without replacement;
- the rest holds the queries: T − 2N positions cut into (T − 2N) // 2 slots of two; `n_queries` slots are drawn
  without replacement with Zoology's power law p(slot g) ∝ a·g^(a − 1), g = 1, 2, ... (a = `data.power_a`, 0.01 as
  Zoology: mostly the first slots, short gaps; a = 1 is uniform), and the first position of each holds a key;
- every other position of the query part is filler, uniform over the whole vocabulary (Zoology's
  `random_non_queries`): keys and values may appear there, unasked;
- the target at a query's position is its key's value; every other target is -100 (IGNORE), no loss and no metric
  (lmlab.model.loss's ignore_index, on the plain and the chunked loss alike). The value never follows its query in
  the input: the model must recall it from the pairs.

One difference from Zoology's generator: which keys are asked, and in which order, is a random permutation of the
pairs (`n_queries` of them, default all), drawn apart from the slots; Zoology gives the j-th slot drawn to the j-th
pair, so its early pairs tend to be asked first.

Example i of the training stream is a pure function of (the run's seed, i) — numpy's generator seeded with
[seed, stream, i] — so the training order needs no state: the sampler starts at the example the trainer has reached
(steps × accumulation × batch × ranks, recorded in the checkpoint as `examples`), and a resumed run reads exactly the
batches the uninterrupted one would have, on any number of ranks and loader workers (as TextDataModule's blocks).
A resume whose generator keys differ from the checkpoint's is refused before the fit (lmlab.run.plan.check_same_data
compares the recipe's sha256, the module's `shards`).
The validation examples (`data.val_windows` of them) come from their own stream, seeded with VAL_SEED whatever the
run's seed: the same in every run, so accuracies of different runs are measured on identical examples.

The metric (`recall_metrics`): accuracy of the argmax over the whole vocabulary at the query positions (Zoology's
accuracy), overall, by query index (the j-th query of its sequence) and by key position (the pair its key was in).
`MQARDataModule.measure` measures it at every validation (not the sanity check) on the validation examples; as for
every synthetic task (lmlab.data.synthetic) it is logged (`recall/accuracy`) and written to <run>/recall.json;
summary.json gets `recall_accuracy`, `recall_chance_accuracy` (1 / the number of values: a guess over the value
vocabulary), `recall_n_pairs` and `recall_step`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lmlab.data.datamodule import StepSampler
from lmlab.data.keys import DATA_SEED
from lmlab.data.synthetic import SyntheticTask, check_split, variants
from lmlab.record.tables import write_table
from lmlab.registry import NonNegativeInt, PositiveInt, Range, check_values

NAME = "mqar"
RECALL_FILE = "recall.json"
IGNORE = -100  # lmlab.model.loss.cross_entropy's ignore_index: no loss, no metric
VAL_SEED = 0  # the validation stream's seed: the same examples in every run, whatever the run's seed
TRAIN_STREAM, VAL_STREAM = 0, 1
_DEFAULTS: dict[str, Any] = {"n_pairs": 8, "n_queries": None, "vocab_size": 8192, "power_a": 0.01,
                             "batch_size": 64, "val_windows": 256, "num_workers": 0}  # conf/data/mqar.yaml
_TYPES = {"n_pairs": PositiveInt, "n_queries": PositiveInt | None, "vocab_size": PositiveInt,
          "power_a": Annotated[float, Range(gt=0)], "batch_size": PositiveInt, "val_windows": PositiveInt,
          "num_workers": NonNegativeInt}


@dataclass(frozen=True)
class MQARTask:
    """What decides the examples: the sequence length and the generator's keys. `check` refuses a task that cannot
    be built, naming the key and what would fit."""

    seq_len: int
    n_pairs: int
    n_queries: int
    vocab_size: int
    power_a: float

    @property
    def first_value(self) -> int:
        """Zoology's split: keys 1 .. first_value − 1, values first_value .. vocab_size − 1."""
        return self.vocab_size // 2

    @property
    def n_keys(self) -> int:
        return self.first_value - 1

    @property
    def n_values(self) -> int:
        return self.vocab_size - self.first_value

    @property
    def slots(self) -> int:
        """The query part's slots of two positions: where a query may go."""
        return (self.seq_len - 2 * self.n_pairs) // 2

    @property
    def chance_accuracy(self) -> float:
        """A guess over the value vocabulary."""
        return 1.0 / self.n_values

    @functools.cached_property
    def gap_p(self) -> np.ndarray:
        """Zoology's power law over the slots: p(g) ∝ a·g^(a − 1), g = 1 .. slots."""
        p = self.power_a * np.arange(1, self.slots + 1, dtype=np.float64) ** (self.power_a - 1)
        return p / p.sum()

    def check(self) -> MQARTask:
        n, q, t, v = self.n_pairs, self.n_queries, self.seq_len, self.vocab_size
        if q > n:
            raise ValueError(f"data.n_queries={q} must be at most data.n_pairs={n}: each query asks one key of its "
                             f"example once (null: all {n})")
        if 2 * n + 2 * q > t:
            most = (t - 2 * q) // 2  # pairs that fit beside n_queries queries
            fits = (f"at most data.n_pairs={most} fits with data.n_queries={q}" if q < n and most >= q else
                    f"at most data.n_pairs={t // 4} fits with as many queries")
            raise ValueError(f"data.n_pairs={n} with data.n_queries={q} needs 2*n_pairs + 2*n_queries = "
                             f"{2 * n + 2 * q} positions, more than model.max_seq_len={t}: {fits}, or raise "
                             f"model.max_seq_len to {2 * n + 2 * q}")
        if self.n_keys < n:
            raise ValueError(f"data.vocab_size={v} has {max(self.n_keys, 0)} keys (ids 1 .. vocab_size//2 − 1, "
                             f"Zoology's split; values from vocab_size//2), fewer than data.n_pairs={n} distinct keys "
                             f"per example: data.vocab_size >= {2 * n + 2} fits")
        return self

    def fingerprint(self) -> str:
        """sha256 of the generator's recipe: what a resume checks it draws again (lmlab.run.plan.check_same_data)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def draw_example(task: MQARTask, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One example from `rng`: (input, target), (seq_len,) int64 each (module docstring)."""
    n, q = task.n_pairs, task.n_queries
    keys = rng.choice(task.n_keys, n, replace=False) + 1
    values = rng.choice(task.n_values, n, replace=False) + task.first_value
    x = rng.integers(0, task.vocab_size, task.seq_len)  # the filler, overwritten by the pairs and the queries
    y = np.full(task.seq_len, IGNORE, dtype=np.int64)
    x[0:2 * n:2], x[1:2 * n:2] = keys, values
    asked = rng.permutation(n)[:q]  # which pairs are queried
    at = 2 * n + 2 * power_law_slots(task, rng)  # where
    x[at], y[at] = keys[asked], values[asked]
    return x, y


def power_law_slots(task: MQARTask, rng: np.random.Generator) -> np.ndarray:
    """`n_queries` distinct slots drawn without replacement with probabilities `gap_p`, as Zoology's
    np.random.choice(slots, n_queries, replace=False, p=gap_p) draws them, in the exponential-keys form
    (Efraimidis & Spirakis, 2006: the q smallest of E_g / p_g, E_g ~ Exp(1), are a successive weighted draw without
    replacement): a tenth of the time. The slots come unordered; which pair each one asks is drawn apart."""
    return np.argpartition(rng.standard_exponential(task.slots) / task.gap_p, task.n_queries - 1)[:task.n_queries]


def example(task: MQARTask, seed: int, stream: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example `index` of a stream: a pure function of (task, seed, stream, index)."""
    x, y = draw_example(task, np.random.default_rng([seed % 2**64, stream, index]))
    return torch.from_numpy(x), torch.from_numpy(y)


def examples(task: MQARTask, seed: int, stream: int, count: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples start .. start + count − 1 of a stream, stacked: (count, seq_len) each."""
    pairs = [example(task, seed, stream, i) for i in range(start, start + count)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class MQARExamples(Dataset):
    """Map-style and infinite: item i is example i of the stream (read by StepSampler's indices)."""

    def __init__(self, task: MQARTask, seed: int, stream: int = TRAIN_STREAM) -> None:
        self.task, self.seed, self.stream = task, seed, stream

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return example(self.task, self.seed, self.stream, int(i))


def recall_metrics(logits: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, n_pairs: int) -> dict[str, Any]:
    """Accuracy at the query positions (targets != IGNORE) of the argmax of `logits` (N, T, V), or of predictions
    (N, T) already taken: overall (`accuracy`, over every query), `by_query` (the j-th query of its sequence) and
    `by_key_position` (the pair its key was in, 0 .. n_pairs − 1; None where no query asked it). inputs, targets
    (N, T). Ties in the argmax go to the lowest id (torch.argmax)."""
    pred = logits.argmax(-1) if logits.dim() == 3 else logits
    asked = targets != IGNORE
    right = (pred == targets) & asked
    query = (asked.cumsum(1) - 1)[asked]  # the index of each query in its sequence
    keys = inputs[:, 0:2 * n_pairs:2]  # (N, n_pairs)
    pair = (inputs[:, :, None] == keys[:, None, :]).int().argmax(-1)[asked]  # the pair of each query's key
    hits = right[asked].double()

    def by(index: torch.Tensor, size: int) -> list[float | None]:
        count = torch.bincount(index, minlength=size)
        total = torch.bincount(index, weights=hits, minlength=size)
        return [float(s / c) if c else None for s, c in zip(total.tolist(), count.tolist())]

    return {"examples": int(targets.size(0)), "queries": int(asked.sum()),
            "accuracy": float(hits.mean()) if hits.numel() else math.nan,
            "by_query": by(query, int(query.max()) + 1 if query.numel() else 0), "by_key_position": by(pair, n_pairs)}


@torch.no_grad()
def predictions(model: Any, inputs: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The argmax of `model(inputs)` (N, T), in batches of `batch_size`: the (N, T, V) logits are never held whole."""
    device = next(model.parameters()).device
    return torch.cat([model(inputs[i:i + batch_size].to(device)).argmax(-1).cpu()
                      for i in range(0, inputs.size(0), batch_size)])


class MQARDataModule(SyntheticTask):
    """MQAR with the surface the training loop reads from a data module (lmlab.run.training): vocab_size, train/val
    dataloaders, unigram_entropy, save_tokenizer, tokenizer_kind/_sha256, state_dict; plus `callbacks` (the recall
    metrics) and `figures` (summary.json's). `data` is the composed `data` group, `seq_len` `model.max_seq_len`."""

    tokenizer_kind = NAME
    figures_file = RECALL_FILE
    logged = {"recall/accuracy": "accuracy"}

    def __init__(self, data: Mapping[str, Any], *, seq_len: int, seed: int) -> None:
        spec = {**_DEFAULTS, **{k: v for k, v in dict(data).items() if k != "name"}}
        if unknown := sorted(set(spec) - set(_TYPES)):
            raise ValueError(f"data={NAME} does not take {['data.' + k for k in unknown]}; it takes "
                             f"{sorted('data.' + k for k in _TYPES)}")
        check_values("data.", spec, _TYPES)
        n_queries = spec["n_queries"] if spec["n_queries"] is not None else spec["n_pairs"]
        self.task = MQARTask(seq_len=int(seq_len), n_pairs=spec["n_pairs"], n_queries=n_queries,
                             vocab_size=spec["vocab_size"], power_a=float(spec["power_a"])).check()
        super().__init__(vocab_size=self.task.vocab_size, unk="0", batch_size=spec["batch_size"])
        self.val_windows_n, self.num_workers = spec["val_windows"], spec["num_workers"]
        self.seq_len, self.seed = int(seq_len), int(seed)
        # what a resume checks it draws again (lmlab.run.plan.check_same_data), before the run directory is touched
        recipe = "data.n_pairs, data.n_queries, data.vocab_size, data.power_a, model.max_seq_len"
        self.shards = {f"data={NAME} ({recipe})": {"sha256": self.task.fingerprint()}}
        self.train_dataset = MQARExamples(self.task, self.seed)

    @functools.cached_property
    def _val(self) -> tuple[torch.Tensor, torch.Tensor]:
        return examples(self.task, VAL_SEED, VAL_STREAM, self.val_windows_n)

    def val_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed validation examples, (val_windows, seq_len) each: the same in every run and every call."""
        return self._val

    def examples_drawn(self) -> int:
        """Training examples consumed so far, over all ranks: where the stream goes on (a restored trainer reports
        the resumed step)."""
        t = self.trainer
        return 0 if t is None else t.global_step * t.accumulate_grad_batches * self.batch_size * t.world_size

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        rank, world = (0, 1) if t is None else (t.global_rank, t.world_size)
        sampler = StepSampler(start=self.examples_drawn(), batch_size=self.batch_size, rank=rank, world_size=world)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def unigram_entropy(self, split: str = "val") -> float:
        """The targets are values, each uniform over the value vocabulary: ln(n_values), the loss of a model that
        knows which tokens are values and nothing of the pairs."""
        check_split(split)
        return math.log(self.task.n_values)

    def measure(self, trainer, pl_module) -> dict[str, Any]:
        """The recall accuracy of the model on the validation examples, overall and by key position (recall.json)."""
        x, y = self.val_inputs()
        task = self.task
        return {"step": int(trainer.global_step), "seq_len": task.seq_len, "n_pairs": task.n_pairs,
                "n_queries": task.n_queries, "vocab_size": task.vocab_size, "power_a": task.power_a,
                "chance_accuracy": task.chance_accuracy,
                **recall_metrics(predictions(pl_module, x, self.batch_size), x, y, task.n_pairs)}

    def figures(self) -> dict[str, Any]:
        """What summary.json records of MQAR: the latest accuracy (None before any validation)."""
        last = self.last or {}
        return {"recall_accuracy": last.get("accuracy"), "recall_chance_accuracy": self.task.chance_accuracy,
                "recall_n_pairs": self.task.n_pairs, "recall_step": last.get("step")}

    @staticmethod
    def compare_section(sweep_dir: Path, runs: Sequence[Path], overrides: dict[Path, dict[str, str]],
                        keys: Sequence[str]) -> str:
        """For the runs that hold a recall.json (data=mqar): compare_recall.{md,csv}, one row per variant (its seeds
        averaged) with the recall accuracy at the last validation, and plots/mqar_recall.png, the accuracy by key
        position per variant. "" when no run has one."""
        if not (groups := variants(runs, overrides, keys, RECALL_FILE)):
            return ""
        from lmlab.record.plots import plot_recall  # matplotlib: imported when there is something to draw

        rows, curves = [], {}
        for label, (values, recalls) in groups.items():
            first = recalls[0]
            rows.append({**values, "n": len(recalls), "step": first["step"],
                         "n_pairs": first["n_pairs"], "n_queries": first["n_queries"],
                         "accuracy": statistics.fmean(r["accuracy"] for r in recalls),
                         "chance_accuracy": first["chance_accuracy"]})
            curves[label] = [_mean([r["by_key_position"][i] for r in recalls if i < len(r["by_key_position"])])
                             for i in range(max(len(r["by_key_position"]) for r in recalls))]
        plot_recall(curves, sweep_dir / "plots" / "mqar_recall.png")
        cols = [*keys, "n", "step", "n_pairs", "n_queries", "accuracy", "chance_accuracy"]
        return ("\nMQAR recall (argmax accuracy at the query positions; by key position: plots/mqar_recall.png)\n\n"
                + write_table(rows, cols, sweep_dir / "compare_recall"))

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer_sha256": self.tokenizer_sha256, "shards": self.shards, "seed": self.seed,
                "seq_len": self.seq_len, "examples": self.examples_drawn()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and state.get("seed", self.seed) != self.seed:  # the recipe was compared before the fit
            rank_zero_warn(f"resuming data={NAME} with {DATA_SEED} {self.seed}, the checkpoint's is {state['seed']}: "
                           f"the training examples will not continue the checkpoint's stream")


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None
