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

from tests.pages import PAGES, anchor, anchors, blocks, prose, section, train_commands
from tests.runs import ROOT, cli, tiny

README = PAGES[ROOT / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_table_of_contents_lists_every_section_in_order_and_every_link_lands() -> None:
    headings = re.findall(r"^(#{2,3}) (.+)$", prose(README), flags=re.M)
    toc = re.findall(r"^( *)- \[(.+?)\]\(#(.+?)\)$", section("Contents"), flags=re.M)
    sections = [(level, h) for level, h in headings if h != "Contents"]
    assert [(len(indent) // 2 + 2, title) for indent, title, _ in toc] == [(len(lv), h) for lv, h in sections]
    assert all(link == anchor(title) for _, title, link in toc)


def test_every_link_of_every_page_lands() -> None:
    """Each page's links, to a heading of its own, to another page (and a heading there), to a file or folder of the
    checkout: none is dead."""
    dead = []
    for page, text in PAGES.items():
        for target in LINK.findall(prose(text)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, heading = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif heading and file.suffix == ".md" and heading not in anchors(file.read_text()):
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert dead == [], dead


def test_every_page_is_reachable_from_the_readme() -> None:
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page not in PAGES:
            continue
        seen.add(page)
        for target in LINK.findall(prose(PAGES[page])):
            path = target.partition("#")[0]
            if path.endswith(".md") and not target.startswith("http"):
                todo.append((page.parent / path).resolve())
    assert sorted(p.relative_to(ROOT) for p in set(PAGES) - seen) == []
    assert len(README.splitlines()) <= 400  # a front door: the rest lives on the pages it links


# What a page shows being refused; every other command must pass (`experiment=NAME` stands for any study).
REFUSED = ["norm=nope",  # the README's example of a refusal
           "norm=dyt"]  # the worked example adds it


def test_every_training_command_of_every_page_composes_and_passes_the_checks_before_training() -> None:
    """Each `python train.py ...` of the README and docs/ (81 when written), with each sweep at its first value: its
    config composes and passes every check train.py makes before it writes anything (types, ranges, memory, the
    devices: on a machine without a GPU a GPU command may only be refused for that)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lmlab import compose
    from lmlab.run.checks import check_config

    commands = train_commands()
    assert len(commands) >= 60, len(commands)
    wrong, seen = [], set()
    for page, line, args in commands:
        if any(re.fullmatch(r"\w+=[A-Z]+", a) for a in args) or tuple(args) in seen:
            continue
        seen.add(tuple(args))
        refused = next((a for a in args if a in REFUSED), None)
        try:
            check_config(compose(args), args)
        except (ValueError, TypeError, HydraException, OmegaConfBaseException) as err:
            if "needs a CUDA GPU" in str(err) or (refused and f"'{refused.replace('=', '/')}'" in str(err)):
                continue
            wrong.append(f"{page.relative_to(ROOT)}: {line}: {type(err).__name__}: {str(err)[:300]}")
        else:
            if refused:
                wrong.append(f"{page.relative_to(ROOT)}: {line}: not refused")
    assert wrong == [], "\n".join(wrong)


def test_a_dead_link_or_an_unreachable_page_is_caught(tmp_path: Path, monkeypatch) -> None:
    """The two checks above fail on a page with a dead link and on a page nothing links."""
    import tests.test_readme as me

    orphan, broken = ROOT / "docs" / "orphan.md", ROOT / "docs" / "broken.md"
    pages = {**PAGES, orphan: "# Orphan\n", broken: "# Broken\n[gone](nowhere.md) [no heading](axes.md#no-such)\n"}
    monkeypatch.setattr(me, "PAGES", pages)
    with pytest.raises(AssertionError, match=r"nowhere\.md \(no such file\).*axes\.md#no-such \(no such heading\)"):
        test_every_link_of_every_page_lands()
    with pytest.raises(AssertionError, match="orphan"):
        test_every_page_is_reachable_from_the_readme()


@pytest.mark.e2e
def test_adding_a_norm_as_the_readme_says_works_first_time(corpus: Path, tmp_path: Path) -> None:
    """The three edits of "Add your own norm", exactly as written, in a copy of lmlab: `norm=dyt norm.alpha0=1.0`
    trains, the summary records it, and tests/test_norm.py (unedited) runs over it; the checkout itself refuses it."""
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
