"""Values are checked by type and range before any data is read, by one mechanism: each option's signature
(`lr: Annotated[float, Range(gt=0)]`), the GPTConfig fields and the eval arguments are annotated, and a bad value
fails with a ValueError naming the key as the user types it and what it must be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT

# --- eval.py: the arguments are checked before any run is loaded ---

@pytest.mark.parametrize(("args", "message"), [
    (["lengths=[0]"], "lengths=[0] must be"),
    (["lengths=[-5]"], "lengths=[-5] must be"),
    (["lengths=[abc]"], "lengths=['abc'] must be"),
    (["lengths=[64,1.5]"], "lengths=[64, 1.5] must be"),
    (["batch_size=0"], "batch_size=0 must be an integer >= 1"),
    (["max_windows=0"], "max_windows=0 must be an integer >= 1 or null"),
    (["dynamic_step=-1"], "dynamic_step=-1 must be an integer >= 1 or null"),
    (["threads=0"], "threads=0 must be an integer >= 1 or null"),
    (["threads=abc"], "threads='abc' must be an integer >= 1 or null"),
])
def test_eval_cli_refuses_bad_arguments_before_loading_the_run(args: list[str], message: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "eval.py", f"run={tmp_path / 'no_such_run'}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert message in out, out
    assert "last.ckpt" not in out and "no such run directory" not in out, out  # the argument error came first


def test_a_refusal_is_one_line_and_exit_code_2_without_a_traceback(tmp_path: Path) -> None:
    """The message was the last line of a 3-8 frame traceback under Hydra's HYDRA_FULL_ERROR hint; with
    HYDRA_FULL_ERROR=1 the traceback is there for whoever wants it."""
    import subprocess
    import sys

    from tests.runs import ROOT, cli

    res = cli(str(ROOT / "train.py"), "optim.lr=abc", "logger=none", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("train.py: optim.lr='abc' must be")
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr, res.stderr[-2000:]
    # refused before the training stack is imported: Lightning (most of the 5 s a refusal took) never was
    imports = cli("-X", "importtime", str(ROOT / "train.py"), "optim.lr=abc", "logger=none", cwd=tmp_path)
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports.stderr.splitlines()
                if line.startswith("import time:")}
    assert imports.returncode == 2 and {"hydra", "torch"} <= imported  # at any depth of the import tree
    assert "lightning" not in imported and "lmlab.run.training" not in imported
    res = cli(str(ROOT / "eval.py"), f"run={tmp_path / 'nope'}", cwd=tmp_path)
    assert res.returncode == 2 and "eval.py: run=" in res.stderr and "no such run directory" in res.stderr
    full = subprocess.run([sys.executable, str(ROOT / "train.py"), "optim.lr=abc", "logger=none",
                           f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert full.returncode != 0 and "Traceback" in full.stderr and "optim.lr='abc'" in full.stderr
