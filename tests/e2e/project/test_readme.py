"""The README and the pages under docs/ as a user reads them: the README's table of contents links every section, no
link of any page is dead and every page is reachable from the README, the worked example for a new norm works as
written (made in a temporary copy of the package), and the compute-matched comparison runs as written."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.pages import blocks, section
from tests.runs import ROOT, cli, tiny


def test_adding_a_norm_as_the_readme_says_works_first_time(corpus: Path, tmp_path: Path) -> None:
    """The three edits of "Add your own norm", exactly as written, in a copy of lmlab: `norm=center norm.gain0=2.0`
    trains, the summary records it, and tests/unit/model/test_norm.py (unedited) runs over it; the checkout itself refuses it."""
    text = section("Add your own norm (a worked example)")
    (cls, entry), (yaml,) = blocks(text, "python"), blocks(text, "yaml")
    copy = tmp_path / "copy"
    for name in ("lmlab", "tests"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "golden"))
    for name in ("train.py", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    norm = copy / "lmlab" / "model" / "norm.py"
    source = norm.read_text()
    dict_line = next(line for line in source.splitlines() if line.startswith("NORMS = "))
    norm.write_text(source.replace(dict_line, f"{cls}\n\n{entry.strip()}"))
    stem = re.search(r"`lmlab/conf/norm/(\w+)\.yaml`", text).group(1)
    (copy / "lmlab" / "conf" / "norm" / f"{stem}.yaml").write_text(yaml)

    run = tmp_path / "run"
    args = [*tiny(corpus, tmp_path / "cache", "trainer.max_steps=5"), "norm=center", "norm.gain0=2.0",
            f"hydra.run.dir={run}"]
    res = cli("train.py", *args, cwd=copy)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"]["norm"] == {"name": "center", "gain0": 2.0}
    tested = cli("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/model/test_norm.py", "-k", "center",
                 cwd=copy)
    assert tested.returncode == 0 and re.search(r"(\d+) passed", tested.stdout), tested.stdout[-3000:]
    assert int(re.search(r"(\d+) passed", tested.stdout).group(1)) >= 3
    here = cli(str(ROOT / "train.py"), "norm=center", cwd=tmp_path)  # the checkout has none: the copy learnt it
    assert here.returncode == 2 and "norm has no option 'center'" in here.stderr


def test_the_compute_matched_comparison_runs_as_written(corpus: Path, tmp_path: Path) -> None:
    """The README's two commands: the budget gives each depth the steps the README says (on the default corpus's
    vocabulary of 85), and the same commands, on a small corpus at a smaller budget, train both and compare them."""
    from lmlab import compose
    from lmlab.config import arch_config
    from lmlab.model.gpt import validate
    from lmlab.run.budget import apply

    text = section("Budgets: compute-matched comparisons")
    train_cmd, eval_cmd = [shlex.split(line.split("  #")[0]) for line in blocks(text, "bash")[0].splitlines()]
    assert train_cmd[:3] == ["python", "train.py", "-m"] and eval_cmd[:2] == ["python", "eval.py"]
    sweep = next(a for a in train_cmd if a.startswith("model.n_layer=")).split("=")[1].split(",")
    said = re.search(r"train FLOPs: (\d+) and (\d+)\s+steps", text).groups()
    flops = next(a for a in train_cmd if a.startswith("budget.flops="))
    for n, steps in zip(sweep, said):
        cfg = compose([f"model.n_layer={n}", flops])
        assert apply(cfg, validate(arch_config(cfg, vocab_size=85)))["steps"] == int(steps)

    sweep_dir = tmp_path / "equal_flops"
    args = [a.replace("multirun/equal_flops", str(sweep_dir)) for a in train_cmd[2:]]
    args = [re.sub(r"budget\.flops=\S+", "budget.flops=2e9", a) for a in args]  # tens of steps at d 32
    small = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "model.n_layer"))]
    res = cli("train.py", *args, *small, cwd=ROOT, fresh=True)  # as the README types it
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("eval.py", *(a.replace("multirun/equal_flops", str(sweep_dir)) for a in eval_cmd[2:]), cwd=ROOT,
              fresh=True)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(sweep_dir / "compare.csv")
    assert sorted(rows) == [2, 4] and all(r["status"] == "completed" for r in rows.values())
    spent = {n: int(r["steps"]) * float(r["flops_per_token"]) for n, r in rows.items()}
    assert int(rows[2]["steps"]) > int(rows[4]["steps"]) and spent[2] == pytest.approx(spent[4], rel=0.1)


def _rows(path: Path) -> dict[int, dict[str, str]]:
    import csv

    with open(path) as f:
        return {int(r["model.n_layer"]): r for r in csv.DictReader(f)}
