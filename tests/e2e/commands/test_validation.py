"""Values are checked by type and range before any data is read, by one mechanism: each option's signature
(`lr: Annotated[float, Range(gt=0)]`), the GPTConfig fields and the eval arguments are annotated, and a bad value
fails with a ValueError naming the key as the user types it and what it must be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.runs import ROOT

# --- eval.py: the arguments are checked before any run is loaded ---

BAD_EVAL_ARGS = [
    (["lengths=[0]"], "lengths=[0] must be"),
    (["lengths=[-5]"], "lengths=[-5] must be"),
    (["lengths=[abc]"], "lengths=['abc'] must be"),
    (["lengths=[64,1.5]"], "lengths=[64, 1.5] must be"),
    (["batch_size=0"], "batch_size=0 must be an integer >= 1"),
    (["max_windows=0"], "max_windows=0 must be an integer >= 1 or null"),
    (["dynamic_step=-1"], "dynamic_step=-1 must be an integer >= 1 or null"),
    (["threads=0"], "threads=0 must be an integer >= 1 or null"),
    (["threads=abc"], "threads='abc' must be an integer >= 1 or null"),
]

# eval.py's own entry (`run`, what `python eval.py` calls) once per argument list, in one process (one start-up for
# all of them, ~10 s each): each list's exit status and what it printed, as JSON
_EVAL_EACH = """
import contextlib, io, json, sys
from lmlab.commands.eval import run
results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            run("python eval.py", args)
        code = 0
    except SystemExit as exit:
        code = exit.code
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


def test_eval_cli_refuses_bad_arguments_before_loading_the_run(tmp_path: Path) -> None:
    """Each bad argument: a non-zero exit naming the argument and what it accepts, before the run is looked for."""
    import json

    lists = [[f"run={tmp_path / 'no_such_run'}", *args] for args, _ in BAD_EVAL_ARGS]
    proc = subprocess.run([sys.executable, "-c", _EVAL_EACH, json.dumps(lists)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = [(args, code, out) for (args, message), (code, out) in zip(BAD_EVAL_ARGS, results, strict=True)
             if code in (0, None) or message not in out or "last.ckpt" in out or "no such run directory" in out]
    assert wrong == [], wrong  # each refused, naming its argument, and the argument error came first


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
    assert not (tmp_path / "r").exists()  # a refused start leaves no empty run directory
    imports = cli("-X", "importtime", str(ROOT / "train.py"), "optim.lr=abc", "logger=none", cwd=tmp_path)
    assert not any((tmp_path / "outputs").iterdir())  # Hydra's outputs/<date>/<time> removed with its date
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
