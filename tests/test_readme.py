"""The README as a user reads it: its table of contents links every section, its worked example for a new norm works
as written (made in a temporary copy of the package), and its compute-matched comparison runs as written."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, tiny

README = (ROOT / "README.md").read_text()
PROSE = re.sub(r"^```.*?^```", "", README, flags=re.M | re.S)  # headings and links outside code blocks


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of its level or above."""
    level, rest = re.search(rf"^(#+) {re.escape(title)}$", README, flags=re.M).group(1), README
    start = rest.index(f"{level} {title}\n")
    end = re.search(rf"^#{{1,{len(level)}}} ", rest[start + len(level) + 1:], flags=re.M)
    return rest[start:start + len(level) + 1 + end.start()] if end else rest[start:]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def test_the_table_of_contents_lists_every_section_in_order_and_every_link_lands() -> None:
    headings = re.findall(r"^(#{2,3}) (.+)$", PROSE, flags=re.M)
    toc = re.findall(r"^( *)- \[(.+?)\]\(#(.+?)\)$", _section("Contents"), flags=re.M)
    sections = [(level, h) for level, h in headings if h != "Contents"]
    assert [(len(indent) // 2 + 2, title) for indent, title, _ in toc] == [(len(lv), h) for lv, h in sections]
    anchors = {_anchor(h) for _, h in headings}
    assert all(link == _anchor(title) for _, title, link in toc)
    dangling = sorted(set(re.findall(r"\]\(#([^)]+)\)", PROSE)) - anchors)
    assert dangling == [], dangling  # every in-page link of the README, the contents' and the prose's


@pytest.mark.e2e
def test_adding_a_norm_as_the_readme_says_works_first_time(corpus: Path, tmp_path: Path) -> None:
    """The three edits of "Add your own norm", exactly as written, in a copy of lmlab: `norm=dyt norm.alpha0=1.0`
    trains, the summary records it, and tests/test_norm.py (unedited) runs over it; the checkout itself refuses it."""
    section = _section("Add your own norm (a worked example)")
    (cls, entry), (yaml,) = _blocks(section, "python"), _blocks(section, "yaml")
    copy = tmp_path / "copy"
    for name in ("lmlab", "tests"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "golden"))
    for name in ("train.py", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    norm = copy / "lmlab" / "model" / "norm.py"
    source = norm.read_text()
    dict_line = next(line for line in source.splitlines() if line.startswith("NORMS = "))
    norm.write_text(source.replace(dict_line, f"{cls}\n\n{entry.strip()}"))
    stem = re.search(r"`lmlab/conf/norm/(\w+)\.yaml`", section).group(1)
    (copy / "lmlab" / "conf" / "norm" / f"{stem}.yaml").write_text(yaml)

    run = tmp_path / "run"
    args = [*tiny(corpus, tmp_path / "cache", "trainer.max_steps=5"), "norm=dyt", "norm.alpha0=1.0",
            f"hydra.run.dir={run}"]
    res = cli("train.py", *args, cwd=copy)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"]["norm"] == {"name": "dyt", "alpha0": 1.0}
    tested = cli("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_norm.py", "-k", "dyt", cwd=copy)
    assert tested.returncode == 0 and re.search(r"(\d+) passed", tested.stdout), tested.stdout[-3000:]
    assert int(re.search(r"(\d+) passed", tested.stdout).group(1)) >= 3
    here = cli(str(ROOT / "train.py"), "norm=dyt", cwd=tmp_path)  # the checkout has no dyt: the copy learnt it
    assert here.returncode == 2 and "norm has no option 'dyt'" in here.stderr


@pytest.mark.e2e
def test_the_compute_matched_comparison_runs_as_written(corpus: Path, tmp_path: Path) -> None:
    """The README's two commands: the budget gives each depth the steps the README says (on the default corpus's
    vocabulary of 85), and the same commands, on a small corpus at a smaller budget, train both and compare them."""
    from lmlab import compose
    from lmlab.run.budget import apply
    from lmlab.config import arch_config
    from lmlab.model.gpt import validate

    section = _section("Budgets: compute-matched comparisons")
    train_cmd, eval_cmd = [shlex.split(line.split("  #")[0]) for line in _blocks(section, "bash")[0].splitlines()]
    assert train_cmd[:3] == ["python", "train.py", "-m"] and eval_cmd[:2] == ["python", "eval.py"]
    sweep = next(a for a in train_cmd if a.startswith("model.n_layer=")).split("=")[1].split(",")
    said = re.search(r"train FLOPs: (\d+) and (\d+)\s+steps", section).groups()
    flops = next(a for a in train_cmd if a.startswith("budget.flops="))
    for n, steps in zip(sweep, said):
        cfg = compose([f"model.n_layer={n}", flops])
        assert apply(cfg, validate(arch_config(cfg, vocab_size=85)))["steps"] == int(steps)

    sweep_dir = tmp_path / "equal_flops"
    args = [a.replace("multirun/equal_flops", str(sweep_dir)) for a in train_cmd[2:]]
    args = [re.sub(r"budget\.flops=\S+", "budget.flops=2e9", a) for a in args]  # tens of steps at d 32
    small = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "model.n_layer"))]
    res = cli("train.py", *args, *small, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("eval.py", *(a.replace("multirun/equal_flops", str(sweep_dir)) for a in eval_cmd[2:]), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(sweep_dir / "compare.csv")
    assert sorted(rows) == [2, 4] and all(r["status"] == "completed" for r in rows.values())
    spent = {n: int(r["steps"]) * float(r["flops_per_token"]) for n, r in rows.items()}
    assert int(rows[2]["steps"]) > int(rows[4]["steps"]) and spent[2] == pytest.approx(spent[4], rel=0.1)


def _rows(path: Path) -> dict[int, dict[str, str]]:
    import csv

    with open(path) as f:
        return {int(r["model.n_layer"]): r for r in csv.DictReader(f)}
