"""The documentation as a user reads it: the README and every page under docs/, their sections and code blocks."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.runs import ROOT

PAGES: dict[Path, str] = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}


def prose(text: str) -> str:
    """`text` without its code blocks: the headings and links a reader follows."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose(text), flags=re.M)}


def section(title: str) -> str:
    """The text from the heading `title` (on whichever page holds it) to the next heading of its level or above."""
    for text in PAGES.values():
        m = re.search(rf"^(#+) {re.escape(title)}$", prose(text), flags=re.M)
        if m is None:
            continue
        level = m.group(1)
        start = text.index(f"{level} {title}\n")
        end = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(level) + 1:], flags=re.M)
        return text[start:start + len(level) + 1 + end.start()] if end else text[start:]
    raise KeyError(f"no page has a section {title!r}")


def blocks(text: str, lang: str = r"\w*") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def train_commands() -> list[tuple[Path, str, list[str]]]:
    """Every training command of every page (`python train.py`, `lmlab train`, torchrun's, in a code block or an
    inline span): its page, its line, and its overrides with each swept key at its first value (Hydra's own keys,
    flags, `<placeholders>` and sweep functions such as `interval(...)` left out)."""
    found = []
    for page, text in PAGES.items():
        spans = [" ".join(s.split()) for s in re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`", prose(text))]
        for chunk in [*blocks(text), *spans]:
            for line in chunk.replace("\\\n", " ").splitlines():
                line = line.split("  #", 1)[0].strip()
                m = re.search(r"(?:python3? (?:\S*/)?train\.py|lmlab train|torchrun .*?train\.py)(?:\s|$)(.*)", line)
                if m is None or line.startswith("#"):
                    continue
                args = []
                for token in shlex.split(m.group(1)):
                    if token in ("&&", "|", ";"):
                        break
                    key, eq, value = token.partition("=")
                    if (not eq or token.startswith("-") or "<" in token or key.lstrip("+~").startswith("hydra")
                            or re.match(r"\w+\(", value)):
                        continue
                    args.append(f"{key}={_first(value)}")
                found.append((page, line, args))
    return found


def _first(value: str) -> str:
    """A swept value's first choice: `pre,post` -> `pre`; a list `[256,512]` stays whole."""
    depth = 0
    for i, ch in enumerate(value):
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            return value[:i]
    return value
