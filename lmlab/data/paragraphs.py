"""Documents of natural, varied length from texts: each blank-line-separated paragraph written as its own file, for
data=text_files (one document a file) and data.packing=padded. From Shakespeare's texts (the default corpus) these are
the speeches: ~39,000 documents, median ~60 characters, a tenth over 300 — the variable-length text the BatchNorm
argument is about (docs/studies/norm_compare.md).

    python -m lmlab.data.paragraphs OUT_DIR [TEXT_FILE_OR_DIR ...]   # no texts: Shakespeare's (fetched once)
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

from lmlab.data.corpus import shakespeare_files, text_files

_BLANK = re.compile(r"\n\s*\n")


def paragraphs(text: str) -> list[str]:
    """The text's paragraphs (split at lines holding only whitespace), stripped, the empty ones left out."""
    return [p.strip() + "\n" for p in _BLANK.split(text) if p.strip()]


def write_paragraphs(files: Iterable[Path], out: Path) -> int:
    """Each paragraph of each file (in order) as out/<file stem>-<n>.txt; the number written. Names sort in order."""
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for f in files:
        for i, p in enumerate(paragraphs(Path(f).read_text(encoding="utf-8"))):
            (out / f"{Path(f).stem}-{i:06d}.txt").write_text(p, encoding="utf-8")
            written += 1
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmlab.data.paragraphs", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write the documents into")
    parser.add_argument("texts", nargs="*", help="text files or directories of *.txt (default: Shakespeare's)")
    parser.add_argument("--cache-dir", default="~/.cache/lmlab", help="where Shakespeare's texts are cached")
    args = parser.parse_args(argv)
    files = text_files(args.texts) if args.texts else shakespeare_files(args.cache_dir)
    n = write_paragraphs(files, args.out)
    print(f"{n} documents from {len(files)} files in {args.out}")


if __name__ == "__main__":
    main()
