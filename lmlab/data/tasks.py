"""Which data module a `data` option is, and what the rest of lmlab may ask of one (the task protocol).

A corpus (every `data.name` that is not a task) is read by `TextDataModule`; a synthetic task brings its own data
module (`data=position_probe`: `lmlab.data.probe`; `data=mqar`: `lmlab.data.mqar`), a `lmlab.data.synthetic.
SyntheticTask` (its word tokenizer, its figures measured, logged and written at every validation). The training
loop, the summary, eval and compare ask every data module the same things, and a corpus answers with nothing:

- `trainer`: None, or the Lightning trainer running it (its step and ranks place the batches): a data module itself
  knows nothing of Lightning (lmlab.run.lit_data is its face there), so eval.py and compare read data without it;
- `callbacks(run_dir)`: the task's own callbacks (lmlab.data.callbacks: its metrics, its files in the run directory);
- `figures()`: what `summary.json` records of it;
- `eod_id`, `tokenizer`, `labels`: the end-of-document id, the tokenizer and a labelled set's labels, each declared
  None on the class until the data gives one (the model is built from them: lmlab.build_model, lmlab.run.plan);
- `evaluable`: whether `eval.py run=`'s loss per length applies to its runs (a task's `figures_file`: where its own are);
- a task only: `compare_section(sweep_dir, runs, overrides, keys)`, its own tables and plots in `eval.py compare=`
  ("" when no run of the sweep is one of its runs); compare asks every task in TASKS.
"""

from __future__ import annotations

from typing import Any

from lmlab.data.datamodule import TextDataModule
from lmlab.data.labelled import NAME as LABELLED
from lmlab.data.labelled import LabelledDataModule
from lmlab.data.mixture import MixtureDataModule
from lmlab.data.mqar import NAME as MQAR
from lmlab.data.mqar import MQARDataModule
from lmlab.data.probe import NAME as PROBE
from lmlab.data.probe import PositionProbeDataModule
from lmlab.data.sources import NAME as MIXTURE
from lmlab.data.token_bin import NAME as TOKEN_BIN
from lmlab.data.token_bin import TokenBinDataModule

# data.name -> its data module; every other name is a corpus that TextDataModule tokenizes (token_bin is a corpus
# already tokenized: its own module, with no section of its own in compare; mixture, several corpora by weight, with
# its per-source val losses in compare; labelled, texts and their labels for head=classify, its accuracy in compare)
TASKS = {PROBE: PositionProbeDataModule, MQAR: MQARDataModule, TOKEN_BIN: TokenBinDataModule,
         MIXTURE: MixtureDataModule, LABELLED: LabelledDataModule}


def module_class(name: str | None) -> type:
    """The data module class of the option `data.name`."""
    return TASKS.get(name or "", TextDataModule)


def build(data: dict[str, Any], *, seq_len: int, seed: int) -> Any:
    """The data module for the composed `data` group (a plain dict)."""
    return module_class(data.get("name"))(data, seq_len=seq_len, seed=seed)
