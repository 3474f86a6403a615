"""`data=position_probe`: Su's position probe — can the model tell where it is when every input is the same?

Su (2022, "相对位置编码Transformer的一个理论缺陷与对策", a theoretical defect of relative position encodings and
its remedies): a model that can locate itself maps the input [0, 0, ..., 0] to the output [1, 2, ..., n]. Here
the input is n copies of token 0 and the target at position i (0-based) is i + 1 — Su's [1, ..., n], the 1-based
position. The vocabulary is 0 .. n (n = `model.max_seq_len`): 0 is the input token and never a target, 1 .. n are
the positions. Chance accuracy is 1/n: a model that sees the same thing everywhere gives the same answer
everywhere, right at one position.

Why it separates the schemes: with identical inputs, every position's values are identical, so an attention whose
weights sum to one (softmax, softmax_plus) outputs that same value at every position whatever the weights are — a
scheme acting only on the weights (none, rope, alibi) leaves every position identical, layer after layer. A scheme
that changes the input (learned, sinusoidal) does not; nor does a score whose rows do not sum to one (relu2) when the
weights vary with distance (rope, alibi). relu2 without positions is position-blind too, under lmlab's causal
divisor n = i + 1: i + 1 equal weights relu²(c)/(i + 1) sum to relu²(c) at every i.

The metrics (`position_metrics`, per position and their means) are measured at every validation on the fixed
validation windows (`measure`; lmlab.data.synthetic logs them as `probe/accuracy` and `probe/error` and writes them
to `probe.json` in the run directory); their means go into summary.json (`probe_accuracy`, `probe_error`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lmlab.data.synthetic import SyntheticTask, check_split, variants
from lmlab.record.tables import write_table

NAME = "position_probe"
PROBE_FILE = "probe.json"
INPUT_TOKEN = 0
_KEYS = {"name", "batch_size", "val_windows", "num_workers"}  # conf/data/position_probe.yaml


def probe_pair(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of one window, (seq_len,) each: all INPUT_TOKEN, and the positions 1 .. seq_len."""
    return (torch.full((seq_len,), INPUT_TOKEN, dtype=torch.long),
            torch.arange(1, seq_len + 1, dtype=torch.long))


def position_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Per position (over the windows) and mean (over positions) of: accuracy (argmax == target), error |argmax −
    target| and p_true (the probability of the target); and the mean prediction per position. logits (N, T, V),
    targets (N, T). Ties in the argmax go to the lowest class (torch.argmax)."""
    pred = logits.argmax(-1)  # (N, T)
    p_true = logits.float().softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # (N, T)
    per = {"accuracy": (pred == targets).float().mean(0), "error": (pred - targets).abs().float().mean(0),
           "p_true": p_true.mean(0), "prediction": pred.float().mean(0)}
    out: dict[str, Any] = {"position": targets[0].tolist(), "windows": int(targets.size(0))}
    out |= {k: v.tolist() for k, v in per.items()}
    out |= {f"mean_{k}": float(per[k].mean()) for k in ("accuracy", "error", "p_true")}
    return out


class _Repeat(IterableDataset):
    """The one training pair, forever (every example of the task is the same sequence)."""

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.pair = pair

    def __iter__(self):
        while True:
            yield self.pair


class PositionProbeDataModule(SyntheticTask):
    """The probe with the surface the training loop reads from a data module (lmlab.run.training): vocab_size,
    train/val dataloaders, unigram_entropy, save_tokenizer, tokenizer_kind/_sha256, state_dict; plus `callbacks`
    (the metrics) and `figures` (their means for summary.json). `data` is the composed `data` group, `seq_len`
    `model.max_seq_len`."""

    tokenizer_kind = NAME
    figures_file = PROBE_FILE
    logged = {"probe/accuracy": "mean_accuracy", "probe/error": "mean_error"}

    def __init__(self, data: Mapping[str, Any], *, seq_len: int, seed: int) -> None:
        spec = {"batch_size": 1, "val_windows": 1, "num_workers": 0, **dict(data)}
        if unknown := sorted(set(spec) - _KEYS):
            raise ValueError(f"data={NAME} does not take {unknown}; it takes {sorted(_KEYS - {'name'})}")
        for key in ("batch_size", "val_windows"):
            if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
                raise ValueError(f"data.{key}={spec[key]!r} must be an integer >= 1")
        if int(seq_len) < 2:
            raise ValueError(f"model.max_seq_len={seq_len} must be at least 2 for data={NAME} (one position is "
                             f"always right)")
        # the words "0" .. "n": the input token 0 and the positions 1 .. seq_len
        super().__init__(vocab_size=int(seq_len) + 1, unk=str(INPUT_TOKEN), batch_size=spec["batch_size"])
        self.val_windows_n, self.num_workers = spec["val_windows"], int(spec["num_workers"])
        self.seq_len, self.seed = int(seq_len), int(seed)

    def val_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed validation windows, (val_windows, seq_len) each: the same in every run and every call."""
        x, y = probe_pair(self.seq_len)
        return x.repeat(self.val_windows_n, 1), y.repeat(self.val_windows_n, 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Repeat(probe_pair(self.seq_len)), batch_size=self.batch_size, num_workers=0)

    def unigram_entropy(self, split: str = "val") -> float:
        """The targets are the positions 1 .. n once each: ln n, the loss of the best position-blind model."""
        check_split(split)
        return math.log(self.seq_len)

    def measure(self, trainer, pl_module) -> dict[str, Any]:
        """The per-position metrics of the model on the validation windows (probe.json)."""
        x, y = self.val_inputs()
        logits = pl_module(x.to(pl_module.device)).cpu()
        return {"step": int(trainer.global_step), "seq_len": self.seq_len, "chance_accuracy": 1.0 / self.seq_len,
                **position_metrics(logits, y)}

    def figures(self) -> dict[str, Any]:
        """What summary.json records of the probe: the latest means (None before any validation)."""
        last = self.last or {}
        return {"probe_accuracy": last.get("mean_accuracy"), "probe_error": last.get("mean_error"),
                "probe_p_true": last.get("mean_p_true"), "probe_chance_accuracy": 1.0 / self.seq_len,
                "probe_step": last.get("step")}

    @staticmethod
    def compare_section(sweep_dir: Path, runs: Sequence[Path], overrides: dict[Path, dict[str, str]],
                        keys: Sequence[str]) -> str:
        """For the runs that hold a probe.json (data=position_probe): compare_probe.{md,csv}, one row per variant (its
        seeds averaged) with the mean accuracy, error |argmax − position| and p(true position) over positions, and
        plots/position_probe.png, accuracy and error at each position per variant. "" when no run has one."""
        if not (groups := variants(runs, overrides, keys, PROBE_FILE)):
            return ""
        from lmlab.record.plots import plot_probe  # matplotlib: imported when there is something to draw

        rows, curves = [], {}
        for label, (values, probes) in groups.items():
            means = {f: statistics.fmean(p[f"mean_{f}"] for p in probes) for f in ("accuracy", "error", "p_true")}
            rows.append({**values, "n": len(probes), "step": probes[0]["step"], **means,
                         "chance_accuracy": probes[0]["chance_accuracy"]})
            per_position = {f: [statistics.fmean(v) for v in zip(*(p[f] for p in probes))]
                            for f in ("accuracy", "error")}
            curves[label] = {"position": probes[0]["position"], **per_position}
        plot_probe(curves, sweep_dir / "plots" / "position_probe.png")
        cols = [*keys, "n", "step", "accuracy", "error", "p_true", "chance_accuracy"]
        return ("\nPosition probe (accuracy and |argmax − position| over the positions; plots/position_probe.png)\n\n"
                + write_table(rows, cols, sweep_dir / "compare_probe"))

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer_sha256": self.tokenizer_sha256, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and state.get("seq_len") != self.seq_len:
            raise ValueError(f"the checkpoint's probe has model.max_seq_len={state.get('seq_len')}, the config "
                             f"{self.seq_len}; resume with the run's config")
