"""The package's layout as a new interpreter meets it: an old module path still runs with `python -m`, and reading
runs imports no Lightning (tests/unit/project/test_layout.py reads the imports from the code)."""

from __future__ import annotations

import subprocess
import sys

from tests.runs import ROOT

PACKAGE = ROOT / "lmlab"


def test_an_old_module_path_still_runs_with_python_m() -> None:
    res = subprocess.run([sys.executable, "-m", "lmlab.consolidate", "--help"], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=120)
    assert res.returncode == 0 and "sharded checkpoint" in res.stdout, res.stderr[-2000:]


def test_reading_runs_imports_no_lightning() -> None:
    """eval.py, generate.py, compare, the HF export and the bench read data and models without Lightning (seconds of
    each start): only training meets it, through lmlab.run.lit_data and a task's lmlab.data.callbacks."""
    readers = ("lmlab.commands.eval", "lmlab.analysis.evaluate", "lmlab.analysis.compare", "lmlab.generate",
               "lmlab.interop.hf", "lmlab.bench.cli", "lmlab.data.tasks")
    code = (f"import sys; import {', '.join(readers)}; from lmlab.record.tracking import wandb_spec; "
            "wandb_spec({}); wandb_spec({'tensorboard': None}); "  # a run's loggers that are not W&B (logger=csv)
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', "
            "'torchmetrics'}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]
    data = {path.name for path in (PACKAGE / "data").glob("*.py") if "lightning.pytorch" in path.read_text()}
    assert data <= {"callbacks.py", "labelled.py", "synthetic.py"}, data  # the two: type hints only (TYPE_CHECKING)
