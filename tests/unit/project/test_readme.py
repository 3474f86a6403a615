"""The README and the pages under docs/ as a user reads them: the README's table of contents links every section, no
link of any page is dead and every page is reachable from the README, the worked example for a new norm works as
written (made in a temporary copy of the package), and the compute-matched comparison runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.pages import PAGES, anchor, anchors, prose, section, train_commands
from tests.runs import ROOT

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
           "norm=center"]  # the worked example adds it


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
    import tests.unit.project.test_readme as me

    orphan, broken = ROOT / "docs" / "orphan.md", ROOT / "docs" / "broken.md"
    pages = {**PAGES, orphan: "# Orphan\n", broken: "# Broken\n[gone](nowhere.md) [no heading](axes.md#no-such)\n"}
    monkeypatch.setattr(me, "PAGES", pages)
    with pytest.raises(AssertionError, match=r"nowhere\.md \(no such file\).*axes\.md#no-such \(no such heading\)"):
        test_every_link_of_every_page_lands()
    with pytest.raises(AssertionError, match="orphan"):
        test_every_page_is_reachable_from_the_readme()
